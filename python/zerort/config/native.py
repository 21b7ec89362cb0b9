"""A Config as the C++ Engine's options: zerort._C.EngineOptions (runtime/engine.h) holding
OptimizerOptions (runtime/shard_optimizer.h), which holds AdamWHyper (optim/adamw.h) and
LossScalerOptions (runtime/loss_scaler.h).

    _C.Engine(params, fp32_params, comm, units=..., options=engine_options(c, device), materialize=fn)

See Note [options by name] (python/engine_bindings.cpp): a struct's field is taken from the
Config's top level or the section given for it when that has a field of the same name;
the fields named differently are set here.
"""
import dataclasses

from zerort import _C


def _struct(cls, *sources, **named):
    """A cls (a zerort._C options struct) with the fields named, and each other field of it
    that one of sources (the Config or a section of it) has by the same name."""
    fields = {name for name, v in vars(cls).items() if isinstance(v, property)}  # its def_readwrite fields
    kw = dict(named)
    for source in sources:
        for f in dataclasses.fields(source):
            v = getattr(source, f.name)
            if f.name in fields and f.name not in named and not dataclasses.is_dataclass(v):
                kw[f.name] = v
    return cls(**kw)


def loss_scaler_options(s):
    """The LossScale section s as LossScalerOptions: a static scale > 0 (DeepSpeed's
    fp16.loss_scale) is a fixed one; else dynamic from 2**initial_scale_power. The
    ShardOptimizer gives bf16 and fp32 a static scale of 1 whatever this says."""
    static = s.static > 0
    return _struct(_C.LossScalerOptions, s, dynamic=not static,
                   initial_scale=s.static if static else 2.0 ** s.initial_scale_power)


def optimizer_options(c):
    """The Config c's optimizer, loss scale and accumulation as OptimizerOptions (a
    ShardOptimizer's own, an Engine's part)."""
    o = c.optimizer
    return _struct(_C.OptimizerOptions, c, o, c.batch, loss_scale=loss_scaler_options(c.loss_scale),
                   adamw=_struct(_C.AdamWHyper, o, beta1=o.betas[0], beta2=o.betas[1]))


def nvme_options(c):
    """The Config c's offload_optimizer and aio as NvmeStateOptions (the nvme tier's file and I/O)."""
    o, aio = c.offload.optimizer, c.offload.aio
    return _struct(_C.NvmeStateOptions, o, aio, directory=o.nvme_path or "", chunk_elements=o.chunk_numel)


def state_tier(c, device):
    """The Engine's state tier for the Config c and a model on device: 'memory', 'cpu' or 'nvme' (See
    engine_options)."""
    o = c.offload.optimizer
    host_tier = device.type != "cpu" or (o.overlap_step is True and c.stage > 0)
    return {"nvme": "nvme", "cpu": "cpu" if host_tier else "memory"}.get(o.device, "memory")


def engine_options(c, device):
    """The Config c as EngineOptions for a model on device (its materialize is the Engine's own
    argument). offload_optimizer 'cpu' is the Engine's 'cpu' tier for a model on a GPU, and
    the states' own place, memory, for a CPU model, unless overlap_step is true: then the 'cpu'
    tier, whose mover is a memcpy, so the step overlaps the next forward (Note [offload tiers]).
    gradient_on_device applies off memory only: in memory the gradient is with the model already."""
    o, tier = c.offload.optimizer, state_tier(c, device)
    par = c.offload.param
    return _struct(_C.EngineOptions, c, optimizer=optimizer_options(c), state_tier=tier, nvme=nvme_options(c),
                   param_nvme_path=par.nvme_path if par.device == "nvme" else "",
                   param_host=par.device == "cpu" and tier == "cpu", gather_int8=c.stage3.gather_dtype == "int8",
                   overlap_step=o.overlap_step is not False,
                   gradient_on_device=o.gradient_on_device and tier != "memory")
