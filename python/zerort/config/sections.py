"""The Config: frozen sections, one per concern, and the few settings that are global.

    c = zerort.config.parse({"stage": 3, "optimizer": {"lr": 3e-4}})
    c.optimizer.lr, c.loss_scale.window, c.stage3.prefetch, c.comm.backend, c.batch.train_batch_size
    c = zerort.config.replace(c, stage3={"prefetch": 2})   # a new Config; c is frozen

The parser (zerort.config.parser, zerort.config.deepspeed_form) fills the sections from our
form or DeepSpeed's; the keys users write do not follow this shape one to one (DeepSpeed's
fp16.loss_scale_window is loss_scale.window here). The sections that reach the C++ Engine
map onto its options structs field by field (zerort.config.native): See Note [options by name]
(python/engine_bindings.cpp).
"""
import dataclasses
from typing import Callable, Optional

from zerort.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Optimizer:
    """AdamW, clipping and the lr schedule: the C++ OptimizerOptions' adamw, gradient_clipping
    state_dtype and master_dtype (runtime/shard_optimizer.h)."""
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    bias_correction: bool = True  # false: Adam's moments uncorrected (DeepSpeed's optimizer.params.bias_correction)
    state_dtype: str = "fp32"  # Adam's m and v: "fp32" or "bf16" (DeepSpeed's bf16.bf16_optimizer_states)
    master_dtype: str = "fp32"  # master and gradient shard: "fp32" or "bf16" (bf16.bf16_master_weights_and_grads)
    gradient_clipping: float = 0.0  # max global L2 norm; 0 disables
    lr_schedule: Optional[Callable[[int], float]] = None  # Adam step n (1-based) -> every group's lr
    scheduler: Optional[dict] = None  # {"type": name, "params": {...}}: zerort.engine.lr_schedules


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LossScale:
    """fp16's loss scaler: the C++ LossScalerOptions (runtime/loss_scaler.h). bf16 and fp32
    use a static scale of 1."""
    initial_scale_power: int = 16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    consecutive_hysteresis: bool = False
    static: float = 0.0  # > 0: a fixed loss scale (DeepSpeed's fp16.loss_scale); 0: dynamic


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Batch:
    """DeepSpeed's batch sizes: train_batch_size = micro batch x accumulation steps x world
    size (resolve_batch)."""
    train_micro_batch_size_per_gpu: Optional[int] = None
    # None (DeepSpeed's form without the key): derived from train_batch_size at initialize,
    # by resolve_batch; a given value is checked against it instead.
    gradient_accumulation_steps: Optional[int] = 1
    train_batch_size: Optional[int] = None
    dataloader_drop_last: bool = False  # zerort.integrations.deepspeed.initialize's training_data loader


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Stage3:
    """Stage 3's units (zerort.layout.units) and how far ahead they are gathered."""
    prefetch: int = 1  # units gathered ahead of the one running
    gather_dtype: str = "compute"  # "int8": each unit gather as int8 blocks (C++ Note [int8 blocks]); CPU and CUDA
    # hpZ: each rank keeps its node-local piece of a gathered unit and re-gathers from those
    # within the node until the next update (C++ Note [secondary shards]); an int or "node"; None: off
    secondary_shard_size: Optional[object] = None
    persistence_threshold: int = 0
    unit_modules: tuple = ()
    prefetch_numel: Optional[int] = None  # DeepSpeed form: sets prefetch from unit sizes
    max_live_numel: Optional[int] = None  # DeepSpeed form: caps prefetch from unit sizes


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Comm:
    """The communicator zerort.initialize creates (zerort.comm.init)."""
    backend: str = "auto"
    timeout_s: float = 600.0
    debug: Optional[bool] = None  # check every collective across ranks first (None: at stage 3 only)
    topology: str = "auto"  # flat, two_hop or auto: reduce-scatter and all-gather in two hops (zerort.comm.topology)
    inter_node_dtype: str = "fp32"  # two_hop: the partial sums' form between the hops (fp32, bf16, int8, fp8_e4m3)
    intra_node: str = "shm"  # gloo: ranks of one host through /dev/shm ("shm") or the backend's TCP ("backend")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Monitor:
    """What rank 0 prints and writes (zerort.monitoring)."""
    csv: Optional[str] = None  # folder of the monitor's metrics.csv
    tensorboard: Optional[str] = None  # folder of the monitor's TensorBoard events
    steps_per_print: Optional[int] = None  # print step, lr and betas every N updates
    wall_clock_breakdown: bool = False  # print DeepSpeed's fwd/bwd/step timings


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OffloadOptimizer:
    """Where the FP32 master and Adam's moments live: DeepSpeed's zero_optimization.offload_optimizer,
    its defaults. See Note [offload tiers] (zerort.config.offload)."""
    device: str = "none"  # "none" (with the model), "cpu" (host memory) or "nvme" (files under nvme_path)
    nvme_path: Optional[str] = None
    pin_memory: bool = True  # page-locked host buffers (for a CUDA model's copies)
    buffer_count: int = 4  # NVMe: buffers in the pool
    pipeline_read: bool = False  # NVMe: read the next chunk while stepping this one
    pipeline_write: bool = False  # NVMe: write the last chunk while stepping this one
    fast_init: bool = False
    ratio: float = 1.0  # the part of the states offloaded (< 1: stage 3 only)
    chunk_numel: int = 1 << 20  # NVMe: state elements per chunk streamed through one buffer (zerort's own key)
    gradient_in_file: bool = False  # NVMe: the FP32 gradient shard in the file too (zerort's own key)
    # NVMe: the part of master, m and v kept in host RAM, the first records, the rest in the file
    # (zerort's own key; 0 to 1): C++ Note [NVMe state store], split.
    ram_fraction: float = 0.0
    # 'cpu', 'nvme': the FP32 gradient shard stays on the model's device while master, m and v are
    # off it (zerort's own key): C++ Note [gradient on the device].
    gradient_on_device: bool = False
    # The update overlaps the next forward, unit by unit (zerort's own key). None: where the states
    # are off the model's memory (a CUDA model's 'cpu' tier, 'nvme'); a CPU model's 'cpu' offload
    # only when true, since its states are in host memory already.
    overlap_step: bool | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OffloadParam:
    """Where stage 3's low-precision parameter shards live: DeepSpeed's
    zero_optimization.offload_param, its defaults (stage 3 only)."""
    device: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = True
    buffer_count: int = 5  # NVMe: buffers in the pool
    buffer_size: int = 100_000_000  # NVMe: elements per buffer
    max_in_cpu: int = 1_000_000_000  # NVMe: parameter elements kept in host memory


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Aio:
    """The asynchronous I/O of the NVMe tier: DeepSpeed's aio section, its defaults (use_gds
    is accepted only false, so it is not a field)."""
    block_size: int = 1 << 20  # bytes per request
    queue_depth: int = 8  # requests in flight
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    # NVMe: what moves the I/O (zerort's own key): "auto" (io_uring where built and allowed, else
    # threads), "io_uring", or "threads" (a pool of threads doing O_DIRECT pread/pwrite)
    io_backend: str = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """The offload section: the optimizer states' tier, stage 3's parameters' tier, and the I/O
    settings of NVMe (zerort.config.offload reads it from either form)."""
    optimizer: OffloadOptimizer = dataclasses.field(default_factory=OffloadOptimizer)
    param: OffloadParam = dataclasses.field(default_factory=OffloadParam)
    aio: Aio = dataclasses.field(default_factory=Aio)
    # "manual": the devices above; "auto": zerort places the states at initialize from the free memory
    # and disk it measures (zerort.accounting.placement_auto; Note [auto placement])
    placement: str = "manual"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """A validated configuration (zerort.config.parse makes one). The top-level fields are
    the global ones; stage and reduce_bucket_numel are the C++ EngineOptions' own."""
    stage: int = 2
    precision: str = "bf16"  # compute: "bf16", "fp16" or "fp32"
    # torch.autocast around the module's forward (DeepSpeed's torch_autocast): "bf16", "device" (torch's
    # default for the model's device: bf16 on the CPU; refused on CUDA, whose default is fp16), or None
    autocast: Optional[str] = None
    reduce_bucket_numel: int = 1 << 24  # stages 0-2; stage 3 reduces per unit
    max_consecutive_skips: int = 100  # skipped (non-finite) steps in a row before training stops
    # Stages 1-2: step() returns with the parameter all-gathers in flight and each module waits
    # for its own in the next forward (zerort.engine.param_waits; C++ Note [overlapped parameter gather])
    overlap_param_gather: bool = False
    # Stages 1-3: the state sharded within groups of this many consecutive ranks ("node": a
    # node's) and replicated across them (zerort.comm.shard_groups; C++ Note [hybrid sharding]).
    # None: sharded over the whole world.
    shard_size: Optional[object] = None
    fp32_modules: tuple = ()  # changes to zerort.layout.precision's norm rule: "Name" adds a class, "-Name" removes it
    # DeepSpeed keys accepted and ignored as DeepSpeed ignores them, each "key value: why"
    # (zerort.config.lenient); rank 0 prints them after its banner
    ignored: tuple = ()
    optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
    loss_scale: LossScale = dataclasses.field(default_factory=LossScale)
    batch: Batch = dataclasses.field(default_factory=Batch)
    stage3: Stage3 = dataclasses.field(default_factory=Stage3)
    comm: Comm = dataclasses.field(default_factory=Comm)
    monitor: Monitor = dataclasses.field(default_factory=Monitor)
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)  # name -> section class
            if f.default_factory is not dataclasses.MISSING}


