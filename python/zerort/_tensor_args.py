"""Turns tensors into the (data_ptr, numel, dtype name) triples zerort._C takes, with the
checks a user needs: CPU, contiguous, expected dtype and size. Errors name the argument."""
import torch

DTYPE_NAMES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
}


def dtype_name(t, arg):
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(f"{arg}: dtype {t.dtype} is not supported; use one of "
                        f"{', '.join(str(d) for d in DTYPE_NAMES)}") from None


def buffer(t, arg, numel=None, dtype=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{arg}: tensor is on {t.device}; the CPU backends take CPU tensors")
    if not t.is_contiguous():
        raise ValueError(f"{arg}: tensor must be contiguous; call .contiguous() first")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{arg}: expected dtype {dtype}, got {t.dtype}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{arg}: expected {numel} elements, got {t.numel()}")
    return t.data_ptr()
