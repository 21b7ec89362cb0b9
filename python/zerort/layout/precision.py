"""Which modules compute in FP32 when the compute dtype is bf16 or fp16, and which float
buffers keep their dtype. zerort.initialize (engine.py; stage 3 through the FP32 parameter
ids it is given) and zerort.estimate_memory (memory.py) both follow fp32_plan() below, and
group their parameters with group_params().

FP32 modules. A norm layer stays FP32 because of what it is: an instance of one of torch's
norm classes (TORCH_NORMS: LayerNorm, RMSNorm, GroupNorm, LocalResponseNorm, CrossMapLRN2d
and the _NormBase family: BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm1d/2d/3d and their
lazy forms, subclasses included), or any module whose class name ends in "Norm"
(HuggingFace's LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm, T5LayerNorm, ...). Config
fp32_modules changes the rule by exact class name: "Name" adds a class, "-Name" removes
one. An FP32 module keeps every parameter and buffer of its subtree in FP32 and computes in
FP32: its floating inputs (positional and keyword) are cast to FP32, its floating outputs
back to the compute dtype.

Float buffers keep the dtype the model gave them unless their module computes in the
compute dtype:
- a module with parameters (its own or its submodules', frozen or not) outside FP32
  modules computes in the compute dtype, and its float buffers are cast to it: its forward
  combines them with its weights' activations (a scale, a mask, a table added to them), and
  torch does not mix bf16 with fp32 in a matmul.
- the buffers of FP32 modules stay FP32 (BatchNorm's running statistics).
- a module without any parameters that holds float buffers (HuggingFace's rotary
  embeddings with inv_freq, a sinusoidal position table, a fixed mask or projection) keeps
  them as built and computes in FP32, like an FP32 module: inputs cast to FP32, outputs
  back to the compute dtype. "-Name" in fp32_modules turns that off for its class: its
  buffers are then cast and it computes in the compute dtype.
"""
import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from zerort.errors import ConfigError

TORCH_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm,
               nn.CrossMapLRN2d)


def is_norm(module, fp32_modules=()):
    """Whether module is an FP32 module by the norm rule and config fp32_modules (a class
    name adds its class, "-" and a class name removes it; exact class names)."""
    name = type(module).__name__
    if "-" + name in fp32_modules:
        return False
    return name in fp32_modules or isinstance(module, TORCH_NORMS) or name.endswith("Norm")


@dataclass
class FP32Plan:
    """What zerort.initialize does to a model under bf16 or fp16."""
    fp32_modules: list = field(default_factory=list)  # run in FP32 (inputs cast up, outputs down); outermost only
    fp32_ids: set = field(default_factory=set)         # ids of the parameters kept in FP32
    cast_buffers: set = field(default_factory=set)     # (id(module), name) of float buffers cast to the compute dtype


def cast_floats(x, dtype):
    """Floating-point tensors anywhere in x (tuples, lists, dicts) cast to dtype, except
    0-dimensional ones: those are scalars, not activations (HuggingFace's Trainer passes
    num_items_in_batch so; in bf16 a count of 1001 would become 1000)."""
    return torch.utils._pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() else t, x)


def autocast_dtype(autocast, device):
    """The dtype of config autocast (DeepSpeed's torch_autocast) on device, or None when off.
    "device" is torch's default there, which zerort takes on the CPU only (bf16): CUDA's is
    fp16, whose gradients need a loss scale."""
    if autocast is None:
        return None
    if autocast == "device" and device.type != "cpu":
        raise ConfigError(f"torch_autocast.dtype: not given, so torch's default for {device.type} "
                          f"({torch.get_autocast_dtype(device.type)}) would apply; zerort autocasts to bf16 only: "
                          "set torch_autocast.dtype to \"bfloat16\" (for fp16 compute use fp16.enabled)")
    return torch.bfloat16


def autocast(dtype, device):
    """torch.autocast(dtype) on device around the module's forward, as DeepSpeed's torch_autocast
    (the loss and the backward outside it, as there); nothing when dtype is None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def compute_in_fp32(plan, dtype):
    """Each FP32 module of plan computes in FP32: forward hooks cast its floating inputs
    (positional and keyword) to FP32 and its floating outputs back to dtype. Returns the
    hooks' handles."""
    handles = []
    for m in plan.fp32_modules:
        handles.append(m.register_forward_pre_hook(
            lambda module, args, kwargs: cast_floats((args, kwargs), torch.float32), with_kwargs=True))
        handles.append(m.register_forward_hook(lambda module, args, out: cast_floats(out, dtype)))
    return handles


def _float_buffers(module):
    return [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_floating_point()]


def fp32_plan(model, fp32_modules=()):
    """The FP32 modules of model, their parameters, and the float buffers to cast (see the
    module docstring for the rule)."""
    p = FP32Plan()
    inside = set()  # ids of the modules within an FP32 module, the FP32 module included
    for m in model.modules():  # parents before children
        if id(m) in inside:
            continue
        parameter_free = next(m.parameters(), None) is None
        keeps_buffers = parameter_free and _float_buffers(m) and "-" + type(m).__name__ not in fp32_modules
        if is_norm(m, fp32_modules) or keeps_buffers:
            p.fp32_modules.append(m)
            inside.update(id(s) for s in m.modules())
            p.fp32_ids.update(id(q) for q in m.parameters())
    for m in model.modules():
        if id(m) not in inside:
            p.cast_buffers.update((id(m), n) for n in _float_buffers(m))
    return p


@dataclass
class Grouping:
    """A model's parameters as zerort.initialize groups them."""
    fp32_plan: FP32Plan  # fp32_plan() under bf16 or fp16; empty under fp32
    names: dict      # id(param) -> its first name in named_parameters()
    trainable: list  # requires_grad, each tensor once, in named_parameters() order
    frozen: list
    groups: list     # the Engine's two groups: [trainable in the compute dtype, trainable kept in FP32]


def group_params(model, precision, fp32_modules=()):
    """The parameter groups of model under precision ("bf16", "fp16" or "fp32") and config
    fp32_modules: what zerort.initialize builds its Engine from, and what
    zerort.estimate_memory lays out."""
    p = fp32_plan(model, fp32_modules) if precision != "fp32" else FP32Plan()
    names, trainable, frozen = {}, [], []
    for name, q in model.named_parameters():  # a tied tensor once
        if id(q) not in names:
            names[id(q)] = name
            (trainable if q.requires_grad else frozen).append(q)
    groups = [[q for q in trainable if id(q) not in p.fp32_ids], [q for q in trainable if id(q) in p.fp32_ids]]
    return Grouping(p, names, trainable, frozen, groups)