def replace(c, **changes):
    """c with changes, a section's fields given as a dict: replace(c, stage=3, stage3={"prefetch":
    2}) changes stage and stage3.prefetch and keeps every other value (a section object
    replaces the whole section); a nested section likewise: offload={"optimizer": {"device": "cpu"}}."""
    for name, v in changes.items():
        if name in SECTIONS and isinstance(v, dict):
            section = getattr(c, name)
            nested = lambda k, x: (dataclasses.replace(getattr(section, k), **x) if isinstance(x, dict) and
                                   dataclasses.is_dataclass(getattr(section, k, None)) else x)
            changes[name] = dataclasses.replace(section, **{k: nested(k, x) for k, x in v.items()})
    return dataclasses.replace(c, **changes)


def resolve_batch(c, world_size):
    """c with DeepSpeed's batch rule applied at world_size: two of train_batch_size,
    train_micro_batch_size_per_gpu and gradient_accumulation_steps give the third
    (train_batch_size = micro x accumulation x world size); raises ConfigError when the
    three do not agree."""
    b = c.batch
    micro, total, gas = b.train_micro_batch_size_per_gpu, b.train_batch_size, b.gradient_accumulation_steps
    given, gas = gas is not None, 1 if gas is None else gas
    if total is not None and micro is not None and not given:
        if total % (micro * world_size):
            raise ConfigError([f"train_batch_size: got {total}; it must be a multiple of "
                               f"train_micro_batch_size_per_gpu ({micro}) x world size ({world_size}) = "
                               f"{micro * world_size} (the quotient is "
                               "gradient_accumulation_steps)"])
        gas = total // (micro * world_size)
    elif total is not None and micro is None:
        if total % (gas * world_size):
            raise ConfigError([f"train_batch_size: got {total}; it must be a multiple of gradient_accumulation_steps "
                               f"({gas}) x world size ({world_size}) = {gas * world_size} (the quotient is "
                               "train_micro_batch_size_per_gpu)"])
        micro = total // (gas * world_size)
    if micro is not None and total is not None and total != micro * gas * world_size:
        raise ConfigError([f"train_batch_size: got {total}; it must equal train_micro_batch_size_per_gpu "
                           f"({micro}) x gradient_accumulation_steps ({gas}) x world size ({world_size}) = "
                           f"{micro * gas * world_size}"])
    total = micro * gas * world_size if micro is not None else None
    return replace(c, batch={"train_micro_batch_size_per_gpu": micro, "train_batch_size": total,
                             "gradient_accumulation_steps": gas})


