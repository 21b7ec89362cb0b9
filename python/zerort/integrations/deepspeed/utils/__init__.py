"""deepspeed.utils on zerort: the logger, log_dist, and the full values of one sharded
parameter, read (safe_get_full_*) or written (safe_set_full_*): collectives of the engine
that trains it, in any tier of its state. zero_to_fp32 is deepspeed.utils.zero_to_fp32 on
zerort's checkpoints."""
import logging
import sys

import torch

from zerort.errors import UsageError
from zerort.integrations.deepspeed.names import NotProvidedError, not_provided
from zerort.integrations.deepspeed.ranks import get_rank



class _Stdout(logging.StreamHandler):
    """Writes to sys.stdout as it is when a record comes (a program may replace it)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass


logger = logging.getLogger("DeepSpeed")
if not logger.handlers:
    _handler = _Stdout()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                            "%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _rank():
    return get_rank()


def log_dist(message, ranks=None, level=logging.INFO):
    """Logs message on the given ranks (None or [-1]: every rank), prefixed with the rank."""
    rank = _rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


def print_rank_0(message):
    if _rank() == 0:
        print(message, flush=True)


def set_z3_leaf_modules(model, leaf_module_classes):
    """DeepSpeed's ZeRO-3 leaf modules (MoE blocks whose experts run data-dependently):
    their parameters must be gathered with the module, not by each submodule's own hook.
    zerort's stage-3 units are whole blocks (zerort.layout.units), whose parameters are
    gathered together when any of them runs, so this marks the modules (`_z3_leaf`, as
    DeepSpeed does) and returns them. Classes may be given by type or by name."""
    wanted = tuple(c for c in leaf_module_classes if isinstance(c, type))
    names = {c for c in leaf_module_classes if isinstance(c, str)}
    leaves = [m for m in model.modules() if isinstance(m, wanted) or type(m).__name__ in names]
    for m in leaves:
        m._z3_leaf = True
    return leaves


def _owner(param, who):
    from zerort.engine.setup import engine_of

    engine = engine_of([param])
    if engine is None:
        raise NotProvidedError(f"deepspeed.utils.{who}: the tensor given is not a parameter of a live zerort "
                               "engine; pass a parameter of the model given to deepspeed.initialize")
    return engine


def _full(param, key, who, engine=None):
    """The whole FP32 `key` state of param (one of shard_map.STATE_KEYS, or "grad"), on
    every rank (a collective of its engine)."""
    from zerort.layout.shard_map import flat, param_layout, read_state, replicated

    engine = engine or _owner(param, who)
    name = engine.param_index.names[id(param)]
    info = param_layout(engine).get(name)
    if info is None:
        raise NotProvidedError(f"deepspeed.utils.{who}: {name!r} is frozen: it has no optimizer state")
    impl = engine.runtime
    grad = flat([impl.grad(g) for g in range(impl.num_groups)]) if key == "grad" else None
    part = (lambda index, length: grad[index:index + length]) if key == "grad" else \
        (lambda index, length: read_state(engine, key, index, length))
    numel = 1
    for d in info["shape"]:
        numel *= d
    out = torch.zeros(numel, dtype=torch.float32, device=engine.device)
    everything = replicated(engine)
    for rank, index, offset, length in info["segments"]:
        if rank == engine.rank or everything:
            out[offset:offset + length] = part(index, length)
    if not everything:
        engine.comm.all_reduce(out)  # each element is held by one rank; the others add 0
    return out.view(info["shape"])


def safe_get_full_fp32_param(param):
    """param's FP32 master, whole, on every rank (call it on every rank)."""
    return _full(param, "master", "safe_get_full_fp32_param")


def safe_get_full_grad(param):
    """param's FP32 gradient of this accumulation window so far, whole, on every rank (call
    it on every rank after backward() and before step(); at stages 0 and 1, in the window's
    last micro-step, where they reduce): averaged over ranks and micro-steps as the update
    will use it, without the fp16 loss scale (DeepSpeed's keeps it). None for a frozen
    parameter, as DeepSpeed's."""
    engine = _owner(param, "safe_get_full_grad")
    if not param.requires_grad:
        return None
    engine.runtime.reduce_now()
    return _full(param, "grad", "safe_get_full_grad", engine) / engine.runtime.grad_denominator


def _adam_key(key, who):
    if key not in ("exp_avg", "exp_avg_sq"):
        raise NotProvidedError(f"deepspeed.utils.{who}: key {key!r}; zerort's AdamW keeps 'exp_avg' and 'exp_avg_sq'")
    return key


def safe_get_full_optimizer_state(param, optim_state_key):
    """param's Adam state ("exp_avg" or "exp_avg_sq"), whole, on every rank."""
    who = "safe_get_full_optimizer_state"
    return _full(param, _adam_key(optim_state_key, who), who)


def _set_full(param, key, value, who):
    """value (param's whole shape) into this rank's part of param's `key` state (one of
    shard_map.STATE_KEYS), in any tier: the same value on every rank, as DeepSpeed's."""
    from zerort.layout.shard_map import param_layout, write_state

    engine = _owner(param, who)
    name = engine.param_index.names[id(param)]
    layout = param_layout(engine)
    if name not in layout:
        raise NotProvidedError(f"deepspeed.utils.{who}: {name!r} is frozen: it has no optimizer state")
    value = torch.as_tensor(value)
    if list(value.shape) != layout[name]["shape"]:
        raise UsageError(f"deepspeed.utils.{who}: {name!r} has shape {layout[name]['shape']}; got a value of shape "
                         f"{list(value.shape)}")
    write_state(engine, key, {name: value.detach().to("cpu", torch.float32)}, layout)
    return engine


def safe_set_full_fp32_param(param, value):
    """Sets param's FP32 master to value (its whole shape; call it on every rank with the same
    value) and the working weights to its cast, so the next forward and step start from it."""
    _set_full(param, "master", value, "safe_set_full_fp32_param").runtime.refresh_params()


def safe_set_full_optimizer_state(param, value, optim_state_key):
    """Sets param's Adam state ("exp_avg" or "exp_avg_sq") to value (its whole shape, rounded to
    the state dtype; call it on every rank with the same value)."""
    who = "safe_set_full_optimizer_state"
    _set_full(param, _adam_key(optim_state_key, who), value, who)


__getattr__ = not_provided(__name__)
