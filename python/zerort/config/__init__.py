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
import difflib
import functools
import json
import math
import os
import reprlib
import stat
import struct
from dataclasses import dataclass
from typing import Callable, Optional

from zerort.errors import ConfigError
from zerort.file_types import file_kind


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
MAX_INT = 2 ** 31 - 1  # an integer's bound unless its key says otherwise: Note [bounded values]
MAX_NUMEL = 2 ** 40  # elements of a bucket or threshold: 2 TiB in bf16, more than any device holds
MAX_PREFETCH = 65536  # stage-3 units gathered ahead; a model has fewer units
MAX_PERIOD = 2 ** 62  # steps_per_print: DeepSpeed configs write 1e12 for "never"
MAX_INT_DIGITS = 100  # a longer integer literal in a config file stays a LongInteger
FP32_MAX = 3.4028234663852886e38  # FP32's largest finite number
FP32_TINY = 1.1754943508222875e-38  # FP32's smallest normal number
BOUND_NAMES = {MAX_INT: "2**31 - 1", MAX_NUMEL: "2**40", MAX_PERIOD: "2**62",  # a bound in a message
               FP32_MAX: "3.4028234e+38 (FP32's largest finite number)"}
MAX_FILE_BYTES = 16 << 20  # a config file; a real one is a few KB
MAX_LISTED = 10  # unknown keys (and keys given twice) named in a message; the rest are counted
MAX_AUTOS_LISTED = 64  # "auto" values named: more than the keys HuggingFace fills
MAX_DEPTH = 64  # levels of nested objects and lists; a real config has 4
SHOWN_CHARS = 200  # of a value in a message


class LongInteger:
    """An integer literal of a config file longer than MAX_INT_DIGITS digits (int() takes
    at most 4300): past every bound, so its key's check names it (Note [bounded values])."""

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return f"{self.text[:20]}...(an integer of {len(self.text.lstrip('-'))} digits)"


def _int_digits(v):
    """The number of decimal digits of the int v (str(v) stops at 4300)."""
    v = abs(v)
    n = int(math.log10(v)) + 1 if v else 1
    return n - 1 if v < 10 ** (n - 1) else n + 1 if v >= 10 ** n else n


class _Repr(reprlib.Repr):
    def repr_int(self, x, level):
        """A long integer as its number of digits (repr() refuses past 4300)."""
        if x.bit_length() <= 3 * SHOWN_CHARS:
            return super().repr_int(x, level)
        return f"{'-' if x < 0 else ''}(an integer of {_int_digits(x)} digits)"


_repr = _Repr()  # walks at most a few levels and items of a value
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 4, 80, SHOWN_CHARS, SHOWN_CHARS
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = _repr.maxfrozenset = 8


def show(v):
    """repr(v) for a message, cut short: a long string to its first 200 characters and
    '...(N chars)', a long list or object to its first items and '(... of N items)', a long
    integer to its number of digits."""
    if isinstance(v, (str, bytes)) and len(v) > SHOWN_CHARS:
        return f"{v[:SHOWN_CHARS]!r}...({len(v)} {'chars' if isinstance(v, str) else 'bytes'})"
    r = _repr.repr(v)
    if isinstance(v, (list, tuple, dict, set, frozenset)) and len(v) > 8:
        r += f" ({_kind(v)} of {len(v)} items)"
    return r if len(r) <= 2 * SHOWN_CHARS else r[:SHOWN_CHARS] + f"...({len(r)} chars shown in part)"


def _key_name(k):
    """A key for a key path, cut short ('…', not '...': a '.' separates sections)."""
    k = k if isinstance(k, str) else _repr.repr(k) if isinstance(k, int) else str(k)
    return k if len(k) <= SHOWN_CHARS else f"{k[:SHOWN_CHARS]}…({len(k)} chars)"


def _depth_problem(config, where):
    """A problem line when config nests deeper than MAX_DEPTH, naming the key it is under
    (its first 4 parts), else None. Walked without recursion; a shared or cyclic part is
    walked once."""
    stack, seen = [(config, 1, ())], {id(config)}
    while stack:
        v, depth, keys = stack.pop()
        if depth > MAX_DEPTH:
            under = f" under key {'.'.join(keys[:4]) + ('…' if len(keys) > 4 else '')!r}" if keys else ""
            return (f"{where}: nested more than {MAX_DEPTH} levels deep{under}; allowed: at most {MAX_DEPTH} levels of "
                    "objects and lists (a zerort or DeepSpeed config needs 4)")
        for k, child in (v.items() if isinstance(v, dict) else enumerate(v)):
            if isinstance(child, (dict, list, tuple)) and id(child) not in seen:
                seen.add(id(child))
                named = keys + (_key_name(k),) if isinstance(v, dict) and len(keys) < 5 else keys
                stack.append((child, depth + 1, named))
    return None


