"""zerort's own kernels on torch tensors, CPU or CUDA: the FP32 <-> bf16/f16 casts
(optim/cast.h), the fused AdamW, the unscale/non-finite/norm pass and the local sum of a
reduce-scatter, and the two-hop int8 wire's block codes. Tests and benchmarks call these; the
engine calls the kernels from C++.
Every tensor of one call must be on one device; CUDA kernels run on the default stream."""
import torch

from zerort import _C
from zerort.comm.tensor_args import buffer, device_index, dtype_name


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


def adamw_step(grad, master, exp_avg, exp_avg_sq, param, *, lr, betas, eps, weight_decay, step,
               grad_multiplier=1.0):
    """One fused AdamW pass. grad: float32 or bfloat16; master: float32; exp_avg/exp_avg_sq:
    float32, or both bfloat16 (the moments kept in bf16); param: bfloat16/float16
    low-precision copy written from the new master (or None)."""
    n, f32, dev = master.numel(), torch.float32, master.device
    _C.adamw_step(buffer(grad, "grad", n, device=dev), dtype_name(grad, "grad"),
                  buffer(master, "master", n, f32, dev), buffer(exp_avg, "exp_avg", n, device=dev),
                  buffer(exp_avg_sq, "exp_avg_sq", n, exp_avg.dtype, dev), dtype_name(exp_avg, "exp_avg"),
                  0 if param is None else buffer(param, "param", n, device=dev),
                  "bf16" if param is None else dtype_name(param, "param"), n, lr, betas[0],
                  betas[1], eps, weight_decay, step, grad_multiplier, device_index(dev))


def unscale_and_check(grad, inv_scale):
    """grad *= inv_scale in place; returns (non-finite count, sum of squares in FP64)."""
    return _C.unscale_and_check(buffer(grad, "grad", dtype=torch.float32, device=grad.device), grad.numel(),
                                inv_scale, device_index(grad.device))


def sum_chunks_to_f32(chunks, out, accumulate=False):
    """The local half of reduce_scatter_accumulate: chunks (bf16/f16/f32, world * n elements,
    chunk r from rank r) summed in rank order in FP64, rounded once into out (float32, n)."""
    n, dev = out.numel(), out.device
    if n == 0 and chunks.numel() == 0:
        return out
    if n == 0 or chunks.numel() % n:
        raise ValueError(f"sum_chunks_to_f32: chunks has {chunks.numel()} elements, not a positive multiple "
                         f"of out's {n}")
    _C.sum_chunks_to_f32(buffer(chunks, "chunks", device=dev), dtype_name(chunks, "chunks"), chunks.numel() // n,
                         n, buffer(out, "out", dtype=torch.float32, device=dev), accumulate, device_index(dev))
    return out


def int8_blocks(x, block=None, code="int8"):
    """x (float32, CPU) through an 8-bit wire (C++ Note [int8 blocks]; code "int8" or
    "fp8_e4m3"): returns (wire, decoded), the wire's bytes (uint8: the codes, padded to 4
    bytes, then one float32 scale per block) and the float32 values the receiver takes."""
    block = block or _C.INT8_BLOCK
    n = x.numel()
    wire = torch.empty(_C.int8_wire_bytes(n, block), dtype=torch.uint8)
    out = torch.empty(n, dtype=torch.float32)
    _C.encode_8bit_blocks(code, buffer(x, "x", n, torch.float32), n, wire.data_ptr(), block)
    _C.decode_8bit_blocks(code, wire.data_ptr(), n, out.data_ptr(), block)
    return wire, out
