"""The fused optimizer kernels on torch CPU tensors (tests and benchmarks use these; the
engine calls them from C++)."""
import torch

from . import _C
from ._tensor_args import buffer, dtype_name


def adamw_step(grad, master, exp_avg, exp_avg_sq, param, *, lr, betas, eps, weight_decay, step,
               grad_multiplier=1.0):
    """One fused AdamW pass. grad: float32 or bfloat16; master/exp_avg/exp_avg_sq: float32;
    param: bfloat16/float16 low-precision copy written from the new master (or None)."""
    n = master.numel()
    f32 = torch.float32
    _C.adamw_step(buffer(grad, "grad", n), dtype_name(grad, "grad"), buffer(master, "master", n, f32),
                  buffer(exp_avg, "exp_avg", n, f32), buffer(exp_avg_sq, "exp_avg_sq", n, f32),
                  0 if param is None else buffer(param, "param", n),
                  "bf16" if param is None else dtype_name(param, "param"), n, lr, betas[0],
                  betas[1], eps, weight_decay, step, grad_multiplier)


def unscale_and_check(grad, inv_scale):
    """grad *= inv_scale in place; returns (non-finite count, sum of squares in FP64)."""
    return _C.unscale_and_check(buffer(grad, "grad", dtype=torch.float32), grad.numel(), inv_scale)
