"""Our config form read into a Config's sections (zerort.config.deepspeed_form reads
DeepSpeed's with the helpers here), and parse(), which tells the two forms apart. How values
are checked and problems collected: zerort.config.reader.
"""
import dataclasses
import functools
import os
import types

from zerort.config.files import read_json
from zerort.config.reader import (MAX_AUTOS_LISTED, MAX_NUMEL, MAX_PERIOD, MAX_PREFETCH, _depth_problem, _key_name,
                                  _kind, _Problems, _Reader, _real, at_most)
from zerort.config.sections import SECTIONS, Config
from zerort.errors import ConfigError

DEEPSPEED_MARKERS = {"zero_optimization", "bf16", "bfloat16", "fp16", "train_batch_size", "zerort"}


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
    ro.leftover(opt)
    ls, rl = r.child(cfg, "loss_scale")
    scale_keys = loss_scale(rl, ls, c, window_key="window", min_key="min_scale")
    c.loss_scale.static = rl.number(ls, "static", c.loss_scale.static, low=0, fp32=True)
    rl.leftover(ls)
    c.batch.gradient_accumulation_steps = r.number(cfg, "gradient_accumulation_steps",
                                                   c.batch.gradient_accumulation_steps, integer=True, low=1)
    c.reduce_bucket_numel = r.number(cfg, "reduce_bucket_numel", c.reduce_bucket_numel, integer=True, low=1,
                                     high=MAX_NUMEL)
    common(r, cfg, c)
    runtime_keys(r, cfg, c)
    mon, rm = r.child(cfg, "monitor")
    where = os.path.join(rm.text(mon, "output_path", "runs"), rm.text(mon, "job_name", "zerort"))
    c.monitor.csv = where if rm.boolean(mon, "csv", False) else None
    c.monitor.tensorboard = where if rm.boolean(mon, "tensorboard", False) else None
    rm.leftover(mon)
    r.leftover(cfg)
    return c.config(), scale_keys, "precision"


def runtime_keys(r, cfg, c):
    """zerort's own keys without a DeepSpeed counterpart: at the top of our form, under
    "zerort" in DeepSpeed's."""
    s3, r3 = r.child(cfg, "stage3")
    c.stage3.prefetch = r3.number(s3, "prefetch", c.stage3.prefetch, integer=True, low=0, high=MAX_PREFETCH)
    c.stage3.persistence_threshold = r3.number(s3, "persistence_threshold", c.stage3.persistence_threshold,
                                               integer=True, low=0, high=MAX_NUMEL)
    c.stage3.unit_modules = r3.names(s3, "unit_modules", c.stage3.unit_modules)
    r3.leftover(s3)
    cm, rc = r.child(cfg, "comm")
    c.comm.backend = rc.choice(cm, "backend", c.comm.backend, ("auto", "mpi", "gloo", "nccl", "inprocess"))
    c.comm.timeout_s = rc.number(cm, "timeout_s", c.comm.timeout_s, low=1e-3, high=1e9)  # as the C++ comm
    c.comm.debug = rc.boolean(cm, "debug", c.comm.debug)
    rc.leftover(cm)
    c.max_consecutive_skips = r.number(cfg, "max_consecutive_skips", c.max_consecutive_skips, integer=True, low=1)
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


def _cross_key_rules(c, problems, scale_keys, precision_key):
    """Rules that join several keys; run once every key has been read."""
    power_key, min_key = scale_keys
    s, b = c.loss_scale, c.batch
    if c.precision == "fp16" and not s.static and s.min_scale > 2.0 ** s.initial_scale_power:
        problems.lines.append(f"{min_key}: got {s.min_scale!r}, above the initial loss scale "
                              f"2**{power_key} = {2.0 ** s.initial_scale_power:g} ({precision_key} on); "
                              f"allowed: <= {2.0 ** s.initial_scale_power:g}: lower {min_key} or raise {power_key}")
    micro, total, gas = b.train_micro_batch_size_per_gpu, b.train_batch_size, b.gradient_accumulation_steps
    if c.optimizer.scheduler is not None and c.optimizer.lr_schedule is not None:
        problems.lines.append("scheduler and lr_schedule: both given; allowed: one of them (each sets the lr)")
    if micro is not None and total is not None and gas is not None and total % (micro * gas):
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
