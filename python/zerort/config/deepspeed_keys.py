"""Every DeepSpeed config key zerort knows, with its class, for zerort.config.deepspeed_form.

    (a) done: zerort already does what the key asks; accepted.
    (b) mapped: read into zerort's equivalent setting.
    (c) implemented: zerort does what DeepSpeed does with it.
    (d) rejected unless off: zerort does not support the feature; the key is accepted
        only with the value that leaves the feature off, and otherwise is an error naming it
        (below the stage ignored_below, where DeepSpeed never reads it, it is ignored instead).
    (i) ignored: DeepSpeed accepts the key and its feature changes nothing in what trains (it
        prints or reports); accepted with any value, and when on named as ignored in rank 0's
        banner (zerort.config.lenient; docs/DEEPSPEED.md, "Where DeepSpeed is lenient").

Keys of classes (b) and (c), and the (a) keys whose value zerort uses, are read by
zerort.config.deepspeed_form; the rest are checked from this table alone. docs/CONFIG.md's key table
is printed from it: python -m zerort.config.deepspeed_keys.
"""
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Key:
    path: str
    cls: str  # "a", "b", "c" or "d"
    note: str
    off: Optional[Callable] = None  # (d): the value is accepted when off(value) is true
    off_text: str = ""  # (d): the accepted value, for the message
    kind: Optional[type] = None  # (a), (i) read from the table only: the JSON type its value must have
    ignored_below: Optional[int] = None  # (d): below this ZeRO stage, DeepSpeed does not read the key: ignored
    ignored_why: str = ""  # (d) with ignored_below: the banner's reason ({stage}: the config's stage)


def _falsy(v):
    return v in (False, None, 0, "", [], {}, "none")


def _disabled(v):
    return isinstance(v, dict) and not v.get("enabled", False)


def _empty(v):
    return v in (None, {}, [], False)


FALSY, DISABLED, EMPTY = (_falsy, "false (or leave the key out)"), (_disabled, '{"enabled": false}'), \
    (_empty, "nothing (leave the section out)")
NULL = (lambda v: v is None, "null (or leave the key out)")


def a(path, note, kind=None):
    return Key(path, "a", note, kind=kind)


def b(path, note):
    return Key(path, "b", note)


def c(path, note):
    return Key(path, "c", note)


def d(path, note, off=FALSY, ignored_below=None, ignored_why=""):
    return Key(path, "d", note, off[0], off[1], ignored_below=ignored_below, ignored_why=ignored_why)


def i(path, note, off=FALSY, kind=None):
    """An (i) key: note says what DeepSpeed does with it and why zerort may ignore it."""
    return Key(path, "i", note, off[0], off[1], kind=kind)


def _only(*values):
    return (lambda v: v in values, " or ".join(repr(x) for x in values))


BOOL, NUM = bool, (int, float)

# offload_param's keys that size DeepSpeed's parameter swap buffers.
PARAM_SWAP_BUFFERS = ("sizes DeepSpeed's swap buffers and changes nothing here (zerort's parameter file stages "
                      "through two buffers of the largest unit's shard)")

