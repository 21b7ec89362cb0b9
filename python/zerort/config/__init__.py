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
under an unknown key is named in a line, not repeated.
"""
import dataclasses
import difflib
import functools
import json
import math
import os
import reprlib
from dataclasses import dataclass
from typing import Callable, Optional

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
MAX_INT = 2 ** 62  # counts and sizes travel to C++ as int64 / size_t
MAX_DEPTH = 64  # levels of nested objects and lists; a real config has 4
SHOWN_CHARS = 200  # of a value in a message

_repr = reprlib.Repr()  # walks at most a few levels and items of a value
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 4, 80, SHOWN_CHARS, SHOWN_CHARS
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = _repr.maxfrozenset = 8


def show(v):
    """repr(v) for a message, cut short: a long string to its first 200 characters and
    '...(N chars)', a long list or object to its first items and '(... of N items)'."""
    if isinstance(v, (str, bytes)) and len(v) > SHOWN_CHARS:
        return f"{v[:SHOWN_CHARS]!r}...({len(v)} {'chars' if isinstance(v, str) else 'bytes'})"
    r = _repr.repr(v)
    if isinstance(v, (list, tuple, dict, set, frozenset)) and len(v) > 8:
        r += f" ({_kind(v)} of {len(v)} items)"
    return r if len(r) <= 2 * SHOWN_CHARS else r[:SHOWN_CHARS] + f"...({len(r)} chars shown in part)"


def _key_name(k):
    """A key for a key path, cut short ('…', not '...': a '.' separates sections)."""
    k = str(k) if not isinstance(k, str) else k
    return k if len(k) <= SHOWN_CHARS else f"{k[:SHOWN_CHARS]}…({len(k)} chars)"


def _depth_problem(config, where):
    """A problem line when config nests deeper than MAX_DEPTH (walked without recursion;
    a shared or cyclic part is walked once), else None."""
    stack, seen = [(config, 1)], {id(config)}
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            return (f"{where}: nested more than {MAX_DEPTH} levels deep; allowed: at most {MAX_DEPTH} levels of objects "
                    "and lists (a zerort or DeepSpeed config needs 4)")
        for child in (v.values() if isinstance(v, dict) else v):
            if isinstance(child, (dict, list, tuple)) and id(child) not in seen:
                seen.add(id(child))
                stack.append((child, depth + 1))
    return None


def _kind(v):
    """'a bool', 'an int', 'a str', 'null' ...: the type of a bad value, for messages."""
    if v is None:
        return "null"
    name = type(v).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


class _Problems:
    """The problems found in one config, and every key path the parser knows (for the
    closest-key suggestion of an unknown key)."""

    def __init__(self):
        self.lines, self.known, self.unknown = [], [], []

    def finish(self):
        """Unknown keys, each with the closest known key; then the list of all problems."""
        for path, value, what in self.unknown:
            line = f"{path}: {what} (got {show(value)})"
            hint = _closest(path, self.known)
            if hint:
                line += f"; did you mean {hint!r}?"
            section = path.rsplit(".", 1)[0] + "." if "." in path else ""
            here = [k[len(section):] for k in self.known if k.startswith(section) and "." not in k[len(section):]]
            line += f"; known keys{' in ' + section[:-1] if section else ''}: {', '.join(here)}"
            self.lines.append(line)
        return self.lines


def _closest(path, known):
    """The known key path nearest to an unknown one: by whole path, else by its last part
    (a key put in the wrong section, like a top-level 'lr' for 'optimizer.lr')."""
    match = difflib.get_close_matches(path, known, n=1, cutoff=0.75)
    if match:
        return match[0]
    leaf = path.rsplit(".", 1)[-1]
    leaves = {k.rsplit(".", 1)[-1]: k for k in reversed(known)}
    match = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
    return leaves[match[0]] if match else None


class _Reader:
    """Pops keys from a dict with type/range checks, collecting problems instead of raising."""

    def __init__(self, problems, prefix=""):
        self.problems = problems
        self.prefix = prefix

    def key(self, name):
        return f"{self.prefix}{name}"

    def bad(self, name, value, allowed, wrong_type=False):
        kind = f" ({_kind(value)})" if wrong_type else ""
        self.problems.lines.append(f"{self.key(name)}: got {show(value)}{kind}; allowed: {allowed}")

    def _take(self, d, name):
        """(present, value) of d[name]; records name as a known key."""
        self.problems.known.append(self.key(name))
        return (True, d.pop(name)) if name in d else (False, None)

    def number(self, d, name, default, *, integer=False, low=None, high=None, low_open=False, integral_float=False,
               example=None):
        present, v = self._take(d, name)
        if not present:
            return default
        if integer and high is None:
            high = MAX_INT
        lo = "" if low is None else (f"> {low}" if low_open else f">= {low}")
        hi = "" if high is None else "<= 2**62" if high == MAX_INT else f"<= {high:g}"
        limits = " and ".join(x for x in (lo, hi) if x) + (f" (e.g. {example})" if example else "")
        given = v
        if integral_float and isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        kind = int if integer else (int, float)
        wrong_type = isinstance(v, bool) or not isinstance(v, kind)
        if wrong_type or (not integer and not math.isfinite(v)):
            what = "an integer" if integer else "a finite number"
            self.bad(name, given, f"{what} {limits}".strip(), wrong_type)
            return default
        too_low = low is not None and (v <= low if low_open else v < low)
        if too_low or (high is not None and v > high):
            self.bad(name, given, limits)
            return default
        return v

    def choice(self, d, name, default, options):
        present, v = self._take(d, name)
        if not present:
            return default
        if not isinstance(v, str) or v not in options:
            self.bad(name, v, " | ".join(repr(o) for o in options), not isinstance(v, str))
            return default
        return v

    def typed(self, d, name, default, kind, allowed):
        """d[name] if it is a `kind` (default when absent or not)."""
        present, v = self._take(d, name)
        if not present:
            return default
        if not isinstance(v, kind):
            self.bad(name, v, allowed, True)
            return default
        return v

    def boolean(self, d, name, default):
        return self.typed(d, name, default, bool, "true or false (a JSON bool)")

    def text(self, d, name, default):
        return self.typed(d, name, default, str, "a string")

    def names(self, d, name, default):
        """A list of module class names."""
        present, v = self._take(d, name)
        if not present:
            return default
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
            self.bad(name, v, "a list of module class names, such as [\"LayerNorm\"]", not isinstance(v, (list, tuple)))
            return default
        return tuple(v)

    def section(self, d, name):
        present, v = self._take(d, name)
        if not present:
            return {}
        if not isinstance(v, dict):
            self.bad(name, v, "an object of keys" + (" such as {\"enabled\": true}" if name in ("fp16", "bf16") else ""),
                     True)
            return {}
        return dict(v)

    def child(self, d, name):
        """(section dict, its reader) for a nested section."""
        return self.section(d, name), _Reader(self.problems, f"{self.key(name)}.")

    def leftover(self, d, what="unknown or unsupported key"):
        for k in sorted(d, key=str):
            self.problems.unknown.append((self.key(_key_name(k)), d[k], what))


def _betas(r, d, default):
    present, v = r._take(d, "betas")
    if not present:
        return default
    ok = (isinstance(v, (list, tuple)) and len(v) == 2 and
          all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in v))
    if not ok:
        r.bad("betas", v, "a list of two numbers, each >= 0 and < 1, such as [0.9, 0.999]")
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
    c.lr = r.number(d, "lr", c.lr, low=0)
    c.betas = _betas(r, d, c.betas)
    # eps = 0 turns the update into 0 / 0 = NaN wherever a gradient and its moments are 0.
    c.eps = r.number(d, "eps", c.eps, low=0, low_open=True, example="1e-8")
    c.weight_decay = r.number(d, "weight_decay", c.weight_decay, low=0)
    c.bias_correction = r.boolean(d, "bias_correction", c.bias_correction)


def _loss_scale(r, d, c, window, min_scale):
    """The loss-scaler keys; ours and DeepSpeed's differ only in two names."""
    c.initial_scale_power = r.number(d, "initial_scale_power", c.initial_scale_power, integer=True, low=0, high=60)
    c.loss_scale_window = r.number(d, window, c.loss_scale_window, integer=True, low=1)
    c.hysteresis = r.number(d, "hysteresis", c.hysteresis, integer=True, low=1)
    c.min_loss_scale = r.number(d, min_scale, c.min_loss_scale, low=0, low_open=True)
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
    c.static_loss_scale = rl.number(ls, "static", c.static_loss_scale, low=0)
    rl.leftover(ls)
    c.gradient_accumulation_steps = r.number(cfg, "gradient_accumulation_steps", c.gradient_accumulation_steps,
                                             integer=True, low=1)
    c.reduce_bucket_numel = r.number(cfg, "reduce_bucket_numel", c.reduce_bucket_numel, integer=True, low=1)
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
    c.prefetch = r3.number(s3, "prefetch", c.prefetch, integer=True, low=0)
    c.persistence_threshold = r3.number(s3, "persistence_threshold", c.persistence_threshold, integer=True, low=0)
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
    c.gradient_clipping = r.number(cfg, "gradient_clipping", c.gradient_clipping, low=0)
    c.train_micro_batch_size_per_gpu = r.number(cfg, "train_micro_batch_size_per_gpu",
                                                c.train_micro_batch_size_per_gpu, integer=True, low=1)
    c.steps_per_print = r.number(cfg, "steps_per_print", c.steps_per_print, integer=True, low=1, integral_float=True)
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
            v = rp.number(params, name, None, low=0)
        elif what == "bool":
            v = rp.boolean(params, name, None)
        elif what == "warmup_type":
            v = rp.choice(params, name, None, ("log", "linear"))
        else:  # a number, or one per param group
            _, v = rp._take(params, name)
            ok = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
            if not (ok(v) or isinstance(v, list) and v and all(ok(x) for x in v)):
                rp.bad(name, v, "a finite number >= 0, or a list of them (one per param group)")
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


