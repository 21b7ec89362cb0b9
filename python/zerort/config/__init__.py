"""zerort configuration: our own keys, or the subset of DeepSpeed's JSON schema we support.

    zerort.config.parse({"stage": 2, "precision": "bf16", "optimizer": {"lr": 3e-4}})
    zerort.config.parse("ds_config.json")      # a DeepSpeed config works too

Every key is typed and range-checked; all problems in one config are reported together in
one ConfigError, each naming the key, the value it got and what is allowed. An unknown key
is named with the closest known one; rules that join keys (fp16 and bf16 both on, a
minimum loss scale above the initial one, a batch size that does not divide) are checked
after every key has been read.

A config is at most MAX_DEPTH levels deep (a deeper one, or one too deep for the JSON
parser, is a ConfigError), and messages show values cut short (show()): a 60 MB value
under an unknown key is named in a line, not repeated. A message names at most MAX_LISTED
unknown keys (the rest are counted), and a config file is a regular file of at most
MAX_FILE_BYTES, read once (read_config_file).

Note [bounded values]: every number has a range the engine can honour. An integer is at
most MAX_INT (2**31 - 1: steps, windows, counts, batch sizes), an element count at most
MAX_NUMEL, stage3.prefetch at most MAX_PREFETCH; an integer literal of any length in a
config file is read (as a LongInteger past MAX_INT_DIGITS digits) and refused by its
key's check. A value the engine computes with in FP32 (the optimizer's lr, betas, eps and
weight decay, clipping, loss scales, the scheduler's numbers) is checked as FP32 holds it
(fp32_problem): one past FP32's largest finite number is inf there, and a nonzero one
below its smallest normal number is 0 or subnormal there (GPU kernels flush subnormals to
0), so eps = 1e-46, a Python float > 0, made the first update 0 / 0 = NaN.
"""
import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Callable, Optional

from zerort.config.files import read_config, read_config_file, read_json  # noqa: F401  (the package's API)
from zerort.config.reader import (MAX_AUTOS_LISTED, MAX_DEPTH, MAX_FILE_BYTES, MAX_LISTED, MAX_NUMEL,  # noqa: F401
                                  MAX_PERIOD, MAX_PREFETCH, _depth_problem, _key_name, _kind, _Problems, _Reader, _real,
                                  at_most, fp32_problem, show)
from zerort.errors import ConfigError


@dataclass
class Config:
    stage: int = 2
    precision: str = "bf16"
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    bias_correction: bool = True  # false: Adam's moments uncorrected (DeepSpeed's optimizer.params.bias_correction)
    optimizer_state_dtype: str = "fp32"  # Adam's m and v: "fp32" or "bf16" (DeepSpeed's bf16.bf16_optimizer_states)
    lr_schedule: Optional[Callable[[int], float]] = None  # Adam step n (1-based) -> every group's lr
    scheduler: Optional[dict] = None  # {"type": name, "params": {...}}: zerort.engine.lr_schedules
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False
    static_loss_scale: float = 0.0  # fp16: > 0 is a fixed loss scale (DeepSpeed's fp16.loss_scale); 0 dynamic
    gradient_clipping: float = 0.0
    gradient_accumulation_steps: int = 1
    reduce_bucket_numel: int = 1 << 24  # stages 0-2; stage 3 reduces per unit
    prefetch: int = 1  # stage 3: units gathered ahead of the one running
    persistence_threshold: int = 0
    prefetch_numel: Optional[int] = None  # stage 3, DeepSpeed form: sets prefetch from unit sizes
    max_live_numel: Optional[int] = None  # stage 3, DeepSpeed form: caps prefetch from unit sizes
    unit_modules: tuple = ()
    comm_backend: str = "auto"
    comm_timeout_s: float = 600.0
    comm_debug: Optional[bool] = None  # check every collective across ranks first (None: at stage 3 only)
    max_consecutive_skips: int = 100  # skipped (non-finite) steps in a row before training stops
    fp32_modules: tuple = ()  # changes to zerort.layout.precision's norm rule: "Name" adds a class, "-Name" removes it
    train_micro_batch_size_per_gpu: Optional[int] = None  # checked against train_batch_size
    train_batch_size: Optional[int] = None
    gradient_accumulation_given: bool = True  # False: derived from train_batch_size at initialize
    steps_per_print: Optional[int] = None  # print step, lr and betas every N updates (rank 0)
    wall_clock_breakdown: bool = False  # print DeepSpeed's fwd/bwd/step timings (rank 0)
    dataloader_drop_last: bool = False  # zerort.integrations.deepspeed.initialize's training_data loader
    monitor_csv: Optional[str] = None  # folder of the monitor's metrics.csv (zerort.monitoring.monitor)
    monitor_tensorboard: Optional[str] = None  # folder of the monitor's TensorBoard events


