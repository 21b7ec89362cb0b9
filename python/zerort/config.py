"""zerort configuration: our own keys, or the subset of DeepSpeed's JSON schema we support.

    zerort.config.parse({"stage": 2, "precision": "bf16", "optimizer": {"lr": 3e-4}})
    zerort.config.parse("ds_config.json")      # a DeepSpeed config works too

Every key is typed and range-checked; all problems in one config are reported together in
one ConfigError, each naming the key, the value it got and what is allowed.
"""
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Optional


class ConfigError(ValueError):
    """A bad config. .problems lists one line per bad key."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("invalid zerort config:\n  " + "\n  ".join(self.problems))


@dataclass
class Config:
    stage: int = 2
    precision: str = "bf16"
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    lr_schedule: Optional[Callable[[int], float]] = None
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False
    gradient_clipping: float = 0.0
    gradient_accumulation_steps: int = 1
    reduce_bucket_numel: int = 1 << 24  # stages 0-2; stage 3 reduces per unit
    prefetch: int = 1  # stage 3: units gathered ahead of the one running
    persistence_threshold: int = 0
    unit_modules: tuple = ()
    comm_backend: str = "auto"
    comm_timeout_s: float = 600.0
    fp32_modules: tuple = ("LayerNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d")
    train_micro_batch_size_per_gpu: Optional[int] = None  # checked against train_batch_size
    train_batch_size: Optional[int] = None


OUR_KEYS = {"stage", "precision", "optimizer", "loss_scale", "gradient_clipping",
            "gradient_accumulation_steps", "reduce_bucket_numel", "stage3", "comm", "fp32_modules",
            "lr_schedule", "train_micro_batch_size_per_gpu"}
DEEPSPEED_MARKERS = {"zero_optimization", "bf16", "fp16", "train_batch_size"}


class _Reader:
    """Pops keys from a dict with type/range checks, collecting problems instead of raising."""

    def __init__(self, problems, prefix=""):
        self.problems = problems
        self.prefix = prefix

    def key(self, name):
        return f"{self.prefix}{name}"

    def bad(self, name, value, allowed):
        self.problems.append(f"{self.key(name)}: got {value!r}; allowed: {allowed}")

    def number(self, d, name, default, *, integer=False, low=None, high=None, low_open=False):
        if name not in d:
            return default
        v = d.pop(name)
        kind = int if integer else (int, float)
        if isinstance(v, bool) or not isinstance(v, kind) or (not integer and not math.isfinite(v)):
            self.bad(name, v, "an integer" if integer else "a finite number")
            return default
        too_low = low is not None and (v <= low if low_open else v < low)
        too_high = high is not None and v > high
        if too_low or too_high:
            lo = "" if low is None else (f"> {low}" if low_open else f">= {low}")
            hi = "" if high is None else f"<= {high}"
            self.bad(name, v, " and ".join(x for x in (lo, hi) if x))
            return default
        return v

    def choice(self, d, name, default, options):
        if name not in d:
            return default
        v = d.pop(name)
        if v not in options:
            self.bad(name, v, " | ".join(repr(o) for o in options))
            return default
        return v

    def boolean(self, d, name, default):
        if name not in d:
            return default
        v = d.pop(name)
        if not isinstance(v, bool):
            self.bad(name, v, "true or false")
            return default
        return v

    def section(self, d, name):
        if name not in d:
            return {}
        v = d.pop(name)
        if not isinstance(v, dict):
            self.bad(name, v, "an object")
            return {}
        return dict(v)

    def leftover(self, d, what="unknown or unsupported key"):
        for k in sorted(d):
            self.problems.append(f"{self.key(k)}: {what}")


def _betas(r, d, default):
    if "betas" not in d:
        return default
    v = d.pop("betas")
    ok = (isinstance(v, (list, tuple)) and len(v) == 2 and
          all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in v))
    if not ok:
        r.bad("betas", v, "two numbers in [0, 1)")
        return default
    return (float(v[0]), float(v[1]))


def _optimizer_params(r, d, c):
    c.lr = r.number(d, "lr", c.lr, low=0)
    c.betas = _betas(r, d, c.betas)
    c.eps = r.number(d, "eps", c.eps, low=0)
    c.weight_decay = r.number(d, "weight_decay", c.weight_decay, low=0)


def _loss_scale(r, d, c, window, min_scale):
    """The loss-scaler keys; ours and DeepSpeed's differ only in two names."""
    c.initial_scale_power = r.number(d, "initial_scale_power", c.initial_scale_power, integer=True, low=0, high=60)
    c.loss_scale_window = r.number(d, window, c.loss_scale_window, integer=True, low=1)
    c.hysteresis = r.number(d, "hysteresis", c.hysteresis, integer=True, low=1)
    c.min_loss_scale = r.number(d, min_scale, c.min_loss_scale, low=0, low_open=True)
    c.consecutive_hysteresis = r.boolean(d, "consecutive_hysteresis", c.consecutive_hysteresis)


