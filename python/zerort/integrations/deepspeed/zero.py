"""deepspeed.zero's two context managers, for zerort.integrations.deepspeed (import zerort.integrations.deepspeed as
deepspeed; deepspeed.zero.Init(), deepspeed.zero.GatheredParameters(...)).

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = MyModel()                    # parameters on the meta device (bf16 under bf16.enabled), buffers real
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)   # made real unit by unit

    with deepspeed.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if engine.global_rank == 0:
            model.lm_head.weight.zero_()     # rank 0's change goes to every rank's FP32 master

Init builds every parameter created inside on the meta device, recording how the build
makes its values, which initialize() replays unit by unit (Note [recorded initialization],
zerort.integrations.deepspeed.init_record). As DeepSpeed's Init, it builds floating tensors
in a target dtype (build_dtype; Note [build dtype]), so the weights are bit for bit
DeepSpeed's: the same code with torch's constructors giving that dtype (with
dtype=torch.float32, the same code without Init), and the random stream after the
constructor is that build's. Buffers stay real, as zerort needs them. GatheredParameters
makes the given parameters whole inside (at stage 3 all units are gathered; stages 0-2 hold
them whole) and, with modifier_rank, writes that
rank's values of them into every rank's FP32 master on exit (a collective: every rank
enters it). Parameters of no engine yet are whole already: nothing to do.
"""
import contextlib
import enum
import json
import os

import torch

from zerort.errors import ConfigError, UsageError
from zerort.engine.setup import engine_of
from zerort.engine.meta_init import RECIPE, parameters_on_meta
from zerort.integrations.deepspeed.init_record import ORDER, Recorder, _built, dtype_patches, early_return_patches

BUILD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _read_config(source):
    """A DeepSpeed config given as a dict or the path of a JSON file."""
    if isinstance(source, dict):
        return source
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            return json.load(f)
    raise ConfigError(f"deepspeed.zero.Init(config_dict_or_path={type(source).__name__}): give a dict or the path of "
                      "a JSON file")


def _enabled(cfg, names):
    section = next((cfg[n] for n in names if isinstance(cfg.get(n), dict)), {})
    return section.get("enabled", False) is True


def build_dtype(dtype=None, config_dict_or_path=None, config=None):
    """The dtype DeepSpeed's zero.Init builds floating tensors in (Note [build dtype]).
    config (DeepSpeed's older name) replaces config_dict_or_path when given. With a config
    and no dtype: bf16.enabled (or its old name bfloat16) -> bfloat16, fp16.enabled -> float16,
    neither -> float32, both -> an error. A dtype given wins, over a config too. With neither,
    DeepSpeed's default: float16 where the accelerator takes fp16 (CUDA from compute
    capability 7; the CPU where oneDNN has fp16 kernels), else bfloat16.
    DeepSpeed writes that default as `dtype or float16 if is_fp16_supported() else bfloat16`,
    whose precedence also drops a given dtype where fp16 is not supported (most CPUs): there
    zerort keeps the dtype asked for, since building in bf16 what the user asked to build in
    FP32 would train other numbers than the script says (docs/DEEPSPEED.md)."""
    from zerort.integrations.deepspeed.accelerator import get_accelerator

    source = config if config is not None else config_dict_or_path
    if source is not None and dtype is None:
        cfg = _read_config(source)
        bf16, fp16 = _enabled(cfg, ("bf16", "bfloat16")), _enabled(cfg, ("fp16",))
        if bf16 and fp16:
            raise ConfigError("deepspeed.zero.Init: the config enables both bf16.enabled and fp16.enabled; enable "
                              "at most one")
        return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    out = dtype or (torch.float16 if get_accelerator().is_fp16_supported() else torch.bfloat16)
    if out not in BUILD_DTYPES:
        raise ConfigError(f"deepspeed.zero.Init(dtype={out}): give torch.float16, torch.bfloat16 or torch.float32")
    return out


class Init:
    """DeepSpeed's zero.Init: parameters created inside are built on the meta device."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 **kwargs):
        if module is not None:
            raise ConfigError("deepspeed.zero.Init(module=...): zerort cannot partition a model built already; "
                             "build it inside `with deepspeed.zero.Init():` instead")
        if remote_device not in (None, "none"):
            raise ConfigError(f"deepspeed.zero.Init(remote_device={remote_device!r}): zerort has no parameter "
                             "offload; leave remote_device out")
        self.enabled = enabled
        self.dtype = build_dtype(dtype, config_dict_or_path, config)
        self._stack = None
        self._modules = {}  # id -> module that got a parameter inside, for the not-yet-wrapped check

    def __enter__(self):
        if not self.enabled:
            return self
        recorder = Recorder()

        def record(module, param, meta):  # Note [recorded initialization]
            self._modules[id(module)] = module
            recorder.track(meta, recorder.adopt(param))

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(parameters_on_meta(record))
        self._stack.enter_context(early_return_patches(recorder))
        self._stack.enter_context(dtype_patches(recorder, self.dtype))
        self._stack.enter_context(recorder)
        return self

    def __exit__(self, *exc):
        if self._stack is not None:
            self._stack.close()
            self._stack = None
            for module in self._modules.values():
                _refuse_forward_until_wrapped(module)
            self._modules = {}
        return False


class MiCS_Init(Init):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's zero.MiCS_Init: Init's meta-device build. The groups are the config's that
    initialize() gets (zero_optimization.mics_shard_size is zerort's shard_size: C++ Note [hybrid
    sharding]); sequence_data_parallel_group is DeepSpeed's, and the config here its own."""

    def __init__(self, module=None, data_parallel_group=None, sequence_data_parallel_group=None, **kwargs):
        super().__init__(module, data_parallel_group, **kwargs)


