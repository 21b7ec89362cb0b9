"""FP32 <-> bf16/f16 casts through zerort's own kernels (optim/cast.h)."""
import torch

from . import _C
from ._tensor_args import buffer, dtype_name


def cast(t, dtype):
    """Returns t (CPU, contiguous) cast to dtype. One side must be float32, the other
    bfloat16 or float16. Rounds to nearest even."""
    out = torch.empty(t.shape, dtype=dtype)
    n = t.numel()
    if t.dtype == torch.float32:
        _C.cast_from_f32(buffer(t, "t"), buffer(out, "out"), dtype_name(out, "dtype"), n)
    elif dtype == torch.float32:
        _C.cast_to_f32(buffer(t, "t"), dtype_name(t, "t"), buffer(out, "out"), n)
    else:
        raise TypeError(f"cast: one side must be torch.float32, got {t.dtype} -> {dtype}")
    return out