DEEPSPEED_MARKERS = {"zero_optimization", "bf16", "bfloat16", "fp16", "train_batch_size", "zerort"}
def _betas(r, d, default):
    present, v = r._take(d, "betas")
    if not present:
        return default
    ok = isinstance(v, (list, tuple)) and len(v) == 2 and all(_real(b) and 0 <= b < 1 for b in v)
    if not ok:
        r.bad("betas", v, "a list of two numbers, each >= 0 and < 1, such as [0.9, 0.999]")
        return default
    if not r.fp32("betas", v):
        return default
    return (float(v[0]), float(v[1]))


def _fp32_modules(r, d, default):
    """Class names to add to the FP32 modules ("MyGate") or remove from them ("-BatchNorm2d")."""
    present, v = r._take(d, "fp32_modules")
    if not present:
        return default
    allowed = ("a list of module class names, each added to the FP32 modules (\"MyGate\") or removed from them "
               "with a leading \"-\" (\"-BatchNorm2d\")")
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x.removeprefix("-").isidentifier()
                                                   for x in v):
        r.bad("fp32_modules", v, allowed + "; a class name is its bare name, not a dotted path",
              not isinstance(v, (list, tuple)))
        return default
    both = sorted({x for x in v if not x.startswith("-") and "-" + x in v})
    if both:
        r.bad("fp32_modules", v, f"each class added or removed, not both: {', '.join(both)}")
        return default
    return tuple(v)


def _optimizer_params(r, d, c):
    c.lr = r.number(d, "lr", c.lr, low=0, fp32=True)
    c.betas = _betas(r, d, c.betas)
    # eps = 0 turns the update into 0 / 0 = NaN wherever a gradient and its moments are 0,
    # and so does an eps that is 0 in FP32: Note [bounded values].
    c.eps = r.number(d, "eps", c.eps, low=0, low_open=True, fp32=True, example="1e-8")
    c.weight_decay = r.number(d, "weight_decay", c.weight_decay, low=0, fp32=True)
    c.bias_correction = r.boolean(d, "bias_correction", c.bias_correction)


def _loss_scale(r, d, c, window, min_scale):
    """The loss-scaler keys; ours and DeepSpeed's differ only in two names."""
    c.initial_scale_power = r.number(d, "initial_scale_power", c.initial_scale_power, integer=True, low=0, high=60)
    c.loss_scale_window = r.number(d, window, c.loss_scale_window, integer=True, low=1)
    c.hysteresis = r.number(d, "hysteresis", c.hysteresis, integer=True, low=1)
    c.min_loss_scale = r.number(d, min_scale, c.min_loss_scale, low=0, low_open=True, fp32=True)
    c.consecutive_hysteresis = r.boolean(d, "consecutive_hysteresis", c.consecutive_hysteresis)
    return r.key("initial_scale_power"), r.key(min_scale)


