"""deepspeed.runtime.zero.partition_parameters on zerort: ZeroParamStatus, and zero.Init and
GatheredParameters under the names DeepSpeed defines them here; and the two names
transformers' ZeRO-3 loading reads here (prevent_arange_dtype_change swaps
zero_wrapper_for_fp_tensor_constructor for one that leaves torch.arange's dtype alone, and
compares the wrapped function with _orig_torch_arange).

zerort's Init does not wrap torch's tensor constructors: the parameters built inside are
recorded FP32 values on the meta device (Note [recorded initialization]) and the compute
dtype comes at initialize, so nothing in zerort calls the wrapper, and swapping it changes
nothing. It is here with DeepSpeed's meaning for a script that calls it itself.
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


__getattr__ = not_provided(__name__)