def _refuse_forward_until_wrapped(module):
    """A module built under Init runs once its parameters are real (initialize made them
    so): before, its forward is an error that says what to do, not torch's meta-device
    error. The hook removes itself at the first forward it lets through."""
    def check(mod, args):
        if any(p is not None and p.is_meta for p in mod._parameters.values()):
            raise UsageError(f"{type(mod).__name__} was built under deepspeed.zero.Init and has not been given to "
                             "deepspeed.initialize (zerort keeps its parameters on the meta device until then); "
                             "wrap the model first, or build it outside zero.Init to run it on its own")
        handle.remove()

    handle = module.register_forward_pre_hook(check)


class ZeroParamStatus(enum.Enum):
    """deepspeed.runtime.zero.partition_parameters.ZeroParamStatus (re-exported there)."""
    AVAILABLE = 1  # whole on this rank
    NOT_AVAILABLE = 2  # only this rank's shard
    INFLIGHT = 3  # being gathered


def _status(param):
    """Parameter.ds_status: AVAILABLE while whole, NOT_AVAILABLE while only this rank's
    shard is held; an AttributeError on a parameter no stage-3 engine marked."""
    numel = param.__dict__.get("ds_numel")
    if numel is None:
        raise AttributeError("ds_status: this parameter is not sharded by a zerort stage-3 engine")
    return ZeroParamStatus.AVAILABLE if param.numel() == numel else ZeroParamStatus.NOT_AVAILABLE


def mark_stage3_params(engine):
    """DeepSpeed's per-parameter attributes on a stage-3 engine's parameters: ds_id (the
    index in named_parameters order), ds_numel, ds_shape, and ds_status (read-only, from
    whether the parameter is whole now), which scripts read to decide what to gather."""
    if not isinstance(getattr(torch.nn.Parameter, "ds_status", None), property):
        torch.nn.Parameter.ds_status = property(_status)
    for index, (name, p) in enumerate(engine.module.named_parameters()):
        shape = torch.Size(engine.full_shape(p))
        p.ds_id, p.ds_shape, p.ds_numel = index, shape, shape.numel()


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):
    """DeepSpeed's zero.GatheredParameters: params (one parameter or an iterable) whole
    inside; with modifier_rank, that rank's values written to every rank's master on exit."""
    params = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
    engine = engine_of(params) if enabled else None
    if engine is None:
        # The same order on every rank (callers pass sets: transformers does), as DeepSpeed sorts by ds_id.
        # Parameters only, as DeepSpeed takes those with a ds_id: a state_dict()'s detached tensors are not them.
        on_meta = [p for p in params if isinstance(p, torch.nn.Parameter) and p.is_meta] if enabled else []
        on_meta = list({id(p): p for p in on_meta}.values())  # a tied weight given twice is swapped once
        on_meta.sort(key=lambda p: p.__dict__.get(ORDER, -1))
        with _made_real(on_meta, modifier_rank):
            yield
        return
    with engine.gathered_parameters():
        yield
        if modifier_rank is not None:
            _take_values(engine, params, modifier_rank)