def _parse_ours(cfg, problems):
    c = Config()
    r = _Reader(problems)
    c.stage = r.number(cfg, "stage", c.stage, integer=True, low=0, high=3)
    c.precision = r.choice(cfg, "precision", c.precision, ("bf16", "fp16", "fp32"))
    opt, ro = r.child(cfg, "optimizer")
    _optimizer_params(ro, opt, c)
    c.optimizer_state_dtype = ro.choice(opt, "state_dtype", c.optimizer_state_dtype, ("fp32", "bf16"))
    ro.leftover(opt)
    ls, rl = r.child(cfg, "loss_scale")
    scale_keys = _loss_scale(rl, ls, c, window="window", min_scale="min_scale")
    c.static_loss_scale = rl.number(ls, "static", c.static_loss_scale, low=0, fp32=True)
    rl.leftover(ls)
    c.gradient_accumulation_steps = r.number(cfg, "gradient_accumulation_steps", c.gradient_accumulation_steps,
                                             integer=True, low=1)
    c.reduce_bucket_numel = r.number(cfg, "reduce_bucket_numel", c.reduce_bucket_numel, integer=True, low=1,
                                     high=MAX_NUMEL)
    common(r, cfg, c)
    runtime_keys(r, cfg, c)
    mon, rm = r.child(cfg, "monitor")
    where = os.path.join(rm.text(mon, "output_path", "runs"), rm.text(mon, "job_name", "zerort"))
    c.monitor_csv = where if rm.boolean(mon, "csv", False) else None
    c.monitor_tensorboard = where if rm.boolean(mon, "tensorboard", False) else None
    rm.leftover(mon)
    r.leftover(cfg)
    return c, scale_keys, "precision"


def runtime_keys(r, cfg, c):
    """zerort's own keys without a DeepSpeed counterpart: at the top of our form, under
    "zerort" in DeepSpeed's."""
    s3, r3 = r.child(cfg, "stage3")
    c.prefetch = r3.number(s3, "prefetch", c.prefetch, integer=True, low=0, high=MAX_PREFETCH)
    c.persistence_threshold = r3.number(s3, "persistence_threshold", c.persistence_threshold, integer=True, low=0,
                                        high=MAX_NUMEL)
    c.unit_modules = r3.names(s3, "unit_modules", c.unit_modules)
    r3.leftover(s3)
    cm, rc = r.child(cfg, "comm")
    c.comm_backend = rc.choice(cm, "backend", c.comm_backend, ("auto", "mpi", "gloo", "nccl", "inprocess"))
    c.comm_timeout_s = rc.number(cm, "timeout_s", c.comm_timeout_s, low=1e-3, high=1e9)  # as the C++ comm
    c.comm_debug = rc.boolean(cm, "debug", c.comm_debug)
    rc.leftover(cm)
    c.max_consecutive_skips = r.number(cfg, "max_consecutive_skips", c.max_consecutive_skips, integer=True, low=1)
    c.fp32_modules = _fp32_modules(r, cfg, c.fp32_modules)
    present, v = r._take(cfg, "lr_schedule")
    if present:
        if callable(v):
            c.lr_schedule = v
        else:
            r.bad("lr_schedule", v, "a callable step -> lr")


def common(r, cfg, c):
    """Keys with the same name and meaning in both forms."""
    c.gradient_clipping = r.number(cfg, "gradient_clipping", c.gradient_clipping, low=0, fp32=True)
    c.train_micro_batch_size_per_gpu = r.number(cfg, "train_micro_batch_size_per_gpu",
                                                c.train_micro_batch_size_per_gpu, integer=True, low=1)
    c.steps_per_print = r.number(cfg, "steps_per_print", c.steps_per_print, integer=True, low=1, high=MAX_PERIOD,
                                 integral_float=True)
    c.wall_clock_breakdown = r.boolean(cfg, "wall_clock_breakdown", c.wall_clock_breakdown)
    c.dataloader_drop_last = r.boolean(cfg, "dataloader_drop_last", c.dataloader_drop_last)
    c.scheduler = _scheduler(r, cfg)


POSITIVE = ("warmup_num_steps", "lr_range_test_step_size", "cycle_first_step_size")  # DeepSpeed requires > 0


