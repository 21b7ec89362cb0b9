"""Turns tensors into the (data_ptr, numel, dtype name) triples zerort._C takes, with the
checks a user needs: expected device, contiguous, expected dtype and size. Errors name the
argument."""
import torch

from zerort import _C
from zerort.errors import DeviceError

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
        raise DeviceError(f"{arg}: dtype {t.dtype} is not supported; use one of "
                        f"{', '.join(str(d) for d in DTYPE_NAMES)}") from None


def device_index(device):
    """The device argument of zerort._C's kernels: -1 for CPU, else the CUDA index."""
    device = torch.device(device)
    if device.type == "cpu":
        return -1
    if device.type != "cuda" or not _C.with_cuda:
        raise DeviceError(f"tensors on {device} are not supported by this build of zerort "
                         f"({'CPU and CUDA' if _C.with_cuda else 'CPU only: nvcc was not found at build time'})")
    return torch.cuda.current_device() if device.index is None else device.index


def buffer(t, arg, numel=None, dtype=None, device="cpu"):
    """t's data_ptr after the checks; t must be on `device` (a torch.device or string)."""
    if not isinstance(t, torch.Tensor):
        raise DeviceError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device != torch.device(device):
        hint = ("the mpi and gloo backends take CPU tensors" if torch.device(device).type == "cpu"
                else f"move it with .to('{device}')")
        raise DeviceError(f"{arg}: tensor is on {t.device}, expected {device}; {hint}")
    if not t.is_contiguous():
        raise DeviceError(f"{arg}: tensor must be contiguous; call .contiguous() first")
    if dtype is not None and t.dtype != dtype:
        raise DeviceError(f"{arg}: expected dtype {dtype}, got {t.dtype}")
    if numel is not None and t.numel() != numel:
        raise DeviceError(f"{arg}: expected {numel} elements, got {t.numel()}")
    return t.data_ptr()
