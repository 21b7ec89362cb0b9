"""A DeepSpeed JSON config read into a zerort Config (zerort.config.parse calls this).

Every key is in zerort.config.deepspeed_keys' table with its class: (a) done, (b) mapped, (c)
implemented, (d) rejected unless off. The (b) and (c) keys, and the (a) keys whose value
zerort uses, are read here; the rest are checked from the table alone. zerort's own keys
sit under one "zerort" section. All problems of one config come in one ConfigError.
"""
import os

from zerort.config import lenient, offload
from zerort.config.deepspeed_keys import TABLE
from zerort.config.our_form import Draft, common, loss_scale, optimizer_params, runtime_keys, group_size
from zerort.config.reader import MAX_NUMEL, _Reader, show
from zerort.config.sections import Config, Optimizer

ADAM_TYPES = ("adam", "adamw")
WIRE_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
               "fp32": "fp32", "float32": "fp32", "float": "fp32"}


def parse_deepspeed(cfg, problems):
    c = Draft(Config(stage=0, optimizer=Optimizer(weight_decay=0.0)))  # DeepSpeed's defaults: no ZeRO, no decay
    r = _Reader(problems)
    c.batch.train_batch_size = r.number(cfg, "train_batch_size", None, integer=True, low=1, integral_float=True)
    # None when not given: resolve_batch derives it from train_batch_size at initialize.
    c.batch.gradient_accumulation_steps = r.number(cfg, "gradient_accumulation_steps", None, integer=True, low=1)
    common(r, cfg, c)
    _zero(r, cfg, c)
    aio, ra = offload.section(r, cfg, "aio")
    c.offload.aio = offload.read_aio(ra, aio)
    ra.leftover(aio, "unknown or unsupported DeepSpeed key")
    scale_keys = _precision(r, cfg, c)
    _autocast(r, cfg, c)
    _optimizer(r, cfg, c)
    _dtypes(r, cfg, c)
    c.monitor.csv, c.monitor.tensorboard = _monitor(r, cfg, "csv_monitor"), _monitor(r, cfg, "tensorboard")
    ours, ro = r.child(cfg, "zerort")
    runtime_keys(ro, ours, c)
    c.offload.placement = ro.choice(ours, "offload_placement", c.offload.placement, offload.PLACEMENTS)
    ro.leftover(ours, "unknown zerort key")
    _table(r, cfg, "", c.stage)
    r.leftover(cfg, "unknown or unsupported DeepSpeed key")
    return c.config(), scale_keys, "fp16.enabled"


def _monitor(r, cfg, name):
    """DeepSpeed's csv_monitor / tensorboard section: the folder output_path/job_name when
    enabled, else None."""
    section, rs = r.child(cfg, name)
    on = rs.boolean(section, "enabled", False)
    where = os.path.join(rs.text(section, "output_path", ""), rs.text(section, "job_name", "DeepSpeedJobName"))
    rs.leftover(section, "unknown or unsupported DeepSpeed key")
    return where if on else None


def _zero(r, cfg, c):
    if isinstance(cfg.get("zero_optimization"), bool):  # DeepSpeed's old form: true is stage 1
        cfg["zero_optimization"] = {"stage": int(cfg["zero_optimization"])}
    zero, rz = r.child(cfg, "zero_optimization")
    c.stage = rz.number(zero, "stage", c.stage, integer=True, low=0, high=3)
    # DeepSpeed configs often write sizes as 5e8: an integral float is an integer here.
    size = lambda key, default=None, low=1: rz.number(zero, key, default, integer=True, low=low, high=MAX_NUMEL,
                                                      integral_float=True)
    reduce, gather = size("reduce_bucket_size"), size("allgather_bucket_size")
    c.reduce_bucket_numel = reduce or gather or c.reduce_bucket_numel  # one bucket serves both
    c.stage3.prefetch_numel = size("stage3_prefetch_bucket_size", low=0)
    c.stage3.persistence_threshold = size("stage3_param_persistence_threshold", c.stage3.persistence_threshold, low=0)
    c.stage3.max_live_numel = size("stage3_max_live_parameters")
    c.shard_size = group_size(rz, zero, "mics_shard_size", c.shard_size, off=(-1, 0))
    hpz = group_size(rz, zero, "zero_hpz_partition_size", None, off=(1,))
    if lenient.zero_plus_plus(rz.problems, c.stage, "zero_hpz_partition_size", hpz, hpz is not None):
        c.stage3.secondary_shard_size = hpz
    for key, apply in (("zero_quantized_gradients", lambda: setattr(c.comm, "inter_node_dtype", "int8")),
                       ("zero_quantized_weights", lambda: setattr(c.stage3, "gather_dtype", "int8"))):
        on = rz.boolean(zero, key, False)
        if on and lenient.zero_plus_plus(rz.problems, c.stage, key, on, on):
            apply()
    lenient.below_stage3(rz.problems, c, _offload(rz, zero, c))
    _table(rz, zero, "zero_optimization.", c.stage)
    rz.leftover(zero, "unknown or unsupported DeepSpeed key")


