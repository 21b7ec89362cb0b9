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

from zerort import _C  # noqa: E402
from zerort._C import ShardLayout  # noqa: E402,F401
from zerort.errors import (CheckpointError, CollectiveMismatchError, CommError, CommTimeoutError,  # noqa: E402,F401
                           ConfigError, DeviceError, Error, LossScaleError, ModelMismatchError, NonFiniteError,
                           UsageError)

__version__ = _C.__version__

# The package by concern (dependencies point down): integrations/ (deepspeed, hf) ->
# engine/ -> monitoring/, accounting/ -> state/ -> layout/ -> config/, comm/ -> errors,
# lifecycle -> zerort._C.
from zerort import comm, config, state  # noqa: E402,F401
from zerort.comm import Communicator, detect_launch_env  # noqa: E402,F401
from zerort.engine import Engine, initialize  # noqa: E402,F401


def estimate_memory(*args, **kwargs):
    """Model-state bytes per rank by category (zerort.accounting.memory.estimate_memory)."""
    from zerort.accounting.memory import estimate_memory as estimate  # not at import: it is also a python -m

    return estimate(*args, **kwargs)