def _scheduler(r, cfg):
    """{"type": one of zerort.engine.lr_schedules.SCHEDULES, "params": {...}}, each param checked."""
    from zerort.config.schedule_params import PARAMS

    sched, rs = r.child(cfg, "scheduler")
    if not sched:
        return None
    if "type" not in sched:
        r.problems.lines.append(f"{rs.key('type')}: missing; allowed: {' | '.join(map(repr, PARAMS))}")
    kind = rs.choice(sched, "type", None, tuple(PARAMS))
    params, rp = rs.child(sched, "params")
    rs.leftover(sched)
    if kind is None:
        return None
    out = {}
    for name, (what, required) in PARAMS[kind].items():
        if name not in params:
            rp.problems.known.append(rp.key(name))
            if required:
                r.problems.lines.append(f"{rp.key(name)}: missing; scheduler {kind} needs it")
            continue
        if what == "int":
            low = -1 if name == "last_batch_iteration" else 1 if name in POSITIVE else 0
            v = rp.number(params, name, None, integer=True, low=low, integral_float=True)
        elif what == "number":
            v = rp.number(params, name, None, low=0, fp32=True)
        elif what == "bool":
            v = rp.boolean(params, name, None)
        elif what == "warmup_type":
            v = rp.choice(params, name, None, ("log", "linear"))
        else:  # a number, or one per param group
            _, v = rp._take(params, name)
            ok = lambda x: _real(x) and x >= 0
            if not (ok(v) or isinstance(v, list) and v and all(ok(x) for x in v)):
                rp.bad(name, v, "a finite number >= 0, or a list of them (one per param group)")
                v = None
            elif not rp.fp32(name, v):
                v = None
        if v is not None:
            out[name] = v
    rp.leftover(params)
    return {"type": kind, "params": out}


def _cross_key_rules(c, problems, scale_keys, precision_key):
    """Rules that join several keys; run once every key has been read."""
    power_key, min_key = scale_keys
    if c.precision == "fp16" and not c.static_loss_scale and c.min_loss_scale > 2.0 ** c.initial_scale_power:
        problems.lines.append(f"{min_key}: got {c.min_loss_scale!r}, above the initial loss scale "
                              f"2**{power_key} = {2.0 ** c.initial_scale_power:g} ({precision_key} on); "
                              f"allowed: <= {2.0 ** c.initial_scale_power:g}: lower {min_key} or raise {power_key}")
    micro, total, gas = c.train_micro_batch_size_per_gpu, c.train_batch_size, c.gradient_accumulation_steps
    if c.scheduler is not None and c.lr_schedule is not None:
        problems.lines.append("scheduler and lr_schedule: both given; allowed: one of them (each sets the lr)")
    if micro is not None and total is not None and c.gradient_accumulation_given and total % (micro * gas):
        problems.lines.append(f"train_batch_size: got {total}; allowed: a multiple of train_micro_batch_size_per_gpu "
                              f"({micro}) x gradient_accumulation_steps ({gas}) = {micro * gas} "
                              "(it equals that product times the world size)")


def parse(config, form=None):
    """Config from a dict, a JSON file path, or a Config (returned as is). form:
    "deepspeed" reads it as DeepSpeed's schema whatever keys it has (zerort.integrations.deepspeed
    does); None tells the two forms apart by their keys."""
    if isinstance(config, Config):
        return config
    if config is None:
        return Config()
    problems = _Problems()
    if isinstance(config, (str, os.PathLike)):
        config, problems.lines = read_json(config)
    if not isinstance(config, dict):
        raise ConfigError([f"config: got {_kind(config)}; allowed: a dict, a JSON file path or a zerort.config.Config"])
    deep = _depth_problem(config, "config")
    if deep:
        raise ConfigError([deep])
    cfg = dict(config)
    parser = _parser(cfg, form)
    if parser is not _parse_ours:  # DeepSpeed's form; its "zerort" section is ours ("auto" is a comm.backend)
        has_ours, ours, autos = "zerort" in cfg, cfg.pop("zerort", None), []
        cfg = _without_auto(cfg, "", autos)
        problems.lines += at_most(autos, _auto_line, "\"auto\" values", MAX_AUTOS_LISTED)
        if has_ours:
            cfg["zerort"] = ours
    c, scale_keys, precision_key = parser(cfg, problems)
    _cross_key_rules(c, problems, scale_keys, precision_key)
    lines = problems.finish()
    if lines:
        raise ConfigError(lines)
    return c