def _offload(rz, zero, c):
    """offload_optimizer and offload_param (zerort.config.offload), and DeepSpeed's legacy keys
    that set their device: true is {"device": "cpu"}; given with the new key, an error (as in
    DeepSpeed). Returns, for "optimizer" and "param", the key path and value that set the
    device (for zerort.config.lenient.below_stage3)."""
    written = {}
    for name, field, read, legacy in (("offload_optimizer", "optimizer", offload.read_optimizer, "cpu_offload"),
                                      ("offload_param", "param", offload.read_param, "cpu_offload_param")):
        if name in zero and legacy in zero:
            rz.problems.lines.append(f"{rz.key(legacy)}: given with {rz.key(name)}, which replaces it; keep only "
                                     f"{rz.key(name)}")
        d, rd = offload.section(rz, zero, name)
        setattr(c.offload, field, read(rd, d))
        written[field] = (rd.key("device"), getattr(c.offload, field).device)
        _table(rd, d, f"zero_optimization.{name}.")
        rd.leftover(d, "unknown or unsupported DeepSpeed key")
        if rz.boolean(zero, legacy, False):
            setattr(c.offload, field, offload.with_device(getattr(c.offload, field), "cpu"))
            written[field] = (rz.key(legacy), True)
    return written


def _precision(r, cfg, c):
    if "bfloat16" in cfg and "bf16" in cfg:
        r.problems.lines.append("bfloat16: given with bf16, its newer name; keep only bf16")
    name = "bfloat16" if "bfloat16" in cfg and "bf16" not in cfg else "bf16"
    bf16, rb = r.child(cfg, name)
    bf16_on = rb.boolean(bf16, "enabled", False)
    if rb.boolean(bf16, "bf16_optimizer_states", False):
        c.optimizer.state_dtype = "bf16"
    if rb.boolean(bf16, "bf16_master_weights_and_grads", False):
        c.optimizer.master_dtype = "bf16"
    _table(rb, bf16, "bf16.")
    rb.leftover(bf16, "unknown or unsupported DeepSpeed key")
    fp16, rf = r.child(cfg, "fp16")
    fp16_on = rf.boolean(fp16, "enabled", False)
    scale_keys = loss_scale(rf, fp16, c, window_key="loss_scale_window", min_key="min_loss_scale")
    c.loss_scale.static = rf.number(fp16, "loss_scale", 0.0, low=0, fp32=True)  # 0: dynamic
    _table(rf, fp16, "fp16.")
    rf.leftover(fp16, "unknown or unsupported DeepSpeed key")
    if bf16_on and fp16_on:
        r.problems.lines.append(f"{name}.enabled and fp16.enabled: both true; allowed: enable at most one")
    c.precision = "bf16" if bf16_on else "fp16" if fp16_on else "fp32"
    return scale_keys


# DeepSpeed's torch_autocast.dtype spellings (its DtypeEnum): the bf16 ones zerort autocasts to, and
# the others, which DeepSpeed takes too (an error here only when the section is enabled).
AUTOCAST_BF16 = ("bf16", "bfloat16", "torch.bfloat16")
AUTOCAST_OTHER = ("fp16", "float16", "half", "torch.float16", "fp32", "float32", "float", "torch.float32", "int8",
                  "torch.int8")


def _autocast(r, cfg, c):
    """DeepSpeed's torch_autocast section: torch.autocast around the forward, bf16 only (see
    docs/DEEPSPEED.md). lower_precision_safe_modules names the modules whose gradients DeepSpeed
    sends in the autocast dtype; zerort sends every gradient in the compute dtype (FP32 with
    bf16/fp16 off) and sums in FP32, so the list is only checked."""
    section, rs = r.child(cfg, "torch_autocast")
    on = rs.boolean(section, "enabled", False)
    present, dtype = rs._take(section, "dtype")
    rs.names(section, "lower_precision_safe_modules", ())
    _table(rs, section, "torch_autocast.")
    rs.leftover(section, "unknown or unsupported DeepSpeed key")
    if present and dtype not in AUTOCAST_BF16 and (on or dtype not in AUTOCAST_OTHER):
        rs.bad("dtype", dtype, " | ".join(repr(d) for d in AUTOCAST_BF16) + " (zerort autocasts to bf16 only; for "
               "fp16 compute use fp16.enabled, which has the dynamic loss scale fp16 needs)",
               not isinstance(dtype, str))
        return
    if not on:
        return
    if c.precision == "fp16":
        r.problems.lines.append("torch_autocast.enabled and fp16.enabled: both true; zerort autocasts to bf16 and "
                                "would mix it with fp16 parameters: enable one of them")
        return
    c.autocast = "bf16" if present else "device"


