"""parse(), which tells our config form (zerort.config.our_form) and DeepSpeed's
(zerort.config.deepspeed_form) apart and reads a config with the right one. How values are
checked and problems collected: zerort.config.reader.
"""
import dataclasses
import functools
import os

from zerort.config import offload
from zerort.config.files import read_json
from zerort.config.our_form import _parse_ours
from zerort.config.reader import MAX_AUTOS_LISTED, _depth_problem, _key_name, _kind, _Problems, at_most
from zerort.config.sections import Config
from zerort.errors import ConfigError

DEEPSPEED_MARKERS = {"zero_optimization", "bf16", "bfloat16", "fp16", "train_batch_size", "zerort"}


def _cross_key_rules(c, problems, scale_keys, precision_key):
    """Rules that join several keys; run once every key has been read."""
    power_key, min_key = scale_keys
    s, b = c.loss_scale, c.batch
    if c.precision == "fp16" and not s.static and s.min_scale > 2.0 ** s.initial_scale_power:
        problems.lines.append(f"{min_key}: got {s.min_scale!r}, above the initial loss scale "
                              f"2**{power_key} = {2.0 ** s.initial_scale_power:g} ({precision_key} on); "
                              f"allowed: <= {2.0 ** s.initial_scale_power:g}: lower {min_key} or raise {power_key}")
    _bf16_master_rule(c, problems, precision_key)
    micro, total, gas = b.train_micro_batch_size_per_gpu, b.train_batch_size, b.gradient_accumulation_steps
    if c.optimizer.scheduler is not None and c.optimizer.lr_schedule is not None:
        problems.lines.append("scheduler and lr_schedule: both given; allowed: one of them (each sets the lr)")
    if micro is not None and total is not None and gas is not None and total % (micro * gas):
        problems.lines.append(f"train_batch_size: got {total}; allowed: a multiple of train_micro_batch_size_per_gpu "
                              f"({micro}) x gradient_accumulation_steps ({gas}) = {micro * gas} "
                              "(it equals that product times the world size)")


def _bf16_master_rule(c, problems, precision_key):
    """A bf16 master (runtime/bf16_state_store.h) needs bf16 compute, stages 1-3 (as DeepSpeed) and
    the optimizer state in memory: no NVMe tier."""
    if c.optimizer.master_dtype != "bf16":
        return
    ours = precision_key == "precision"
    key = "optimizer.master_dtype" if ours else "bf16.bf16_master_weights_and_grads"
    stage_key, tier_key = ("stage", "offload.optimizer.device") if ours else \
        ("zero_optimization.stage", "zero_optimization.offload_optimizer.device")
    if c.precision != "bf16":
        problems.lines.append(f"{key}: a bf16 master needs bf16 compute, got precision {c.precision}; set "
                              f"{'precision bf16' if ours else 'bf16.enabled true'} or drop {key}")
    if c.stage not in (1, 2, 3):
        problems.lines.append(f"{key}: works at stages 1-3 only (as DeepSpeed), got {stage_key} {c.stage}; set "
                              f"{stage_key} to 1, 2 or 3 or drop {key}")
    if c.offload.optimizer.device == "nvme":
        problems.lines.append(f"{key}: the NVMe tier keeps an FP32 master; got {tier_key} 'nvme': set it to 'none' "
                              f"(the bf16 master already saves 4 bytes per element) or drop {key}")


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
    ours = precision_key == "precision"
    offload.rules(c, problems, ("offload.optimizer", "offload.param", "stage") if ours else
                  ("zero_optimization.offload_optimizer", "zero_optimization.offload_param", "zero_optimization.stage"))
    lines = problems.finish()
    if lines:
        raise ConfigError(lines)
    return dataclasses.replace(c, ignored=tuple(problems.ignored)) if problems.ignored else c


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
