"""The CUDA tests: they run where torch sees a GPU and zerort was built with CUDA and NCCL
(scripts/gpu_check.sh), and skip, saying why, everywhere else."""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import zerort  # noqa: E402


def gpu_skip_reason():
    if not zerort._C.with_cuda or not zerort._C.with_nccl:
        return "zerort was built without CUDA/NCCL (nvcc not found at configure time)"
    if not torch.cuda.is_available():
        return f"no CUDA device visible to torch {torch.__version__} (CPU-only machine or CPU build of torch)"
    return None


def pytest_collection_modifyitems(config, items):
    """A session-wide hook: it sees every collected test, so it marks only this folder's."""
    reason = gpu_skip_reason()
    if reason:
        for item in items:
            if os.path.dirname(str(item.path)) == HERE:
                item.add_marker(pytest.mark.skip(reason=f"CUDA test skipped: {reason}"))