def _optimizer(r, cfg, c):
    opt, ro = r.child(cfg, "optimizer")
    present, kind = ro._take(opt, "type")
    if present and not (isinstance(kind, str) and kind.lower() in ADAM_TYPES):
        ro.bad("type", kind, "'Adam' or 'AdamW' (any case): zerort runs its own fused AdamW; other optimizers "
               "are not supported")
    params, rp = ro.child(opt, "params")
    optimizer_params(rp, params, c)
    adam_w = rp.boolean(params, "adam_w_mode", True)
    rp.boolean(params, "torch_adam", False)  # either way: torch.optim.AdamW's math
    decay = c.optimizer.weight_decay
    if present and isinstance(kind, str) and kind.lower() == "adam" and not adam_w and decay:
        r.problems.lines.append(f"{rp.key('adam_w_mode')}: false with weight_decay {decay:g} asks for Adam's "
                                "L2 weight decay (added to the gradient); zerort's AdamW decays the weights "
                                "directly: set adam_w_mode to true (AdamW), or weight_decay to 0")
    _table(rp, params, "optimizer.params.")
    if present and not (isinstance(kind, str) and kind.lower() in ADAM_TYPES):
        params.clear()  # another optimizer's parameters: its type is the one problem to name
    rp.leftover(params, "unknown or unsupported optimizer parameter")
    _table(ro, opt, "optimizer.")
    ro.leftover(opt, "unknown or unsupported DeepSpeed key")


def _dtypes(r, cfg, c):
    """communication_data_type and data_types.grad_accum_dtype: what zerort does, or an error."""
    present, wire = r._take(cfg, "communication_data_type")
    compute = c.precision
    if present and wire is not None and WIRE_DTYPES.get(wire) != compute:
        r.bad("communication_data_type", wire, f"{compute!r} (or null): zerort sends gradients in the compute "
              "dtype and sums them in FP32; another wire dtype is not supported")
    types, rt = r.child(cfg, "data_types")
    present, accum = rt._take(types, "grad_accum_dtype")
    if present and accum is not None:
        # Stages 2-3 accumulate micro-steps into the FP32 gradient shard; stages 0-1 in the
        # flat gradient buffer, which holds the compute dtype.
        held = "fp32" if c.stage >= 2 else compute
        if WIRE_DTYPES.get(accum) != held:
            rt.bad("grad_accum_dtype", accum, f"{held!r} at stage {c.stage} (zerort accumulates gradients in "
                   f"{'the FP32 gradient shard' if c.stage >= 2 else 'the compute dtype'}), or null")
    _table(rt, types, "data_types.")
    rt.leftover(types, "unknown or unsupported DeepSpeed key")


def _table(r, d, prefix, stage=0):
    """The keys of d that the table alone decides: (a) accepted (type-checked), (d)
    accepted only off (or, below a key's ignored_below stage, ignored), (i) accepted and,
    when on, ignored (zerort.config.lenient); a section whose keys are in the table is
    walked. stage: the config's ZeRO stage."""
    for k in sorted((k for k in d if isinstance(k, str)), key=str):
        path = prefix + k
        key = TABLE.get(path)
        if key is None:
            if isinstance(d[k], dict) and any(p.startswith(path + ".") for p in TABLE):
                section, rs = r.child(d, k)
                _table(rs, section, path + ".", stage)
                rs.leftover(section, "unknown or unsupported DeepSpeed key")
            continue
        if key.cls not in "adi":
            continue  # read by the functions above
        present, v = r._take(d, k)
        if key.cls in "di" and not key.off(v) and (key.cls == "i" or stage < (key.ignored_below or 0)):
            if key.kind is None or isinstance(v, key.kind):
                lenient.ignore(r.problems, path, v, key.note if key.cls == "i" else key.ignored_why.format(stage=stage))
            else:
                r.bad(k, v, f"a JSON {_json_kind(key.kind)} (zerort accepts and ignores the key: {key.note})", True)
        elif key.cls == "d" and not key.off(v):
            r.problems.lines.append(f"{path}: got {show(v)}; zerort does not support {key.note}: remove the key or set "
                                    f"it to {key.off_text}")
        elif key.cls == "a" and key.kind is not None and v is not None:
            numeric = key.kind in ((int, float), int)
            if not isinstance(v, key.kind) or numeric and isinstance(v, bool):
                r.bad(k, v, f"a JSON {_json_kind(key.kind)} (zerort accepts the key: {key.note})", True)


def _json_kind(kind):
    return {bool: "bool", int: "integer", str: "string", dict: "object"}.get(kind, "number")
