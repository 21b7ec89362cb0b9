"""Random values for every numeric key of both config forms (issue 27): finite, subnormal,
huge and negative floats and ints, integers of thousands of digits, and values of other
types, lengths and nesting, given as a dict or as a JSON file.

Each example is either accepted by zerort.config.parse, with every value the engine
computes with in FP32 finite and normal (or 0) in FP32 and every integer within its bound,
or refused with a ConfigError whose every line names a key of the config; never another
exception. The inputs are bounded in size (a few keys, values of at most 6000 digits or a
few dozen items), so each parse is short; time is not asserted. test_config_limits.py
shows an accepted extreme config training with finite masters."""
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_config_validation import DEEPSPEED, OURS
from zerort.config import parse
from zerort.config.deepspeed_keys import TABLE
from zerort.config.schedule_params import PARAMS
from zerort.errors import ConfigError

FP32 = torch.finfo(torch.float32)
NUMBER_LISTS = ("optimizer.betas", "optimizer.params.betas", "zerort.optimizer.betas")


def numeric_keys(table):
    """The key paths whose good value in a test_config_validation table is a number (or a
    list of numbers: betas)."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    return sorted(p for p, (good, _) in table.items() if number(good) or p in NUMBER_LISTS)


OURS_KEYS = numeric_keys(OURS)
DEEPSPEED_KEYS = numeric_keys(DEEPSPEED) + sorted(p for p, k in TABLE.items() if k.cls == "a" and k.kind in
                                                  ((int, float), int))
SCHEDULE_KEYS = sorted({(kind, name) for kind, params in PARAMS.items() for name, (what, _) in params.items()
                        if what in ("int", "number", "numbers")})

EDGES = [0, 0.0, -0.0, -1, 1, FP32.tiny, 1.1754942e-38, 1e-45, 1e-46, 5e-324, float(FP32.max), 3.4028235e38,
         3.4028236e38, 1e39, 2 ** 31 - 1, 2 ** 31, 2 ** 40, 2 ** 40 + 1, 65536, 65537, 2 ** 62, 2 ** 63, 2 ** 64,
         math.nan, math.inf, -math.inf, 1e308, -1e308]
JUNK = st.recursive(st.none() | st.booleans() | st.text(max_size=30) | st.integers() | st.floats(),
                    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10), inner,
                                                                                max_size=6),
                    max_leaves=25)


def deep(n):
    """A list nested n levels deep."""
    v = []
    for _ in range(n):
        v = [v]
    return v


VALUES = st.one_of(
    st.sampled_from(EDGES),
    st.floats(),  # finite, subnormal (in float64 too), huge, negative, nan and inf
    st.floats(min_value=-1.2e-38, max_value=1.2e-38),  # around FP32's subnormals
    st.integers(min_value=-2 ** 70, max_value=2 ** 70),
    st.builds(lambda k, sign: sign * (10 ** k - 1), st.integers(1, 6000), st.sampled_from([1, -1])),  # long ints
    st.lists(st.floats() | st.integers(), max_size=4),  # a list where one number goes, or betas' two
    JUNK,
    st.integers(0, 80).map(deep),
)

class Literal(str):
    """The text of a JSON value, written into a config file as it is."""


LITERALS = st.one_of(  # for config files
    st.builds(lambda sign, n: sign + "1" + "0" * n, st.sampled_from(["", "-"]), st.integers(0, 6000)),
    st.builds(lambda m, e: f"{m}e{e}", st.integers(-99, 99), st.integers(-400, 400)),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e-46", "5e-324", "-0", "0.0", "[1e-46, 0.9]", "[0.9, 1e39]"]),
    VALUES.filter(lambda v: not (isinstance(v, int) and abs(v) > 10 ** 4000)).map(json.dumps),
).map(Literal)


def put(cfg, path, value):
    """cfg with value at the dotted path (sections on the way made, or replaced by one)."""
    d, parts = cfg, path.split(".")
    for p in parts[:-1]:
        if not isinstance(d.get(p), dict):
            d[p] = {}
        d = d[p]
    d[parts[-1]] = value


@st.composite
def configs(draw, literal=False):
    """(config dict, the key paths set in it). With literal, each value is the text of a
    JSON value, to be written into a file."""
    values = LITERALS if literal else VALUES
    deepspeed = draw(st.booleans())
    cfg = {"zero_optimization": {}} if deepspeed else {}
    paths = []
    for path in draw(st.lists(st.sampled_from(DEEPSPEED_KEYS if deepspeed else OURS_KEYS), min_size=1, max_size=4,
                              unique=True)):
        put(cfg, path, draw(values))
        paths.append(path)
    if draw(st.booleans()):  # a schedule, with some of its params
        kind, name = draw(st.sampled_from(SCHEDULE_KEYS))
        params = {n: 10 for n, (what, required) in PARAMS[kind].items() if required}  # good values
        params[name] = draw(values)
        put(cfg, "scheduler", {"type": kind, "params": params})
        paths.append(f"scheduler.params.{name}")
    if draw(st.integers(0, 4)) == 0:  # an unknown key of random nesting
        path = draw(st.sampled_from(["bogus", "optimizer.bogus", "stage3.bogus", "zerort.bogus", "fp16.bogus"]))
        put(cfg, path, draw(values if literal else JUNK))
        paths.append(path)
    return cfg, paths


def check(source, paths):
    """source (a dict or a file) is accepted with engine-ready values, or refused naming keys."""
    try:
        c = parse(source)
    except ConfigError as e:
        assert e.problems
        tops = {p.split(".")[0] for p in paths} | {"zero_optimization"}
        for line in e.problems:
            if line.startswith("and ") and "more" in line:  # the count of unlisted keys
                continue
            key = line.split(":")[0].split(" ")[0]
            if key == "config":  # nested too deep: the config (or its file) and the key it is under
                key = line.split(" under key ")[1].split(";")[0].strip("'")
            assert key.split(".")[0] in tops, (line, paths)
            if len(paths) == 1 and not key.startswith("zero_optimization."):
                assert key.startswith(paths[0]), (line, paths)
        return
    check_accepted(c)


def normal_fp32(v, zero_ok=True):
    """Whether FP32 holds the number v as a finite normal number (or as 0, when v is 0)."""
    v32 = torch.tensor(float(v), dtype=torch.float64).to(torch.float32).item()
    return math.isfinite(v32) and (v == 0 and zero_ok or abs(v32) >= FP32.tiny)


BOUNDS = {"stage": 3, "initial_scale_power": 60, "prefetch": 65536, "reduce_bucket_numel": 2 ** 40,
          "persistence_threshold": 2 ** 40, "prefetch_numel": 2 ** 40, "max_live_numel": 2 ** 40,
          "steps_per_print": 2 ** 62}


def field(c, path):
    """c's field at a dotted path: field(c, "optimizer.lr")."""
    for part in path.split("."):
        c = getattr(c, part)
    return c


