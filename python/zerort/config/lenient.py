"""DeepSpeed's config semantics where it is lenient on purpose (docs/DEEPSPEED.md, "Where
DeepSpeed is lenient"): a key that DeepSpeed 0.19.8 accepts and then does nothing with in the
config it is in is accepted here too, left out of what zerort builds, and named with the
reason in Config.ignored, which rank 0 prints after its banner, one line a key
(zerort.monitoring.progress.announce):

    zerort: ignored zero_optimization.offload_param.device 'cpu': DeepSpeed offloads parameters
    at stage 3 only and does not read the key at stage 2; the parameters stay with the model

Three kinds (the DeepSpeed form only: zerort's own form keeps naming them as errors):
- keys that only some stages read (below_stage3): offload_param (and the legacy
  cpu_offload_param) below stage 3; offload_optimizer (cpu_offload) at stage 0; ZeRO++'s
  zero_quantized_weights, zero_quantized_gradients and zero_hpz_partition_size below stage 3;
- keys of the table (zerort.config.deepspeed_keys) of class (i), whose feature prints or
  reports and changes nothing in what trains (dump_state, the FLOPS profiler, W&B);
- (d) keys with ignored_below set, which stage 3 would need and the stages below never read
  (zero_quantized_nontrainable_weights, leaf_module).

An ignored tier does nothing: the parser resets it to its defaults, so check_tier, the
engine's options, the memory report and the estimator see no offload.
"""
from zerort.config.reader import show
from zerort.config.sections import OffloadOptimizer, OffloadParam


def ignore(problems, key, value, why):
    """Records key (a full key path) with the value it had as accepted and ignored."""
    problems.ignored.append(f"{key} {show(value)}: {why}")


def below_stage3(problems, c, written):
    """The DeepSpeed form's stage-bound keys at a stage that does not read them, on the Draft c
    (its stage read): each recorded as ignored and reset to zerort's default. written: for
    "optimizer" and "param", (key path, value) of the key that set the tier's device (the
    offload section's device, or the legacy cpu_offload / cpu_offload_param)."""
    stage = c.stage
    if stage < 3 and c.offload.param.device != "none":
        ignore(problems, *written["param"], f"DeepSpeed offloads parameters at stage 3 only and does not read the "
               f"key at stage {stage}; the parameters stay with the model")
        c.offload.param = OffloadParam()
    opt = c.offload.optimizer
    if stage == 0 and opt.device != "none":
        ignore(problems, *written["optimizer"], "DeepSpeed offloads optimizer states at stages 1-3 only (at stage 0 "
               "it only picks its CPU Adam, the same AdamW); the states stay with the model")
        c.offload.optimizer = OffloadOptimizer(ratio=opt.ratio)  # a ratio < 1 stays an error (DeepSpeed asserts)


def zero_plus_plus(problems, stage, key, value, on):
    """Whether ZeRO++'s key (zero_quantized_weights, zero_quantized_gradients,
    zero_hpz_partition_size) given with value takes effect: at stage 3; below it DeepSpeed
    passes it to no optimizer, so it is recorded as ignored (on: the value turns it on)."""
    if stage == 3 or not on:
        return stage == 3
    ignore(problems, f"zero_optimization.{key}", value, f"DeepSpeed passes it to its stage-3 optimizer only; at stage "
           f"{stage} {_UNCHANGED[key]}")
    return False


_UNCHANGED = {"zero_quantized_weights": "the parameters are gathered unquantized",
              "zero_quantized_gradients": "the gradients are reduced unquantized",
              "zero_hpz_partition_size": "there are no secondary shards"}
