"""Param groups on a CUDA model (W = 1, NCCL): the fused AdamW runs once per stretch of
the shard that shares a group, on the device. Against torch.optim.AdamW with the same
groups and a LambdaLR on the same GPU, in FP32 (test_lr_schedules.against_torch_adamw)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import zerort  # noqa: E402
from test_lr_schedules import against_torch_adamw  # noqa: E402


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_param_groups_on_cuda_match_torch(stage):
    comm = zerort.comm.init("nccl", timeout_s=120)
    against_torch_adamw(stage, lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
                        device="cuda", comm=comm, atol=1e-5)
