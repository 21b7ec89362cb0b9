"""zerort.integrations.hf's config: "auto" values filled from TrainingArguments and the model, as
HuggingFace fills them for DeepSpeed (its HfTrainerDeepSpeedConfig and accelerate's
DeepSpeedPlugin), in either of zerort's two config forms.

A key tied to a TrainingArguments value is filled when it is "auto" and must equal that
value when it is given (one ValueError lists every mismatch). The batch keys, clipping and
precision also follow the arguments when they are absent: a Trainer user's
max_grad_norm, accumulation and --bf16 act as they do with the stock Trainer. Keys tied to
the model's hidden size, and the stage, are only filled. The scheduler's step counts are
filled once the Trainer knows its number of training steps (`scheduler_spec`).
"""
import copy
import os

from zerort.config import is_deepspeed_form, parse
from zerort.errors import ConfigError

AUTO = "auto"
DEFAULT_STAGE = 2  # accelerate's default when ACCELERATE_DEEPSPEED_ZERO_STAGE is not set


def _node(cfg, dotted):
    """(the section that holds the dotted key, its last name); (None, name) when a section
    on the way is missing."""
    *parents, leaf = dotted.split(".")
    for p in parents:
        cfg = cfg.get(p)
        if not isinstance(cfg, dict):
            return None, leaf
    return cfg, leaf


def _auto(v):
    return isinstance(v, str) and v == AUTO


def _same(a, b):
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class _Filler:
    def __init__(self, cfg):
        self.cfg, self.mismatches = cfg, []

    def match(self, key, value, arg, absent=False):
        """Fill key when "auto" (and when absent, if absent); else it must equal value."""
        node, leaf = _node(self.cfg, key)
        if node is None:
            return
        if leaf not in node:
            if absent:
                node[leaf] = value
        elif _auto(node[leaf]):
            node[leaf] = value
        elif not _same(node[leaf], value):
            self.mismatches.append(f"- {key}: {node[leaf]!r}, but TrainingArguments {arg} gives {value!r}")

    def only(self, key, value):
        """Fill key when "auto"; a given value stays."""
        node, leaf = _node(self.cfg, key)
        if node is not None and _auto(node.get(leaf)):
            node[leaf] = value

    def is_auto(self, key):
        node, leaf = _node(self.cfg, key)
        return node is not None and _auto(node.get(leaf))

    def finish(self):
        if self.mismatches:
            raise ConfigError(["zerort.integrations.hf: zerort_config values that disagree with the "
                               "TrainingArguments (make them equal, or write \"auto\"):", *self.mismatches])
        return self.cfg


def hidden_size(model):
    """The model's hidden size (its config's hidden_size, the largest of hidden_sizes, or
    its text_config's), or None."""
    c = getattr(model, "config", None)
    for cc in (c, getattr(c, "text_config", None)):
        if cc is None:
            continue
        if getattr(cc, "hidden_size", None):
            return cc.hidden_size
        if getattr(cc, "hidden_sizes", None):
            return max(cc.hidden_sizes)
    return None


def _precision(args):
    """The Trainer's precision: --bf16 / --fp16, or accelerate launch --mixed_precision
    (TrainingArguments.mixed_precision holds both)."""
    mixed = getattr(args, "mixed_precision", "no")
    return mixed if mixed in ("bf16", "fp16") else "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


# (DeepSpeed form, our form) key paths of the values that follow the model's hidden size h
_BY_HIDDEN = (("zero_optimization.reduce_bucket_size", "reduce_bucket_numel", lambda h: h * h),
              ("zero_optimization.stage3_prefetch_bucket_size", None, lambda h: int(0.9 * h * h)),
              ("zero_optimization.stage3_param_persistence_threshold", "stage3.persistence_threshold",
               lambda h: 10 * h))


def fill(raw, args, model):
    """(config dict with its "auto" values filled, whether it is in DeepSpeed's form). The
    scheduler section keeps its step counts for scheduler_spec."""
    cfg = copy.deepcopy(raw)
    ds = is_deepspeed_form(cfg)
    f = _Filler(cfg)
    gas, micro = args.gradient_accumulation_steps, args.per_device_train_batch_size
    f.match("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", absent=True)
    f.match("gradient_accumulation_steps", gas, "gradient_accumulation_steps", absent=True)
    f.match("train_batch_size", args.world_size * micro * gas,
            "world_size x per_device_train_batch_size x gradient_accumulation_steps")
    f.match("gradient_clipping", args.max_grad_norm, "max_grad_norm", absent=True)
    opt = "optimizer.params." if ds else "optimizer."
    f.match(opt + "lr", args.learning_rate, "learning_rate")
    f.match(opt + "betas", [args.adam_beta1, args.adam_beta2], "adam_beta1, adam_beta2")
    f.match(opt + "eps", args.adam_epsilon, "adam_epsilon")
    f.match(opt + "weight_decay", args.weight_decay, "weight_decay")
    f.only("scheduler.params.warmup_min_lr", 0)
    f.match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    precision = _precision(args)
    if ds:
        for half in ("fp16", "bf16"):
            section = "bfloat16" if half == "bf16" and "bfloat16" in cfg else half
            if section in cfg:
                f.match(f"{section}.enabled", precision == half, f"{half} (or mixed_precision)")
            elif precision == half:  # as accelerate's DeepSpeedPlugin: a missing section follows the args
                cfg[half] = {"enabled": True}
    else:
        f.match("precision", precision, "bf16 / fp16 / mixed_precision (none: 'fp32')", absent=True)
    stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", DEFAULT_STAGE))
    f.only("zero_optimization.stage" if ds else "stage", stage)
    if ds:
        f.only("zero_optimization.stage3_gather_16bit_weights_on_model_save", False)
    by_hidden = {(ds_key if ds else our_key): value for ds_key, our_key, value in _BY_HIDDEN
                 if (ds_key if ds else our_key)}  # this form's keys
    if any(f.is_auto(k) for k in by_hidden):
        h = hidden_size(model)
        if h is None:
            raise ConfigError([f"zerort.integrations.hf: zerort_config has \"auto\" in {list(by_hidden)}, which "
                               "follow the model's hidden size, and the model's config has no hidden_size; give "
                               "numbers"])
        for key, value in by_hidden.items():
            f.only(key, value(h))
    return f.finish(), ds


def scheduler_spec(section, args, num_training_steps):
    """The config's scheduler section, its "auto" step counts filled from the Trainer's
    num_training_steps, parsed: {"type", "params"} for zerort.engine.lr_schedules.build."""
    f = _Filler({"scheduler": copy.deepcopy(section)})
    f.match("scheduler.params.total_num_steps", num_training_steps, "max_steps (the number of training steps)")
    f.match("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
            "warmup_steps")
    return parse(f.finish(), form="deepspeed").optimizer.scheduler