# Note [saved config names]: a checkpoint's meta.json holds the Config as one flat dict
# (zerort.state.checkpoint reads gradient_accumulation_steps back from it), under the names
# the fields had before the Config had sections, so checkpoints of either age read alike:
# a section's field is saved under its own name, except these.
SAVED_NAMES = {("optimizer", "state_dtype"): "optimizer_state_dtype",
               ("optimizer", "master_dtype"): "optimizer_master_dtype",
               ("loss_scale", "window"): "loss_scale_window", ("loss_scale", "min_scale"): "min_loss_scale",
               ("loss_scale", "static"): "static_loss_scale", ("comm", "backend"): "comm_backend",
               ("comm", "timeout_s"): "comm_timeout_s", ("comm", "debug"): "comm_debug",
               ("monitor", "csv"): "monitor_csv", ("monitor", "tensorboard"): "monitor_tensorboard",
               ("offload", "optimizer"): "offload_optimizer", ("offload", "param"): "offload_param",
               ("offload", "aio"): "aio"}


def to_dict(c):
    """c as the flat dict a checkpoint saves (Note [saved config names]); lr_schedule as its repr."""
    d = {}
    for f in dataclasses.fields(c):
        if f.name not in SECTIONS:
            d[f.name] = getattr(c, f.name)
            continue
        for name, v in dataclasses.asdict(getattr(c, f.name)).items():
            d[SAVED_NAMES.get((f.name, name), name)] = v
    d["lr_schedule"] = None if c.optimizer.lr_schedule is None else repr(c.optimizer.lr_schedule)
    return d