def _parse_ours(cfg, problems):
    c = Config()
    r = _Reader(problems)
    c.stage = r.number(cfg, "stage", c.stage, integer=True, low=0, high=3)
    c.precision = r.choice(cfg, "precision", c.precision, ("bf16", "fp16", "fp32"))
    opt = r.section(cfg, "optimizer")
    ro = _Reader(problems, "optimizer.")
    _optimizer_params(ro, opt, c)
    ro.leftover(opt)
    ls = r.section(cfg, "loss_scale")
    rl = _Reader(problems, "loss_scale.")
    _loss_scale(rl, ls, c, window="window", min_scale="min_scale")
    rl.leftover(ls)
    _common(r, cfg, c)
    s3 = r.section(cfg, "stage3")
    r3 = _Reader(problems, "stage3.")
    c.prefetch = r3.number(s3, "prefetch", c.prefetch, integer=True, low=0)
    c.persistence_threshold = r3.number(s3, "persistence_threshold", c.persistence_threshold, integer=True, low=0)
    if "unit_modules" in s3:
        v = s3.pop("unit_modules")
        if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
            c.unit_modules = tuple(v)
        else:
            r3.bad("unit_modules", v, "a list of module class names")
    r3.leftover(s3)
    cm = r.section(cfg, "comm")
    rc = _Reader(problems, "comm.")
    c.comm_backend = rc.choice(cm, "backend", c.comm_backend, ("auto", "mpi", "gloo", "nccl", "inprocess"))
    c.comm_timeout_s = rc.number(cm, "timeout_s", c.comm_timeout_s, low=0, low_open=True)
    rc.leftover(cm)
    if "fp32_modules" in cfg:
        v = cfg.pop("fp32_modules")
        if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
            c.fp32_modules = tuple(v)
        else:
            r.bad("fp32_modules", v, "a list of module class names")
    if "lr_schedule" in cfg:
        v = cfg.pop("lr_schedule")
        if callable(v):
            c.lr_schedule = v
        else:
            r.bad("lr_schedule", v, "a callable step -> lr")
    r.leftover(cfg)
    return c


def _common(r, cfg, c):
    c.gradient_clipping = r.number(cfg, "gradient_clipping", c.gradient_clipping, low=0)
    c.gradient_accumulation_steps = r.number(cfg, "gradient_accumulation_steps", c.gradient_accumulation_steps,
                                             integer=True, low=1)
    c.reduce_bucket_numel = r.number(cfg, "reduce_bucket_numel", c.reduce_bucket_numel, integer=True, low=1)
    c.train_micro_batch_size_per_gpu = r.number(cfg, "train_micro_batch_size_per_gpu",
                                                c.train_micro_batch_size_per_gpu, integer=True, low=1)


def _parse_deepspeed(cfg, problems):
    c = Config(stage=0, weight_decay=0.0)  # DeepSpeed's defaults: no ZeRO, AdamW without decay
    r = _Reader(problems)
    c.train_batch_size = r.number(cfg, "train_batch_size", None, integer=True, low=1)
    zero = r.section(cfg, "zero_optimization")
    rz = _Reader(problems, "zero_optimization.")
    c.stage = rz.number(zero, "stage", c.stage, integer=True, low=0, high=3)
    bucket = rz.number(zero, "reduce_bucket_size", None, low=1)
    if bucket is not None:
        c.reduce_bucket_numel = int(bucket)
    rz.leftover(zero)
    bf16 = r.section(cfg, "bf16")
    rb = _Reader(problems, "bf16.")
    bf16_on = rb.boolean(bf16, "enabled", False)
    rb.leftover(bf16)
    fp16 = r.section(cfg, "fp16")
    rf = _Reader(problems, "fp16.")
    fp16_on = rf.boolean(fp16, "enabled", False)
    _loss_scale(rf, fp16, c, window="loss_scale_window", min_scale="min_loss_scale")
    rf.leftover(fp16)
    if bf16_on and fp16_on:
        problems.append("bf16.enabled and fp16.enabled: both true; enable at most one")
    c.precision = "bf16" if bf16_on else "fp16" if fp16_on else "fp32"
    opt = r.section(cfg, "optimizer")
    ro = _Reader(problems, "optimizer.")
    ro.choice(opt, "type", "AdamW", ("AdamW", "adamw"))
    params = ro.section(opt, "params")
    rp = _Reader(problems, "optimizer.params.")
    _optimizer_params(rp, params, c)
    rp.leftover(params)
    ro.leftover(opt)
    _common(r, cfg, c)
    r.leftover(cfg, "unknown or unsupported DeepSpeed key")
    return c


def parse(config):
    """Config from a dict, a JSON file path, or a Config (returned as is)."""
    if isinstance(config, Config):
        return config
    if config is None:
        return Config()
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except OSError as e:
            raise ConfigError([f"config file {os.fspath(config)!r}: {e.strerror}"]) from None
        except json.JSONDecodeError as e:
            raise ConfigError([f"config file: not valid JSON ({e})"]) from None
    if not isinstance(config, dict):
        raise ConfigError([f"config: got {type(config).__name__}; allowed: a dict or a JSON file path"])
    cfg = dict(config)
    problems = []
    deepspeed = bool(DEEPSPEED_MARKERS & cfg.keys()) or isinstance(cfg.get("optimizer"), dict) and "type" in cfg["optimizer"]
    c = _parse_deepspeed(cfg, problems) if deepspeed else _parse_ours(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return c


def to_dict(c):
    d = dataclasses.asdict(c)
    d["lr_schedule"] = None if c.lr_schedule is None else repr(c.lr_schedule)
    return d