def check_accepted(c):
    for name in ("optimizer.lr", "optimizer.weight_decay", "optimizer.gradient_clipping", "loss_scale.min_scale",
                 "loss_scale.static", *c.optimizer.betas):
        v = field(c, name) if isinstance(name, str) else name
        assert isinstance(v, (int, float)) and not isinstance(v, bool) and normal_fp32(v), (name, v)
    assert normal_fp32(c.optimizer.eps, zero_ok=False) and c.loss_scale.min_scale > 0
    for path in ("stage", "loss_scale.initial_scale_power", "loss_scale.window", "loss_scale.hysteresis",
                 "batch.gradient_accumulation_steps", "reduce_bucket_numel", "stage3.prefetch",
                 "stage3.persistence_threshold", "stage3.prefetch_numel", "stage3.max_live_numel",
                 "max_consecutive_skips", "batch.train_micro_batch_size_per_gpu", "batch.train_batch_size",
                 "monitor.steps_per_print"):
        name, v = path.rsplit(".", 1)[-1], field(c, path)
        assert v is None or type(v) is int and 0 <= v <= BOUNDS.get(name, 2 ** 31 - 1), (name, v)
    scheduler = c.optimizer.scheduler
    for name, v in (scheduler or {}).get("params", {}).items():
        what = PARAMS[scheduler["type"]][name][0]
        if what == "int":
            assert type(v) is int and -1 <= v <= 2 ** 31 - 1, (name, v)
        elif what in ("number", "numbers"):
            assert all(normal_fp32(x) for x in (v if isinstance(v, list) else [v])), (name, v)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_random_values_for_every_numeric_key_as_a_dict(case):
    cfg, paths = case
    check(cfg, paths)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(configs(literal=True))
def test_random_values_for_every_numeric_key_in_a_file(folder, case):
    cfg, paths = case
    literals = []

    def marked(v):  # each literal stands in the JSON as a mark, replaced after json.dumps
        if isinstance(v, dict):
            return {k: marked(x) for k, x in v.items()}
        if isinstance(v, Literal):
            literals.append(v)
            return f"@@{len(literals) - 1}@@"
        return v

    text = json.dumps(marked(cfg))
    for i, literal in enumerate(literals):
        text = text.replace(json.dumps(f"@@{i}@@"), literal)
    path = folder / "config.json"
    path.write_text(text)
    check(str(path), paths)
