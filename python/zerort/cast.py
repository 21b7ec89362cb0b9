"""FP32 <-> bf16/f16 casts through zerort's own kernels (optim/cast.h)."""
import torch

from . import _C
from ._tensor_args import buffer, device_index, dtype_name


def cast(t, dtype):
    """Returns t (contiguous, on CPU or CUDA) cast to dtype on the same device. One side must
    be float32, the other bfloat16 or float16. Rounds to nearest even."""
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    n, dev = t.numel(), t.device
    if t.dtype == torch.float32:
        _C.cast_from_f32(buffer(t, "t", device=dev), buffer(out, "out", device=dev), dtype_name(out, "dtype"), n,
                         device_index(dev))
    elif dtype == torch.float32:
        _C.cast_to_f32(buffer(t, "t", device=dev), dtype_name(t, "t"), buffer(out, "out", device=dev), n,
                       device_index(dev))
    else:
        raise TypeError(f"cast: one side must be torch.float32, got {t.dtype} -> {dtype}")
    return out