def _kind(v):
    """'a bool', 'an int', 'a str', 'null' ...: the type of a bad value, for messages."""
    if v is None:
        return "null"
    if isinstance(v, LongInteger):
        return "an integer"
    name = type(v).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


class _Problems:
    """The problems found in one config, and every key path the parser knows (for the
    closest-key suggestion of an unknown key)."""

    def __init__(self):
        self.lines, self.known, self.unknown = [], [], []

    def finish(self):
        """The list of all problems: the first MAX_LISTED unknown keys last, each with the
        closest known key, and the known keys of its section once (with the section's first
        unknown key)."""
        listed = set()  # sections whose known keys a line names

        def line(item):
            path, value, what = item
            text = f"{path}: {what} (got {show(value)})"
            hint = _closest(path, self.known)
            if hint:
                text += f"; did you mean {hint!r}?"
            section = path.rsplit(".", 1)[0] + "." if "." in path else ""
            if section not in listed:
                listed.add(section)
                here = [k[len(section):] for k in self.known if k.startswith(section) and "." not in k[len(section):]]
                text += f"; known keys{' in ' + section[:-1] if section else ''}: {', '.join(here)}"
            return text

        self.lines += at_most(self.unknown, line, "unknown keys")
        return self.lines


def at_most(items, line, more, limit=MAX_LISTED):
    """line(item) of the first `limit` items, and a last line counting the rest ('and 5
    more unknown keys'): a message stays short however many items there are."""
    lines = [line(x) for x in items[:limit]]
    rest = len(items) - len(lines)
    return lines + ([f"and {rest} more {more} (not listed)"] if rest > 0 else [])


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


def fp32_problem(v, zero_ok=True):
    """(what FP32 makes of the number v, what is allowed) when v is past FP32's range (inf
    there), or nonzero and below its smallest normal number (0 or subnormal there); None
    when FP32 holds v as a normal number or 0 (Note [bounded values]). zero_ok: whether
    the message offers 0."""
    try:
        v32 = struct.unpack("f", struct.pack("f", float(v)))[0]
    except OverflowError:  # past float64 (a long int), or past FP32
        v32 = math.inf
    sign = "-" if v < 0 else ""
    if math.isinf(v32):
        return "inf", f"{'>=' if v < 0 else '<='} {sign}{BOUND_NAMES[FP32_MAX]}"
    if v != 0 and abs(v32) < FP32_TINY:
        return ("0" if v32 == 0 else "subnormal",
                f"{'0, or ' if zero_ok else ''}{'<=' if v < 0 else '>='} {sign}{FP32_TINY:.8g} (FP32's smallest normal "
                "number)")
    return None


