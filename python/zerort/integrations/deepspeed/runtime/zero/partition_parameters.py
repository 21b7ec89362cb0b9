"""deepspeed.runtime.zero.partition_parameters on zerort: ZeroParamStatus, and zero.Init and
GatheredParameters under the names DeepSpeed defines them here; and the two names
transformers' ZeRO-3 loading reads here (prevent_arange_dtype_change swaps
zero_wrapper_for_fp_tensor_constructor for one that leaves torch.arange's dtype alone, and
compares the wrapped function with _orig_torch_arange).

zerort's Init wraps torch's tensor constructors with its own recording wrappers (Note
[build dtype], zerort.integrations.deepspeed.init_record), not through this name; it reads
a swap of it as DeepSpeed's Init would meet it: while transformers' swap that leaves
torch.arange alone is in place, zerort's Init leaves torch.arange in its own dtype too.
The wrapper is here with DeepSpeed's meaning for a script that calls it itself.
"""
import os

import torch

from zerort.integrations.deepspeed.accelerator import get_accelerator  # noqa: F401  (DeepSpeed imports it here)
from zerort.integrations.deepspeed.names import not_provided
from zerort.integrations.deepspeed.zero import GatheredParameters, Init, ZeroParamStatus  # noqa: F401

_orig_torch_arange = torch.arange  # the unwrapped constructor, as DeepSpeed keeps it


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device=None):
    """DeepSpeed's wrapper: fn's tensor on target_device (or this rank's accelerator) when
    no device= is given, and a floating-point result cast to target_fp_dtype."""
    def wrapped_fn(*args, **kwargs):
        if kwargs.get("device") is None:
            kwargs["device"] = target_device if target_device is not None else \
                torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0))))
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn


DEEPSPEEDS_WRAPPER = zero_wrapper_for_fp_tensor_constructor  # this module's own, to tell a swap from it

__getattr__ = not_provided(__name__)