KEYS = [
    # ---- batch and training loop ----
    a("train_batch_size", "the same; with the micro batch it sets gradient_accumulation_steps"),
    a("train_micro_batch_size_per_gpu", "the same"),
    a("gradient_accumulation_steps", "the same"),
    a("gradient_clipping", "the same: the global L2 norm, 0 off (zerort's default is 0)"),
    d("managed_gradient_accumulation", "a caller-managed accumulation boundary (false)", _only(True)),
    c("steps_per_print", "prints DeepSpeed's step/skipped/lr/mom line every N updates on rank 0"),
    c("wall_clock_breakdown", "prints DeepSpeed's fwd/bwd/bwd_inner/bwd_allreduce/step timings (ms) on rank 0"),
    c("dataloader_drop_last",
      "the training_data loader of zerort.integrations.deepspeed.initialize drops the last batch"),
    a("prescale_gradients", "either way: zerort sums gradients in FP32 and divides once", kind=BOOL),
    a("gradient_predivide_factor", "any: zerort sums in FP32 and divides by the world size once", kind=NUM),
    a("zero_allow_untested_optimizer", "zerort runs its own fused AdamW", kind=BOOL),
    a("zero_force_ds_cpu_optimizer", "zerort's fused AdamW runs wherever the states are", kind=BOOL),
    a("vocabulary_size", "a hint DeepSpeed only warns about", kind=int),
    a("disable_allgather", "no effect in DeepSpeed either", kind=BOOL),
    a("log_level", "zerort prints only what steps_per_print and wall_clock_breakdown ask", kind=str),
    a("seq_parallel_communication_data_type", "zerort has no sequence parallelism", kind=str),
    a("timers", "no throughput timer line; the step timings come with wall_clock_breakdown", kind=dict),
    d("gradient_allreduce_op", "a sum instead of the mean of gradients", _only("mean")),
    b("communication_data_type", "the wire dtype of gradient reduces: the compute dtype (summed in FP32); "
      "another dtype is an error"),
    d("sparse_gradients", "sparse embedding gradients"),
    i("dump_state", "DeepSpeed prints the engine's settings at initialize; printing only (zerort's banner says "
      "what runs where)"),
    i("memory_breakdown", "DeepSpeed prints memory use around each forward, backward and step; printing only "
      "(engine.memory_report() has zerort's)"),
    d("graph_harvesting", "CUDA graph capture"),
    i("use_data_before_expert_parallelism", "DeepSpeed reads it for MoE layers only, and zerort has none; "
      "nothing else changes"),
    # ---- optimizer and scheduler ----
    b("optimizer.type", "Adam and AdamW (any case) run zerort's fused AdamW; other types are an error"),
    a("optimizer.params.lr", "the same (param groups may override it)"),
    a("optimizer.params.betas", "the same"),
    a("optimizer.params.eps", "the same"),
    a("optimizer.params.weight_decay", "the same, decoupled (AdamW)"),
    b("optimizer.params.adam_w_mode", "true: AdamW; false with weight_decay 0: the same update; false with "
      "weight decay (Adam's L2 decay) is an error"),
    b("optimizer.params.torch_adam", "either way: zerort's fused kernel does torch.optim.AdamW's math"),
    i("optimizer.params.fp32_optimizer_states", "DeepSpeed reads it for its CPU Adam only, which then keeps the "
      "moments in the master's dtype: FP32, as zerort keeps them (bf16.bf16_optimizer_states makes them bf16)",
      (lambda v: v is None or v is True, "true"), kind=BOOL),
    b("optimizer.params.bias_correction", "the same: false runs the update on the uncorrected moments"),
    d("optimizer.params.amsgrad", "AMSGrad"),
    d("optimizer.params.max_grad_norm", "an optimizer-side clip: use the top-level gradient_clipping",
      NULL),
    a("optimizer.legacy_fusion", "no effect", kind=BOOL),
    c("scheduler.type", "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest (zerort.engine.lr_schedules)"),
    c("scheduler.params", "each schedule's parameters, DeepSpeed's formulas, stepped after every applied update"),
    # ---- precision ----
    a("bf16.enabled", "the same: bf16 compute, FP32 master"),
    b("bfloat16", "DeepSpeed's old name for the bf16 section"),
    a("bf16.immediate_grad_update", "gradients go to the FP32 shard as buckets complete", kind=BOOL),
    a("bf16.check_grad_overflow", "zerort always checks and skips a non-finite step", kind=BOOL),
    b("bf16.bf16_master_weights_and_grads", "optimizer.master_dtype bf16: the master and the gradient shard "
      "in bf16 (4 bytes less per element of this rank's shard), summed and stepped in FP32 and rounded once "
      "per store; stages 1-3, the state in memory (docs/DEEPSPEED.md#bf16bf16_master_weights_and_grads)"),
    b("bf16.bf16_optimizer_states", "optimizer.state_dtype bf16: Adam's m and v kept in bf16 (4 bytes less per "
      "element of this rank's shard); DeepSpeed takes it only with bf16_master_weights_and_grads, zerort "
      "alone too (then the FP32 master stays)"),
    a("fp16.enabled", "the same: fp16 compute, FP32 master, loss scaling"),
    b("fp16.loss_scale", "0: the dynamic scale; > 0: that fixed scale"),
    a("fp16.initial_scale_power", "the same"),
    a("fp16.loss_scale_window", "the same"),
    a("fp16.hysteresis", "the same"),
    a("fp16.consecutive_hysteresis", "the same"),
    a("fp16.min_loss_scale", "the same"),
    a("fp16.auto_cast", "true or false: zerort casts floating inputs to the compute dtype itself (with false, "
      "inputs already in fp16 pass as they are)", kind=BOOL),
    d("fp16.fp16_master_weights_and_grads", "an fp16 master"),
    d("amp", "Apex AMP", DISABLED),
    c("torch_autocast.enabled", "torch.autocast around the forward, as DeepSpeed: FP32 parameters when bf16 and "
      "fp16 are off, bf16 only (config autocast)"),
    c("torch_autocast.dtype", "bfloat16 (any of DeepSpeed's spellings); left out: torch's default for the device, "
      "bf16 on the CPU (a CUDA model must set bfloat16); fp16 is an error naming fp16.enabled"),
    c("torch_autocast.lower_precision_safe_modules", "checked, no effect: zerort sends every gradient in the "
      "compute dtype and sums in FP32"),
    b("data_types.grad_accum_dtype", "fp32 at stages 2-3 (the FP32 gradient shard), the compute dtype at "
      "stages 0-1; another dtype is an error"),
    d("data_types.param_dtype", "a parameter dtype beside bf16.enabled/fp16.enabled", NULL),
    d("data_types.buffer_dtype", "a buffer dtype: zerort.layout.precision decides", NULL),
    # ---- ZeRO ----
    a("zero_optimization.stage", "the same: 0, 1, 2, 3"),
    a("zero_optimization.overlap_comm", "zerort always overlaps reduces with backward (its comm thread)", kind=BOOL),
    a("zero_optimization.contiguous_gradients", "gradients always land in flat buffers", kind=BOOL),
    a("zero_optimization.reduce_scatter", "either way: each rank receives its shard summed in FP32", kind=BOOL),
    a("zero_optimization.allgather_partitions", "either way: the updated shards are all-gathered", kind=BOOL),
    a("zero_optimization.round_robin_gradients", "shards are balanced per bucket already", kind=BOOL),
    a("zero_optimization.use_multi_rank_bucket_allreduce", "no effect: no all-reduce of buckets", kind=BOOL),
    d("zero_optimization.load_from_fp32_weights", "restoring the master from the 16-bit weights (false): checkpoints "
      "restore the FP32 master", _only(True)),
    a("zero_optimization.elastic_checkpoint", "checkpoints load at any world size", kind=BOOL),
    a("zero_optimization.sub_group_size", "the optimizer runs over the shard in one pass", kind=NUM),
    a("zero_optimization.ignore_unused_parameters", "unused parameters get zero gradients", kind=BOOL),
    a("zero_optimization.memory_efficient_linear", "no effect on memory: autograd saves what it needs", kind=BOOL),
    a("zero_optimization.stage3_gather_16bit_weights_on_model_save", "save_16bit_model always gathers", kind=BOOL),
    a("zero_optimization.gather_16bit_weights_on_model_save", "save_16bit_model always gathers", kind=BOOL),
    a("zero_optimization.stage3_gather_fp16_weights_on_model_save", "save_16bit_model always gathers", kind=BOOL),
    a("zero_optimization.stage3_max_reuse_distance", "a hint: zerort releases a unit after each use", kind=NUM),
    a("zero_optimization.stage3_model_persistence_threshold", "a hint: persistence is decided per parameter",
      kind=NUM),
    a("zero_optimization.stage3_module_granularity_threshold", "a hint: units are modules already", kind=NUM),
    a("zero_optimization.stage3_use_all_reduce_for_fetch_params", "either way: units are all-gathered", kind=BOOL),
    a("zero_optimization.stage3_allgather_sequential", "either way", kind=BOOL),
    a("zero_optimization.override_module_apply", "no effect", kind=BOOL),
    a("zero_optimization.log_trace_cache_warnings", "no trace cache", kind=BOOL),
    a("zero_optimization.enable_sanity_checks", "the step's decision checks every rank's collectives", kind=BOOL),
    a("zero_optimization.save_muon_momentum_buffer_in_memory", "no Muon optimizer", kind=BOOL),
    a("zero_optimization.cpu_offload_use_pin_memory", "DeepSpeed's legacy key, which sets nothing there either: "
      "use offload_optimizer.pin_memory", kind=BOOL),
    b("zero_optimization.reduce_bucket_size", "reduce_bucket_numel: elements per gradient bucket"),
    b("zero_optimization.allgather_bucket_size", "reduce_bucket_numel when reduce_bucket_size is not given: "
      "zerort's buckets serve the reduce and the gather"),
    b("zero_optimization.stage3_prefetch_bucket_size", "stage3.prefetch: as many units ahead as fit in it (not "
      "given: zerort's 1 unit, not DeepSpeed's 5e7 elements)"),
    b("zero_optimization.stage3_param_persistence_threshold", "stage3.persistence_threshold (not given: zerort's 0, "
      "not DeepSpeed's 1e5)"),
    b("zero_optimization.stage3_max_live_parameters", "caps stage3.prefetch: the unit running and those gathered "
      "ahead hold at most this many elements (not given: no cap)"),
    # ---- offload (zerort.config.offload; See Note [offload tiers]) ----
    b("zero_optimization.offload_optimizer.device", "offload.optimizer.device (at stage 0 ignored, as in DeepSpeed, "
      "and named in the banner): 'none'; 'cpu' for a CPU model (its "
      "states are in host memory already; the log and memory report say so), for a CUDA model at stages 1-3 "
      "(master, m, v and the FP32 gradient in host memory, the step on the CPU); 'nvme' at stages 1-3 (master and "
      "Adam moments in one file per rank under nvme_path; a CUDA model's through the 'cpu' tier's copies). A CUDA "
      "model's tiers are built and tested on CPU buffers, not yet run on a GPU"),
    b("zero_optimization.offload_optimizer.nvme_path", "offload.optimizer.nvme_path (a string or null); "
      "device 'nvme' needs it"),
    b("zero_optimization.offload_optimizer.pin_memory", "offload.optimizer.pin_memory (default true)"),
    b("zero_optimization.offload_optimizer.buffer_count", "offload.optimizer.buffer_count: the NVMe tier's pool of "
      "chunk buffers (>= 1 with 'nvme', default 4)"),
    b("zero_optimization.offload_optimizer.pipeline_read", "offload.optimizer.pipeline_read (default false); either "
      "way the NVMe step reads ahead while it computes"),
    b("zero_optimization.offload_optimizer.pipeline_write", "offload.optimizer.pipeline_write (default false); "
      "either way the NVMe step writes behind while it computes"),
    b("zero_optimization.offload_optimizer.fast_init", "offload.optimizer.fast_init (default false)"),
    b("zero_optimization.offload_optimizer.ratio", "offload.optimizer.ratio (0 to 1, default 1; below 1 at stage 3 "
      "only, as in DeepSpeed; refused below 1 with 'nvme')"),
    d("zero_optimization.offload_optimizer.super_offload", "SuperOffload (Superchip CPU offloading)"),
    a("zero_optimization.offload_optimizer.cpuadam_cores_perc", "only with super_offload, rejected above", kind=NUM),
    b("zero_optimization.offload_param.device", "offload.param.device (below stage 3 ignored, as in DeepSpeed, and "
      "named in the banner): 'none'; "
      "'cpu' for a CPU model (accepted, the parameters are in host memory already), for a CUDA model with "
      "offload_optimizer 'cpu' (each unit's low-precision shard in pinned host memory, copied in by its gather); "
      "'nvme' with offload_optimizer 'nvme' (each unit's low-precision shard in a file, read by its gather)"),
    b("zero_optimization.offload_param.nvme_path", "offload.param.nvme_path (a string or null); device 'nvme' "
      "needs it"),
    b("zero_optimization.offload_param.pin_memory", "offload.param.pin_memory (default true)"),
    b("zero_optimization.offload_param.buffer_count", "offload.param.buffer_count (>= 0, default 5); "
      + PARAM_SWAP_BUFFERS),
    b("zero_optimization.offload_param.buffer_size", "offload.param.buffer_size (elements, >= 0, default 1e8); "
      + PARAM_SWAP_BUFFERS),
    b("zero_optimization.offload_param.max_in_cpu", "offload.param.max_in_cpu (elements, >= 0, default 1e9); "
      + PARAM_SWAP_BUFFERS),
    b("zero_optimization.cpu_offload", "DeepSpeed's legacy key: true is offload_optimizer {\"device\": \"cpu\"}; "
      "not with offload_optimizer"),
    b("zero_optimization.cpu_offload_param", "DeepSpeed's legacy key: true is offload_param {\"device\": \"cpu\"} "
      "(ignored below stage 3); not with offload_param"),
    b("zero_optimization.zero_quantized_weights", "at stage 3 (below it ignored, as in DeepSpeed) "
      "stage3.gather_dtype int8: each stage-3 weight gather as blocks of "
      "256 int8 codes with an FP32 scale, decoded into every rank's chunk, its own too (the FP32 master is never "
      "quantized); CPU and CUDA models (the same codes as kernels on the GPU)"),
    d("zero_optimization.zero_quantized_nontrainable_weights", "quantized weights (ZeRO++)", ignored_below=3,
      ignored_why="DeepSpeed passes it to its stage-3 optimizer only; at stage {stage} the frozen weights stay as "
      "they are"),
    b("zero_optimization.zero_quantized_gradients", "at stage 3 (below it ignored, as in DeepSpeed) "
      "comm.inter_node_dtype int8 (ZeRO++ qgZ): the gradients' "
      "partial sums cross the nodes as blocks of 256 int8 codes with an FP32 scale, summed in FP32 (two-hop, or "
      "shard_size's sum across groups); int8 where qgZ sends int4 with fp16 sums"),
    b("zero_optimization.zero_hpz_partition_size", "at stage 3 (below it ignored, as in DeepSpeed) "
      "stage3.secondary_shard_size (hpZ; 1: off): each rank keeps its "
      "piece of a gathered unit among this many consecutive ranks (a node), and the unit's re-gathers until the "
      "next update (the backward's, later micro-steps' forwards) run within them; 2 bytes per parameter / this "
      "many more memory"),
    d("zero_optimization.zeropp_loco_param", "ZeRO++ LoCo", EMPTY),
    b("zero_optimization.mics_shard_size", "shard_size: the state sharded within groups of this many consecutive "
      "ranks and replicated across them, gradients summed within the group, then across the groups once per "
      "window (-1 or 0: off); at stages 1-3, state in memory, mpi, gloo or nccl"),
    d("zero_optimization.mics_hierarchical_params_gather", "MiCS's two-hop gather inside a group that spans nodes "
      "(refused until a test can form groups over 4 nodes); zerort's groups gather flat within the group (a "
      "node's, with shard_size 'node'); comm.topology two_hop splits the world's gathers"),
    d("zero_optimization.legacy_stage1", "legacy stage 1"),
    d("zero_optimization.pipeline_loading_checkpoint", "pipeline checkpoint loading"),
    d("zero_optimization.zenflow", "ZenFlow", EMPTY),
    d("zero_optimization.leaf_module", "leaf modules: use zerort.stage3.unit_modules", EMPTY, ignored_below=3,
      ignored_why="leaf modules set how stage 3 gathers parameters; at stage {stage} every parameter is whole on "
      "every rank"),
    b("aio.block_size", "offload.aio.block_size: bytes per I/O request of the NVMe tier (>= 1, default 1048576)"),
    b("aio.queue_depth", "offload.aio.queue_depth: requests in flight (1 to 32768, default 8)"),
    b("aio.intra_op_parallelism", "offload.aio.intra_op_parallelism (>= 1, default 1)"),
    b("aio.single_submit", "offload.aio.single_submit (default false)"),
    b("aio.overlap_events", "offload.aio.overlap_events (default true)"),
    b("aio.use_gds", "accepted only false: zerort does not support GPUDirect Storage"),
    # ---- features zerort does not have ----
    *(i(f"activation_checkpointing.{k}", "DeepSpeed reads it only in deepspeed.checkpointing.configure(), "
        "which a script calls itself and zerort does not provide (use torch.utils.checkpoint); the engine never "
        "reads it") for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                              "synchronize_checkpoint_boundary", "profile")),
    a("activation_checkpointing.number_checkpoints", "only with partition_activations, rejected above"),
    i("pipeline", "DeepSpeed reads it for a PipelineModule's engine only (a plain module gets the plain engine), "
      "and zerort has no PipelineModule", EMPTY),
    i("flops_profiler", "DeepSpeed prints a FLOPS profile at one step; printing only", DISABLED),
    c("tensorboard", "the monitor's TensorBoard events in output_path/job_name (zerort.monitoring.monitor)"),
    i("wandb", "DeepSpeed sends its metrics to Weights & Biases; zerort writes csv_monitor and tensorboard "
      "only, and nothing in training changes", DISABLED),
    c("csv_monitor", "the monitor's metrics.csv in output_path/job_name (zerort.monitoring.monitor)"),
    i("comet", "DeepSpeed sends its metrics to Comet; zerort writes csv_monitor and tensorboard only, and "
      "nothing in training changes", DISABLED),
    i("comms_logger", "DeepSpeed logs its collectives' sizes and times; printing only", DISABLED),
    d("sparse_attention", "sparse attention kernels", EMPTY),
    d("autotuning", "the autotuner", DISABLED),
    d("elasticity", "elastic training", DISABLED),
    d("compression_training", "compression training", EMPTY),
    d("data_efficiency", "data efficiency (curriculum, routing)", DISABLED),
    d("curriculum_learning", "curriculum learning", DISABLED),
    d("progressive_layer_drop", "progressive layer drop", DISABLED),
    d("eigenvalue", "eigenvalue computation", DISABLED),
    d("quantize_training", "quantized training", DISABLED),
    d("hybrid_engine", "the hybrid (RLHF) engine", DISABLED),
    d("expert_parallel", "expert parallelism", DISABLED),
    d("compile", "DeepCompile", DISABLED),
    d("tensor_parallel", "tensor parallelism",
      (lambda v: isinstance(v, dict) and v.get("autotp_size", 1) in (0, 1), '{"autotp_size": 1}')),
    d("nebula", "Nebula checkpointing", DISABLED),
    a("checkpoint.tag_validation", "zerort always fails a save whose ranks pass different tags", kind=str),
    a("checkpoint.use_node_local_storage", "every rank writes its own shard", kind=BOOL),
    d("checkpoint.load_universal", "DeepSpeed's universal checkpoints"),
    i("checkpoint.parallel_write", "DeepSpeed's pipeline engine reads it only (each stage writing its own "
      "layers); zerort has none, and every rank writes its own shard", EMPTY),
    c("zerort", "zerort's own keys: stage3 (prefetch, persistence_threshold, unit_modules, gather_dtype), comm "
      "(backend, timeout_s, debug, topology, inter_node_dtype, intra_node), fp32_modules, max_consecutive_skips, "
      "overlap_param_gather"),
]

TABLE = {k.path: k for k in KEYS}
assert len(TABLE) == len(KEYS), "a key listed twice"

CLASS_NAMES = {"a": "done", "b": "mapped", "c": "implemented", "d": "rejected unless off", "i": "ignored"}


def markdown():
    """The table of DeepSpeed keys in docs/CONFIG.md."""
    counts = {cls: sum(k.cls == cls for k in KEYS) for cls in CLASS_NAMES}
    lines = ["| key | class | what zerort does |", "|---|---|---|"]
    for k in KEYS:
        what = k.note + (f" (accepted: {k.off_text})" if k.cls == "d" else "")
        if k.ignored_below:
            what += f"; below stage {k.ignored_below}: ignored, as in DeepSpeed"
        lines.append(f"| `{k.path}` | ({k.cls}) {CLASS_NAMES[k.cls]} | {what} |")
    total = ", ".join(f"{counts[cls]} ({cls}) {CLASS_NAMES[cls]}" for cls in CLASS_NAMES)
    return f"{len(TABLE)} keys: {total}.\n\n" + "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