def known_keys(deepspeed=False):
    """Every key path the parser reads (sections included), for ours or DeepSpeed's schema."""
    problems = _Problems()
    if deepspeed:
        from zerort.config.deepspeed_form import parse_deepspeed

        parse_deepspeed({}, problems)
    else:
        _parse_ours({}, problems)
    return list(problems.known)


@functools.lru_cache(maxsize=None)
def _markers():
    """Top-level keys only DeepSpeed's form has."""
    from zerort.config.deepspeed_keys import TABLE

    ours = {k.split(".")[0] for k in known_keys()}
    return frozenset(DEEPSPEED_MARKERS | {k.split(".")[0] for k in TABLE} - ours)


def _parser(cfg, form=None):
    """Our form's parser, or DeepSpeed's (zerort.config.deepspeed_form) for a config in its schema."""
    from zerort.config.deepspeed_form import parse_deepspeed

    if form == "deepspeed":
        return parse_deepspeed
    deepspeed = bool(_markers() & cfg.keys()) or isinstance(cfg.get("optimizer"), dict) and "type" in cfg["optimizer"]
    if not deepspeed:
        return _parse_ours

    return parse_deepspeed


def is_deepspeed_form(cfg):
    """Whether parse() reads the dict cfg in DeepSpeed's form (its keys tell)."""
    return _parser(dict(cfg)) is not _parse_ours


def _without_auto(d, prefix, autos, path_ids=()):
    """A copy of DeepSpeed config d without its "auto" values, whose key paths go to autos
    (each a problem: only HuggingFace's Trainer integration fills them in). A section that
    contains itself is kept as it is."""
    path_ids = path_ids + (id(d),)
    out = {}
    for k, v in d.items():
        path = f"{prefix}{_key_name(k)}"
        if isinstance(v, str) and v == "auto":
            autos.append(path)
        else:
            walk = isinstance(v, dict) and id(v) not in path_ids
            out[k] = _without_auto(v, path + ".", autos, path_ids) if walk else v
    return out


def _auto_line(path):
    return (f"{path}: got 'auto'; \"auto\" is a value HuggingFace's Trainer integration fills in from its "
            "TrainingArguments and the model: zerort.integrations.hf.Trainer fills the keys HuggingFace fills (batch "
            "sizes, gradient_clipping, the optimizer's params, fp16/bf16 enabled, bucket sizes, the scheduler's "
            "warm-up and step counts), zerort.initialize none; give a number (or true/false)")


def resolve_batch(c, world_size):
    """c with DeepSpeed's batch rule applied at world_size: two of train_batch_size,
    train_micro_batch_size_per_gpu and gradient_accumulation_steps give the third
    (train_batch_size = micro x accumulation x world size); raises ConfigError when the
    three do not agree."""
    micro, total, gas = c.train_micro_batch_size_per_gpu, c.train_batch_size, c.gradient_accumulation_steps
    if total is not None and micro is not None and not c.gradient_accumulation_given:
        if total % (micro * world_size):
            raise ConfigError([f"train_batch_size: got {total}; it must be a multiple of train_micro_batch_size_per_gpu "
                               f"({micro}) x world size ({world_size}) = {micro * world_size} (the quotient is "
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
    return dataclasses.replace(c, train_micro_batch_size_per_gpu=micro, train_batch_size=total,
                               gradient_accumulation_steps=gas, gradient_accumulation_given=True)


def to_dict(c):
    d = dataclasses.asdict(c)
    d["lr_schedule"] = None if c.lr_schedule is None else repr(c.lr_schedule)
    return d