def read_json(path):
    """(the dict in a JSON file, its problems): a key given twice in one object is a
    problem (JSON would silently keep the last); an unreadable file, bad JSON or a
    non-object raises ConfigError naming the file."""
    name = os.fspath(path)
    twice = []

    def pairs(items):
        seen = {}
        for k, v in items:
            if k in seen:
                twice.append(k)
            seen[k] = v
        return seen

    try:
        with open(path, "rb") as f:
            raw = f.read()
        config = json.loads(raw.decode("utf-8"), object_pairs_hook=pairs)
    except OSError as e:
        raise ConfigError([f"config file {name!r}: {e.strerror}"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"config file {name!r}: not UTF-8 text (byte {e.start}); save it as UTF-8 JSON"]) from None
    except json.JSONDecodeError as e:
        raise ConfigError([f"config file {name!r}: not valid JSON ({e})"]) from None
    except RecursionError:  # the JSON parser's own limit, near 1000 levels
        raise ConfigError([f"config file {name!r}: nested too deep for the JSON parser; allowed: at most {MAX_DEPTH} "
                           "levels of objects and lists (a zerort or DeepSpeed config needs 4)"]) from None
    deep = _depth_problem(config, f"config file {name!r}")
    if deep:
        raise ConfigError([deep])
    if not isinstance(config, dict):
        raise ConfigError([f"config file {name!r}: got {_kind(config)}; allowed: a JSON object of keys"])
    return config, [f"{k}: given twice in one object of config file {name!r}; allowed: once (JSON keeps the last)"
                    for k in twice]


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
        has_ours, ours = "zerort" in cfg, cfg.pop("zerort", None)
        cfg = _without_auto(cfg, "", problems.lines)
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


def _without_auto(d, prefix, lines, path_ids=()):
    """A copy of DeepSpeed config d without its "auto" values, each a problem: only
    HuggingFace's Trainer integration fills them in. A section that contains itself is
    kept as it is."""
    path_ids = path_ids + (id(d),)
    out = {}
    for k, v in d.items():
        path = f"{prefix}{_key_name(k)}"
        if isinstance(v, str) and v == "auto":
            lines.append(f"{path}: got 'auto'; \"auto\" is a value HuggingFace's Trainer integration fills in from "
                         "its TrainingArguments and the model: zerort.integrations.hf.Trainer fills the keys "
                         "HuggingFace fills (batch sizes, gradient_clipping, the optimizer's params, fp16/bf16 "
                         "enabled, bucket sizes, the scheduler's warm-up and step counts), zerort.initialize none; "
                         "give a number (or true/false)")
        else:
            walk = isinstance(v, dict) and id(v) not in path_ids
            out[k] = _without_auto(v, path + ".", lines, path_ids) if walk else v
    return out


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