class _Reader:
    """Pops keys from a dict with type/range checks, collecting problems instead of raising."""

    def __init__(self, problems, prefix=""):
        self.problems = problems
        self.prefix = prefix

    def key(self, name):
        return f"{self.prefix}{name}"

    def bad(self, name, value, allowed, wrong_type=False, becomes=""):
        kind = f" ({_kind(value)})" if wrong_type else ""
        self.problems.lines.append(f"{self.key(name)}: got {show(value)}{kind}{becomes}; allowed: {allowed}")

    def _take(self, d, name):
        """(present, value) of d[name]; records name as a known key."""
        self.problems.known.append(self.key(name))
        return (True, d.pop(name)) if name in d else (False, None)

    def fp32(self, name, given, zero_ok=True, example=None):
        """Whether the number given, or each number of the list given, is one the engine
        can compute with in FP32; if not, a problem says what FP32 makes of it (Note
        [bounded values])."""
        items = given if isinstance(given, (list, tuple)) else [given]
        for v in items:
            problem = fp32_problem(v, zero_ok)
            if problem:
                becomes, allowed = problem
                where, each = (f"whose {show(v)}", "each ") if items is given else ("which", "")
                self.bad(name, given, f"{each}{allowed}" + (f", e.g. {example}" if example else ""),
                         becomes=f", {where} is {becomes} in FP32, the dtype the engine computes with")
                return False
        return True

    def number(self, d, name, default, *, integer=False, low=None, high=None, low_open=False, integral_float=False,
               fp32=False, example=None):
        """d[name]: an int (integer) or a finite number, >= low (> low: low_open) and <= high.
        high defaults to MAX_INT for an int, to FP32's largest number for fp32: a value the
        engine computes with in FP32 (Note [bounded values]). integral_float: 5e8 is an int."""
        present, v = self._take(d, name)
        if not present:
            return default
        if high is None:
            high = MAX_INT if integer else FP32_MAX if fp32 else None
        e_g = f" (e.g. {example})" if example else ""
        lo = "" if low is None else (f"> {low}" if low_open else f">= {low}") + e_g
        hi = "" if high is None else f"<= {BOUND_NAMES.get(high) or format(high, 'g')}"
        limits = " and ".join(x for x in (lo, hi) if x)
        given = v
        if integral_float and isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if isinstance(v, LongInteger):  # past every bound
            self.bad(name, given, limits)
            return default
        kind = int if integer else (int, float)
        wrong_type = isinstance(v, bool) or not isinstance(v, kind)
        if wrong_type or (isinstance(v, float) and not math.isfinite(v)):
            what = "an integer" if integer else "a finite number"
            self.bad(name, given, f"{what} {limits}".strip(), wrong_type)
            return default
        too_low = low is not None and (v <= low if low_open else v < low)
        if too_low or (high is not None and v > high):
            self.bad(name, given, limits)
            return default
        zero_ok = low is None or low < 0 or low == 0 and not low_open
        if fp32 and not self.fp32(name, v, zero_ok, example):
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
        for k in sorted(d, key=_key_name):
            self.problems.unknown.append((self.key(_key_name(k)), d[k], what))


def _real(v):
    """Whether v is an int or a finite float (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and math.isfinite(v)


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


def read_config_file(path, what="config file"):
    """The bytes of a config file (what: how messages name it), read once with limits: a
    regular file (links followed) of at most MAX_FILE_BYTES. Anything else (a directory,
    FIFO, device such as a link to /dev/zero, or a bigger file) is a ConfigError naming
    the path; nothing is read from it, and opening never blocks (O_NONBLOCK)."""
    name = os.fspath(path)
    real = os.path.realpath(name)
    via = f" (a link to {real!r})" if os.path.islink(name) else ""
    limit = f"a regular file of at most {MAX_FILE_BYTES >> 20} MiB (a config is a few KB)"
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError([f"{what} {name!r}{via}: {e.strerror}"]) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError([f"{what} {name!r}{via}: {file_kind(st.st_mode)}, not a regular file; allowed: {limit}: "
                           "give the path of the JSON file itself"])
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1) if st.st_size <= MAX_FILE_BYTES else b""
    if st.st_size > MAX_FILE_BYTES or len(raw) > MAX_FILE_BYTES:
        raise ConfigError([f"{what} {name!r}{via}: {max(st.st_size, len(raw))} bytes, more than "
                           f"{MAX_FILE_BYTES >> 20} MiB; allowed: {limit}: is it the right file?"])
    return raw


def _json_int(text):
    """An int, or a LongInteger for a literal past MAX_INT_DIGITS digits (Note [bounded values])."""
    return LongInteger(text) if len(text) > MAX_INT_DIGITS else int(text)


def read_json(path):
    """(the dict in a JSON file, its problems): a key given twice in one object is a
    problem (JSON would silently keep the last); a file read_config_file refuses, bad JSON
    or a non-object raises ConfigError naming the file."""
    name = os.fspath(path)
    twice = []

    def pairs(items):
        seen = {}
        for k, v in items:
            if k in seen:
                twice.append(k)
            seen[k] = v
        return seen

    raw = read_config_file(path)
    try:
        config = json.loads(raw.decode("utf-8"), object_pairs_hook=pairs, parse_int=_json_int)
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
    line = lambda k: f"{_key_name(k)}: given twice in one object of config file {name!r}; allowed: once (JSON keeps " \
                     "the last)"
    return config, at_most(twice, line, "keys given twice")


def read_config(path):
    """The dict in a JSON config file; a problem of the file itself (read_json's, a key
    given twice included) raises ConfigError."""
    config, problems = read_json(path)
    if problems:
        raise ConfigError(problems)
    return config


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
