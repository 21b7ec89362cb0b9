"""Our config form read into a Config's sections, and the section readers
zerort.config.deepspeed_form reads DeepSpeed's form with (zerort.config.parser tells the
two forms apart). How values are checked and problems collected: zerort.config.reader.
"""
import dataclasses
import os
import types

from zerort.comm.topology import INTER_DTYPES
from zerort.config import offload
from zerort.config.reader import MAX_NUMEL, MAX_PERIOD, MAX_PREFETCH, MAX_WORLD, _Reader, _real
from zerort.config.sections import SECTIONS, Config


class Draft:
    """A Config's values while one config is read (the Config is frozen): its top-level
    fields as attributes, each section a namespace of its fields. config() is the Config."""

    def __init__(self, base):
        for f in dataclasses.fields(base):
            v = getattr(base, f.name)
            if f.name in SECTIONS:
                v = types.SimpleNamespace(**{g.name: getattr(v, g.name) for g in dataclasses.fields(v)})
            setattr(self, f.name, v)

    def config(self):
        return Config(**{name: SECTIONS[name](**vars(v)) if name in SECTIONS else v for name, v in vars(self).items()})


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


def optimizer_params(r, d, c):
    """AdamW's keys into the Draft c's optimizer section; the same in both forms."""
    o = c.optimizer
    o.lr = r.number(d, "lr", o.lr, low=0, fp32=True)
    o.betas = _betas(r, d, o.betas)
    # eps = 0 turns the update into 0 / 0 = NaN wherever a gradient and its moments are 0,
    # and so does an eps that is 0 in FP32: Note [bounded values].
    o.eps = r.number(d, "eps", o.eps, low=0, low_open=True, fp32=True, example="1e-8")
    o.weight_decay = r.number(d, "weight_decay", o.weight_decay, low=0, fp32=True)
    o.bias_correction = r.boolean(d, "bias_correction", o.bias_correction)


def loss_scale(r, d, c, window_key, min_key):
    """The loss-scaler keys into the Draft c; ours and DeepSpeed's differ only in two names."""
    s = c.loss_scale
    s.initial_scale_power = r.number(d, "initial_scale_power", s.initial_scale_power, integer=True, low=0, high=60)
    s.window = r.number(d, window_key, s.window, integer=True, low=1)
    s.hysteresis = r.number(d, "hysteresis", s.hysteresis, integer=True, low=1)
    s.min_scale = r.number(d, min_key, s.min_scale, low=0, low_open=True, fp32=True)
    s.consecutive_hysteresis = r.boolean(d, "consecutive_hysteresis", s.consecutive_hysteresis)
    return r.key("initial_scale_power"), r.key(min_key)


def _parse_ours(cfg, problems):
    c = Draft(Config())
    r = _Reader(problems)
    c.stage = r.number(cfg, "stage", c.stage, integer=True, low=0, high=3)
    c.precision = r.choice(cfg, "precision", c.precision, ("bf16", "fp16", "fp32"))
    opt, ro = r.child(cfg, "optimizer")
    optimizer_params(ro, opt, c)
    c.optimizer.state_dtype = ro.choice(opt, "state_dtype", c.optimizer.state_dtype, ("fp32", "bf16"))
    c.optimizer.master_dtype = ro.choice(opt, "master_dtype", c.optimizer.master_dtype, ("fp32", "bf16"))
    ro.leftover(opt)
    ls, rl = r.child(cfg, "loss_scale")
    scale_keys = loss_scale(rl, ls, c, window_key="window", min_key="min_scale")
    c.loss_scale.static = rl.number(ls, "static", c.loss_scale.static, low=0, fp32=True)
    rl.leftover(ls)
    c.batch.gradient_accumulation_steps = r.number(cfg, "gradient_accumulation_steps",
                                                   c.batch.gradient_accumulation_steps, integer=True, low=1)
    c.shard_size = group_size(r, cfg, "shard_size", c.shard_size, auto=True)
    c.reduce_bucket_numel = r.number(cfg, "reduce_bucket_numel", c.reduce_bucket_numel, integer=True, low=1,
                                     high=MAX_NUMEL)
    common(r, cfg, c)
    runtime_keys(r, cfg, c)
    mon, rm = r.child(cfg, "monitor")
    where = os.path.join(rm.text(mon, "output_path", "runs"), rm.text(mon, "job_name", "zerort"))
    c.monitor.csv = where if rm.boolean(mon, "csv", False) else None
    c.monitor.tensorboard = where if rm.boolean(mon, "tensorboard", False) else None
    rm.leftover(mon)
    offload.read_ours(r, cfg, c)
    if c.shard_size == "auto":
        _shard_size_auto_allowed(r, c)
    # torch.autocast around the forward (DeepSpeed's torch_autocast)
    if cfg.get("autocast", "") is None:
        del cfg["autocast"]  # null: off, the default
    c.autocast = r.choice(cfg, "autocast", c.autocast, ("bf16",))
    if c.autocast and c.precision == "fp16":
        r.bad("autocast", c.autocast, "null with precision \"fp16\" (bf16 autocast over fp16 parameters mixes "
              "the two)")
    r.leftover(cfg)
    return c.config(), scale_keys, "precision"