@contextlib.contextmanager
def _made_real(params, modifier_rank):
    """Parameters built under zero.Init that no engine holds yet: inside, each parameter
    object is a real CPU tensor of its dtype with its values (its recorded initialization replayed, or
    the pieces a former block left, gathered), swapped in place (torch.utils.swap_tensors),
    so every module and list that holds it sees them; after, it is the meta parameter
    again, and with modifier_rank the values that rank left become its values, of which
    each rank keeps only its piece (Note [values before initialize]).

    A parameter on the meta device that was not built under zero.Init (a module made with
    device=<such a parameter>.device, as transformers' resize_token_embeddings makes its new
    embedding under ZeRO-3) has no values: inside it is filled with NaN, and with
    modifier_rank every value must have been written in the block; then those values are
    its own, as for the others."""
    strays = {id(p) for p in params if RECIPE not in p.__dict__}
    real = {}
    for p in params:
        if id(p) in strays:
            values = torch.full(p.shape, float("nan"), dtype=p.dtype)
        else:  # in the parameter's dtype, as DeepSpeed gathers it (a bf16 build is bf16 inside)
            values = p.__dict__[RECIPE].materialize(torch.device("cpu")).to(p.dtype)
        real[id(p)] = r = torch.nn.Parameter(values, requires_grad=p.requires_grad)
        r.__dict__.update(p.__dict__)  # swapped in with it: attributes set inside stay with the parameter
        torch.utils.swap_tensors(p, r)
    try:
        yield
    finally:
        for p in params:
            r = real[id(p)]
            torch.utils.swap_tensors(p, r)  # p is the meta parameter again; r holds what the block left
            p.__dict__.update(r.__dict__)
    if modifier_rank is not None:
        kept = {id(p): ShardedValues.from_rank(real[id(p)].detach(), modifier_rank) for p in params}
        unwritten = [tuple(p.shape) for p in params if id(p) in strays and kept[id(p)].had_nan]
        if unwritten:
            raise UsageError(f"deepspeed.zero.GatheredParameters: parameters of shapes {unwritten} are on the meta "
                             "device but were not built under deepspeed.zero.Init, and the block did not write all "
                             "their values, so zerort has none for the rest. zerort's zero.Init keeps parameters on "
                             "the meta device until initialize(), and a module made with device=<such a "
                             "parameter>.device is on the meta device too, where writes outside such a block are "
                             "lost (transformers' resize_token_embeddings to a larger vocabulary under ZeRO-3 "
                             "initializes the new rows so). Build that module inside deepspeed.zero.Init, or "
                             "resize after deepspeed.initialize / without ZeRO-3")
        for p in params:
            if id(p) in strays:
                p.__dict__[ORDER] = next(_built)  # a place in the order every rank gathers in, from now on
            setattr(p, RECIPE, kept[id(p)])


class ShardedValues:
    """Note [values before initialize]: a parameter built under zero.Init whose values a
    GatheredParameters(modifier_rank=r) block set before any engine holds it (transformers'
    ZeRO-3 from_pretrained loads every parameter so) keeps, on each rank, only its piece of
    them: the flat FP32 values cut into W pieces of ceil(numel / W) (the last one padded),
    piece k on rank k of torch.distributed's default group, so a loaded model costs each
    rank 1/W of it until initialize. materialize(device) gathers the pieces (a collective:
    every rank materializes the same parameters in the same order, as GatheredParameters
    sorts them by their place in the build and initialize goes unit by unit on every rank),
    and initialize keeps this rank's part of rank 0's values as DeepSpeed's partitioned
    parameters do. Without a process group (or with one rank) the piece is the whole."""

    def __init__(self, piece, shape, world):
        self.piece, self.shape, self.world = piece, torch.Size(shape), world

    @classmethod
    def from_rank(cls, values, rank):
        """rank's values (every rank passes its own tensor of the same shape) as this rank's
        piece. had_nan: whether rank's values held a NaN (the same answer on every rank)."""
        import torch.distributed as dist

        values = values.detach().to(dtype=torch.float32, device="cpu").contiguous()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            dist.broadcast(values, rank)
        flat = values.reshape(-1)
        size = -(-flat.numel() // world)
        me = dist.get_rank() if world > 1 else 0
        piece = torch.zeros(size, dtype=torch.float32)
        mine = flat[me * size:(me + 1) * size]
        piece[:mine.numel()] = mine
        out = cls(piece, values.shape, world)
        out.had_nan = bool(torch.isnan(flat).any())
        return out

    def materialize(self, device):
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.world:
            raise UsageError(f"zerort: a parameter of shape {tuple(self.shape)} was loaded (GatheredParameters before "
                             f"initialize) over {self.world} ranks and is made real over {world}; keep "
                             "torch.distributed's default group from loading to deepspeed.initialize")
        if world == 1:
            whole = self.piece.clone()
        else:
            whole = torch.empty(self.piece.numel() * world, dtype=torch.float32)
            dist.all_gather(list(whole.chunk(world)), self.piece)
        return whole[:self.shape.numel()].view(self.shape).to(device)


def _take_values(engine, params, rank):
    """rank's values of params become every rank's FP32 master (and working copy)."""
    from zerort.layout.shard_map import param_layout, write_state

    names = {id(p): n for n, p in engine.module.named_parameters()}
    layout = param_layout(engine)
    full = {}
    for p in sorted(params, key=lambda p: names.get(id(p), "")):  # one order on every rank (params may be a set)
        name = names.get(id(p))
        if name not in layout:  # frozen: its working copy and its FP32 copy
            with torch.no_grad():
                engine.comm.broadcast(p.data, rank)
                if id(p) in engine.frozen_masters:
                    engine.frozen_masters[id(p)].copy_(p.data)
            continue
        value = p.detach().float().clone()
        engine.comm.broadcast(value, rank)
        full[name] = value
    write_state(engine, "master", full, layout)
    engine.runtime.refresh_params()  # the working copies from the new master (a collective)
