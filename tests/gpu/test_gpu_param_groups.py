"""Param groups on a CUDA model (W = 1, NCCL): the fused AdamW runs once per stretch of
the shard that shares a group, on the device. Against torch.optim.AdamW with the same
groups and a LambdaLR, on the same GPU, in FP32 (bound as tests/python/test_lr_schedules')."""
import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import zerort  # noqa: E402
from test_lr_schedules import batch, groups, model  # noqa: E402


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_param_groups_on_cuda_match_torch(stage):
    m = model().cuda()
    comm = zerort.comm.init("nccl", timeout_s=120)
    e = zerort.initialize(m, {"stage": stage, "precision": "fp32", "optimizer": {"weight_decay": 0.1}}, comm=comm,
                          param_groups=groups(m))
    sched = torch.optim.lr_scheduler.LambdaLR(e.optimizer, lambda s: 1.0 / (1 + s))
    ref = model().cuda()
    opt = torch.optim.AdamW(groups(ref), lr=1e-3, weight_decay=0.1, foreach=False)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for step in range(6):
        x, y = (t.cuda() for t in batch(step))
        e.backward(nn.functional.mse_loss(e(x).float(), y))
        e.step()
        sched.step()
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        ref_sched.step()
    got = e.full_state_dict(master=True)
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k].float(), v, rtol=0, atol=1e-5), k
