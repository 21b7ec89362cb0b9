"""zerort: a ZeRO runtime for PyTorch training with its core in C++.

Import order matters: torch first (zerort._C links LibTorch), then libmpi with RTLD_GLOBAL
so Open MPI's plugins can resolve its symbols when MPI is initialised from an extension.
"""
import ctypes
import ctypes.util

import torch  # noqa: F401  (loads LibTorch before zerort._C)


def _preload_mpi():
    name = ctypes.util.find_library("mpi")
    if name:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass


_preload_mpi()

from . import _C  # noqa: E402
from ._C import ShardLayout  # noqa: E402,F401
from .errors import (CollectiveMismatchError, CommError, CommTimeoutError, ConfigError, DeviceError,  # noqa: E402,F401
                     Error, LossScaleError, ModelMismatchError, NonFiniteError, UsageError)

__version__ = _C.__version__

from . import comm  # noqa: E402,F401
from .comm import Communicator, detect_launch_env  # noqa: E402,F401
from . import config  # noqa: E402,F401
from . import checkpoint  # noqa: E402,F401
from .engine import Engine, initialize  # noqa: E402,F401


def estimate_memory(*args, **kwargs):
    """Model-state bytes per rank by category (zerort.memory.estimate_memory)."""
    from .memory import estimate_memory as estimate  # not at import: python -m zerort.memory

    return estimate(*args, **kwargs)