def group_size(r, d, name, default, off=(), auto=False):
    """d[name]: a group of consecutive ranks, an int >= 1 or "node" (the launcher's ranks per
    node), or one of `off` (None: no groups); with auto, also "auto" (shard_size's: node groups
    where comm.topology auto's probe predicts them faster, zerort.comm.probe). Hybrid sharding's
    shard_size (DeepSpeed's mics_shard_size, off at -1 and 0) and stage 3's secondary_shard_size
    (zero_hpz_partition_size, off at 1): zerort.comm.topology makes the groups."""
    present, v = r._take(d, name)
    if not present:
        return default
    if isinstance(v, int) and not isinstance(v, bool) and v in off:
        return None
    low = 2 if 1 in off else 1
    if v == "node" or (auto and v == "auto") or (isinstance(v, int) and not isinstance(v, bool)
                                                 and low <= v <= MAX_WORLD):
        return v
    offs = f"{' or '.join(map(str, off))} (off), " if off else ""
    names = "'node' or 'auto'" if auto else "'node'"
    r.bad(name, v, f"{offs}an integer from {low} to {MAX_WORLD} (ranks per group), or {names}",
          not isinstance(v, (int, str)) or isinstance(v, bool))
    return default


def _shard_size_auto_allowed(r, c):
    """shard_size "auto" is comm.topology auto's probe choosing between the state sharded over
    the world and node groups (zerort.comm.probe): a problem where that choice cannot be made, or
    where node groups could not be built with the rest of the config."""
    why = ("stage 0 keeps the whole state on every rank, so there is nothing to shard in groups; use stage 1-3"
           if c.stage == 0 else
           f"the choice is comm.topology 'auto''s probe, and comm.topology is pinned to {c.comm.topology!r}; set "
           "comm.topology to 'auto'" if c.comm.topology != "auto" else
           "hybrid sharding keeps the state in memory; set offload.optimizer.device to 'none' and offload.placement "
           "to 'manual'" if c.offload.optimizer.device != "none" or c.offload.placement == "auto" else
           "hybrid sharding takes an FP32 master; drop optimizer.master_dtype 'bf16'"
           if c.optimizer.master_dtype == "bf16" else
           "stage3.secondary_shard_size (hpZ) is a layout of its own; choose node groups or hpZ by hand"
           if c.stage3.secondary_shard_size is not None else None)
    if why:
        r.bad("shard_size", "auto", "an integer that divides the world size or 'node' (hybrid sharding pinned), or "
              f"no shard_size key; 'auto' is refused here: {why}")


def runtime_keys(r, cfg, c):
    """zerort's own keys without a DeepSpeed counterpart: at the top of our form, under
    "zerort" in DeepSpeed's."""
    s3, r3 = r.child(cfg, "stage3")
    c.stage3.prefetch = r3.number(s3, "prefetch", c.stage3.prefetch, integer=True, low=0, high=MAX_PREFETCH)
    c.stage3.persistence_threshold = r3.number(s3, "persistence_threshold", c.stage3.persistence_threshold,
                                               integer=True, low=0, high=MAX_NUMEL)
    c.stage3.unit_modules = r3.names(s3, "unit_modules", c.stage3.unit_modules)
    c.stage3.gather_dtype = r3.choice(s3, "gather_dtype", c.stage3.gather_dtype, ("compute", "int8"))
    c.stage3.secondary_shard_size = group_size(r3, s3, "secondary_shard_size", c.stage3.secondary_shard_size, off=(1,))
    r3.leftover(s3)
    cm, rc = r.child(cfg, "comm")
    c.comm.backend = rc.choice(cm, "backend", c.comm.backend, ("auto", "mpi", "gloo", "nccl", "inprocess"))
    c.comm.timeout_s = rc.number(cm, "timeout_s", c.comm.timeout_s, low=1e-3, high=1e9)  # as the C++ comm
    c.comm.debug = rc.boolean(cm, "debug", c.comm.debug)
    c.comm.topology = rc.choice(cm, "topology", c.comm.topology, ("auto", "flat", "two_hop"))
    c.comm.inter_node_dtype = rc.choice(cm, "inter_node_dtype", c.comm.inter_node_dtype, INTER_DTYPES)
    c.comm.intra_node = rc.choice(cm, "intra_node", c.comm.intra_node, ("shm", "backend"))
    rc.leftover(cm)
    c.max_consecutive_skips = r.number(cfg, "max_consecutive_skips", c.max_consecutive_skips, integer=True, low=1)
    c.overlap_param_gather = r.boolean(cfg, "overlap_param_gather", c.overlap_param_gather)
    c.fp32_modules = _fp32_modules(r, cfg, c.fp32_modules)
    present, v = r._take(cfg, "lr_schedule")
    if present:
        if callable(v):
            c.optimizer.lr_schedule = v
        else:
            r.bad("lr_schedule", v, "a callable step -> lr")


def common(r, cfg, c):
    """Keys with the same name and meaning in both forms."""
    c.optimizer.gradient_clipping = r.number(cfg, "gradient_clipping", c.optimizer.gradient_clipping, low=0, fp32=True)
    c.batch.train_micro_batch_size_per_gpu = r.number(cfg, "train_micro_batch_size_per_gpu",
                                                      c.batch.train_micro_batch_size_per_gpu, integer=True, low=1)
    c.monitor.steps_per_print = r.number(cfg, "steps_per_print", c.monitor.steps_per_print, integer=True, low=1,
                                         high=MAX_PERIOD, integral_float=True)
    c.monitor.wall_clock_breakdown = r.boolean(cfg, "wall_clock_breakdown", c.monitor.wall_clock_breakdown)
    c.batch.dataloader_drop_last = r.boolean(cfg, "dataloader_drop_last", c.batch.dataloader_drop_last)
    c.optimizer.scheduler = _scheduler(r, cfg)


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
