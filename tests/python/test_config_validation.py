"""Config validation, key by key: every key the parser reads is typed and range-checked,
each problem names the key, the value it got and what is allowed, unknown keys name the
closest known one, cross-key rules hold, and all problems of one config come in one error.

The tables below list a good value and bad values for every key; a test checks that the
tables cover every key the parser knows (zerort.config.known_keys), so a new key without
validation tests fails here."""
import json
import math

import pytest

from zerort.config import known_keys, parse
from zerort.errors import ConfigError

NAN, INF = math.nan, math.inf
FP32_ZERO, FP32_SUBNORMAL, FP32_INF = 1e-46, 1e-40, 1e39  # a float64 that is 0, subnormal, inf in FP32
SECTION_BAD = [1, [], "x", None]

# path: (a good value, [bad values])
OURS = {
    "stage": (1, [4, -1, True, "2", 2.0, None]),
    "precision": ("fp16", ["int8", 16, None, "BF16"]),
    "optimizer.lr": (1e-4, [-1.0, NAN, INF, "1e-3", True, FP32_ZERO, FP32_SUBNORMAL, FP32_INF]),
    "optimizer.betas": ([0.8, 0.9], [[0.9], [0.9, 1.0], [NAN, 0.9], "0.9,0.99", [True, 0.9], [0.9, 0.9, 0.9],
                                     [FP32_ZERO, 0.9], [0.9, FP32_SUBNORMAL]]),
    "optimizer.eps": (1e-6, [0, 0.0, -1e-8, INF, NAN, "1e-8", FP32_ZERO, 5e-324, FP32_SUBNORMAL, FP32_INF]),
    "optimizer.weight_decay": (0.1, [-0.1, NAN, False, FP32_SUBNORMAL, FP32_INF]),
    "optimizer.bias_correction": (False, [0, "false", None]),
    "optimizer.state_dtype": ("bf16", ["fp16", 2, None]),
    "optimizer.master_dtype": ("fp32", ["fp16", 2, None]),
    "autocast": ("bf16", ["fp16", 1, "BF16"]),
    "loss_scale.initial_scale_power": (8, [61, -1, 8.0, True]),
    "loss_scale.window": (10, [0, 2 ** 63, 2 ** 31, 1.5, "10"]),
    "loss_scale.hysteresis": (1, [0, "2", None, 2 ** 31]),
    "loss_scale.min_scale": (0.5, [0, -1, INF, "1", FP32_ZERO, FP32_INF]),
    "loss_scale.consecutive_hysteresis": (True, [1, "true", None]),
    "gradient_clipping": (1.0, [-1, NAN, "1", True, FP32_SUBNORMAL, FP32_INF]),
    "gradient_accumulation_steps": (2, [0, 1.0, False, 2 ** 70, 2 ** 31]),
    "reduce_bucket_numel": (1000, [0, 10 ** 30, 1e6, -5, 2 ** 40 + 1]),
    "train_micro_batch_size_per_gpu": (4, [0, 4.0, "4", 2 ** 31]),
    "stage3.prefetch": (0, [-1, True, 1.5, 65537, 1_000_000_000]),
    "stage3.persistence_threshold": (100, [-1, "x", 2 ** 40 + 1]),
    "stage3.unit_modules": (["Block"], ["Block", [1], [""], {"Block": 1}]),
    "stage3.gather_dtype": ("int8", ["int4", 8, None]),
    "stage3.secondary_shard_size": (2, [1.0, 0, "nodes", True, None, 2 ** 21]),
    "comm.backend": ("mpi", ["tcp", 1, None]),
    "comm.timeout_s": (30, [0, 1e10, NAN, -1, "30"]),
    "comm.debug": (True, [1, "true", None]),
    "comm.topology": ("two_hop", ["hierarchical", 2, None]),
    "comm.inter_node_dtype": ("int8", ["fp16", "fp8", None]),
    "comm.intra_node": ("backend", ["tcp", 1, None]),
    "fp32_modules": (["MyGate", "-BatchNorm2d"], ["LayerNorm", None, [None], [""], ["-"], ["--X"],
                                                  ["torch.nn.LayerNorm"], ["LayerNorm", "-LayerNorm"]]),
    "max_consecutive_skips": (10, [0, True, 1.5, "10", 2 ** 31]),
    "overlap_param_gather": (True, [1, "true", None]),
    "shard_size": ("node", [0, -1, "nodes", 1.0, True, 2 ** 21, None]),
    "lr_schedule": (lambda step: 1e-3, [0.1, "cosine"]),
    "optimizer": ({}, SECTION_BAD),
    "loss_scale": ({}, SECTION_BAD),
    "stage3": ({}, SECTION_BAD),
    "comm": ({}, SECTION_BAD),
    "loss_scale.static": (128.0, [-1, NAN, "1", FP32_ZERO, FP32_INF]),
    "steps_per_print": (10, [0, 1.5, "10", True, 2 ** 62 + 1]),
    "wall_clock_breakdown": (True, [1, "yes"]),
    "dataloader_drop_last": (True, [1]),
    "scheduler": ({}, SECTION_BAD),
    "monitor": ({}, SECTION_BAD),
    "monitor.csv": (True, [1, "yes"]),
    "monitor.tensorboard": (False, [0]),
    "monitor.output_path": ("runs", [1, None]),
    "monitor.job_name": ("gpt", [["x"]]),
}
# The offload keys, the same in both forms under their own section names (zerort.config.offload).
SECTION_OR_NULL_BAD = [1, [], "x"]  # null is an absent section, as in DeepSpeed
OFFLOAD_COMMON = {"": ({}, SECTION_OR_NULL_BAD), ".device": ("none", ["gpu", 1, None, "CPU"]),
                  ".nvme_path": (None, [1, ["/x"]]), ".pin_memory": (False, [1, "yes", None]),
                  ".buffer_count": (2, [-1, 1.5, "4", 2 ** 31])}
OFFLOAD_OPTIMIZER = {**OFFLOAD_COMMON, ".pipeline_read": (True, [1]), ".pipeline_write": (True, ["no"]),
                     ".fast_init": (False, [0]), ".ratio": (1.0, [-0.1, 1.5, "1", NAN, True]),
                     ".chunk_numel": (4096, [0, -1, 1.5, "4096", 2e12]), ".gradient_in_file": (False, [1, "yes", None]),
                     ".overlap_step": (True, [1, "yes", None]), ".ram_fraction": (0.0, [-0.1, 1.5, "1", NAN, True]),
                     ".gradient_on_device": (False, [1, "yes", None])}
OFFLOAD_PARAM = {**OFFLOAD_COMMON, ".buffer_size": (1e8, [-1, 1.5, 2e12, "1e8"]),
                 ".max_in_cpu": (1e9, [-1, 2e12, None])}
AIO = {"": ({}, SECTION_OR_NULL_BAD), ".block_size": (1048576, [0, 1.5, "4096", True]),
       ".queue_depth": (32, [0, 32769, "8"]), ".intra_op_parallelism": (2, [0, -1]),
       ".single_submit": (True, [1]), ".overlap_events": (False, ["yes"]), ".use_gds": (False, [True, 1, "false"]),
       ".io_backend": ("threads", ["uring", "io-uring", 1, None])}
OURS.update({"offload": ({}, SECTION_OR_NULL_BAD), "offload.placement": ("auto", ["Auto", "cpu", 1, None]),
             **{f"offload.optimizer{k}": v for k, v in OFFLOAD_OPTIMIZER.items()},
             **{f"offload.param{k}": v for k, v in OFFLOAD_PARAM.items()},
             **{f"offload.aio{k}": v for k, v in AIO.items()}})
RUNTIME = ("stage3", "stage3.prefetch", "stage3.persistence_threshold", "stage3.unit_modules", "stage3.gather_dtype",
           "stage3.secondary_shard_size",
           "comm", "comm.backend",
           "comm.timeout_s", "comm.debug", "comm.topology", "comm.inter_node_dtype", "comm.intra_node",
           "fp32_modules",
           "max_consecutive_skips", "overlap_param_gather", "lr_schedule")

DEEPSPEED = {
    "train_batch_size": (8, [0, 8.5, "8", True, 2 ** 31]),
    "zero_optimization": ({}, SECTION_BAD),
    "zero_optimization.stage": (3, [4, "3", None]),
    "zero_optimization.reduce_bucket_size": (5e7, [0, 5.5, 1e300, "5e8", NAN, 2e12]),
    "bf16": ({}, SECTION_BAD + [True]),
    "bf16.enabled": (True, [1, "true", None]),
    "bf16.bf16_optimizer_states": (True, [1, "yes"]),
    "bf16.bf16_master_weights_and_grads": (False, [1, "yes"]),
    "torch_autocast": ({}, SECTION_BAD + [True]),
    "torch_autocast.enabled": (True, [1, "yes", None]),
    "torch_autocast.dtype": ("bfloat16", ["fp8", 1, "BF16"]),
    "torch_autocast.lower_precision_safe_modules": (["torch.nn.Linear"], [1, [1], "torch.nn.Linear"]),
    "fp16": ({}, SECTION_BAD + [True]),
    "fp16.enabled": (False, [0, "false"]),
    "fp16.initial_scale_power": (12, [100, -2]),
    "fp16.loss_scale_window": (100, [0, 1.0]),
    "fp16.hysteresis": (2, [0]),
    "fp16.min_loss_scale": (1, [0, INF, FP32_SUBNORMAL]),
    "fp16.consecutive_hysteresis": (False, ["no"]),
    "optimizer": ({}, SECTION_BAD),
    "optimizer.type": ("AdamW", ["Lamb", 1]),
    "optimizer.params": ({}, SECTION_BAD),
    "optimizer.params.lr": (1e-4, [-1, NAN, FP32_INF, FP32_ZERO]),
    "optimizer.params.betas": ([0.9, 0.95], [[1.5, 0.9], [FP32_ZERO, 0.9]]),
    "optimizer.params.eps": (1e-8, [-1, 0, NAN, FP32_ZERO, 5e-324, FP32_INF]),
    "optimizer.params.weight_decay": (0.0, [INF, FP32_INF]),
    "optimizer.params.bias_correction": (False, [1, "no"]),
    "gradient_clipping": (1.0, [-0.5, FP32_ZERO]),
    "gradient_accumulation_steps": (1, [0, True, 2 ** 31]),
    "train_micro_batch_size_per_gpu": (1, [0, 2 ** 31]),
    "zero_optimization.allgather_bucket_size": (5e8, [0, "5e8", 2e12]),
    "zero_optimization.stage3_prefetch_bucket_size": (5e7, [-1, "x", 1e15]),
    "zero_optimization.stage3_param_persistence_threshold": (1e5, [-1, 1e15]),
    "zero_optimization.stage3_max_live_parameters": (1e9, [0, 1e15]),
    "zero_optimization.zero_quantized_weights": (True, [1, "true"]),
    "zero_optimization.mics_shard_size": (2, [-2, "2", 2.0, True, None]),
    "zero_optimization.zero_hpz_partition_size": (8, [0, -1, "8", 8.0, True]),
    "zero_optimization.zero_quantized_gradients": (True, [1, "true"]),
    "fp16.loss_scale": (0, [-1, "0", FP32_SUBNORMAL, FP32_INF]),
    "optimizer.params.adam_w_mode": (True, [1]),
    "optimizer.params.torch_adam": (False, ["no"]),
    "communication_data_type": ("fp32", ["bf16", "int8"]),
    "data_types": ({}, SECTION_BAD),
    "data_types.grad_accum_dtype": ("fp32", ["bf16"]),
    "steps_per_print": (10, [0, 1e20]),
    "wall_clock_breakdown": (False, [1]),
    "dataloader_drop_last": (False, [1]),
    "scheduler": ({}, SECTION_BAD),
    "zerort": ({}, SECTION_BAD),
    **{f"zerort.{k}": OURS[k] for k in RUNTIME}, "zerort.offload_placement": OURS["offload.placement"],
    **{f"{m}{k}": v for m in ("csv_monitor", "tensorboard") for k, v in
       (("", ({}, SECTION_BAD)), (".enabled", (False, [1])), (".output_path", ("runs", [1])),
        (".job_name", ("j", [None])))},
    **{f"zero_optimization.offload_optimizer{k}": v for k, v in OFFLOAD_OPTIMIZER.items()},
    **{f"zero_optimization.offload_param{k}": v for k, v in OFFLOAD_PARAM.items()},
    **{f"aio{k}": v for k, v in AIO.items()},
    "zero_optimization.cpu_offload": (False, [1, "yes", None]),
    "zero_optimization.cpu_offload_param": (False, [0, "no"]),
}


def nested(path, value, base=None):
    """{"a": {"b": value}} for path "a.b", merged into a copy of base."""
    cfg = json.loads(json.dumps(base or {}))
    d, parts = cfg, path.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value
    return cfg


def problems(cfg):
    with pytest.raises(ConfigError) as e:
        parse(cfg)
    assert str(e.value).count("\n") == len(e.value.problems)  # every problem is in the message
    return e.value.problems


def test_the_tables_cover_every_key_the_parser_reads():
    assert sorted(known_keys()) == sorted(OURS)
    assert sorted(known_keys(deepspeed=True)) == sorted(DEEPSPEED)


CASES = ([("ours", path, bad) for path, (_, bads) in OURS.items() for bad in bads] +
         [("deepspeed", path, bad) for path, (_, bads) in DEEPSPEED.items() for bad in bads])
DS_BASE = {"zero_optimization": {}}  # marks a config as DeepSpeed's


@pytest.mark.parametrize("schema,path,bad", CASES, ids=[f"{s}:{p}={b!r}" for s, p, b in CASES])
def test_each_bad_value_names_key_value_and_allowed(schema, path, bad):
    base = DS_BASE if schema == "deepspeed" else {}
    if path == "zero_optimization":  # the marker itself is bad: mark with another DeepSpeed key
        base = {"bf16": {"enabled": False}}
    cfg = nested(path, bad, base)
    (line,) = problems(cfg)
    assert line.startswith(f"{path}: got {bad!r}"), line
    assert "; allowed: " in line and line.split("; allowed: ")[1].strip(), line


def test_good_values_are_taken():
    for path, (good, _) in OURS.items():
        parse(nested(path, good))
    for path, (good, _) in DEEPSPEED.items():
        parse(nested(path, good, DS_BASE if path != "zero_optimization" else {"bf16": {}}))
    c = parse({"zero_optimization": {"reduce_bucket_size": 5e7}})
    assert c.reduce_bucket_numel == 50_000_000 and isinstance(c.reduce_bucket_numel, int)


def test_many_errors_in_one_config_all_in_one_message():
    cfg = {"stage": "3", "precision": "fp8", "gradient_clipping": NAN, "gradient_accumulation_steps": True,
           "reduce_bucket_numel": 0, "optimizer": {"lr": INF, "betas": [0.9, 1.2], "eps": -1, "momentum": 0.9},
           "loss_scale": {"window": 0, "hysteresis": 1.5, "min_scale": 0, "consecutive_hysteresis": "yes"},
           "stage3": {"prefetch": -2, "unit_modules": "Block"}, "comm": {"backend": "tcp", "timeout_s": 0},
           "fp32_modules": "LayerNorm", "lr": 1e-3, "bogus": {}}
    with pytest.raises(ConfigError) as e:
        parse(cfg)
    text = str(e.value)
    expected = ["stage: got '3' (a str); allowed: an integer >= 0 and <= 3",
                "precision: got 'fp8'; allowed: 'bf16' | 'fp16' | 'fp32'",
                "gradient_clipping: got nan; allowed: a finite number >= 0 and <= 3.4028234e+38 (FP32's largest finite "
                "number)",
                "gradient_accumulation_steps: got True (a bool); allowed: an integer >= 1",
                "reduce_bucket_numel: got 0; allowed: >= 1 and <= 2**40",
                "optimizer.lr: got inf; allowed: a finite number >= 0 and <= 3.4028234e+38",
                "optimizer.betas: got [0.9, 1.2]; allowed: a list of two numbers, each >= 0 and < 1",
                "optimizer.eps: got -1; allowed: > 0 (e.g. 1e-8) and <= 3.4028234e+38",
                "optimizer.momentum: unknown or unsupported key (got 0.9); known keys in optimizer: lr, betas, eps,",
                "loss_scale.window: got 0; allowed: >= 1 and <= 2**31 - 1",
                "loss_scale.hysteresis: got 1.5 (a float); allowed: an integer >= 1",
                "loss_scale.min_scale: got 0; allowed: > 0",
                "loss_scale.consecutive_hysteresis: got 'yes' (a str); allowed: true or false",
                "stage3.prefetch: got -2; allowed: >= 0 and <= 65536",
                "stage3.unit_modules: got 'Block' (a str); allowed: a list of module class names",
                "comm.backend: got 'tcp'; allowed: 'auto' | 'mpi' | 'gloo' | 'nccl' | 'inprocess'",
                "comm.timeout_s: got 0; allowed: >= 0.001 and <= 1e+09",
                "fp32_modules: got 'LayerNorm' (a str); allowed: a list of module class names",
                "lr: unknown or unsupported key (got 0.001); did you mean 'optimizer.lr'?",
                "bogus: unknown or unsupported key (got {}); known keys: stage, precision, optimizer,"]
    for want in expected:
        assert want in text, f"{want!r} missing from:\n{text}"
    assert len(e.value.problems) == len(expected)


def test_eps_must_be_positive_in_both_spellings():
    # eps = 0 passed before and made a master weight NaN at the first bf16 step (0 / 0 where a
    # gradient and its moments are 0), after which every step was skipped.
    fp32_max = "3.4028234e+38 (FP32's largest finite number)"
    assert problems({"optimizer": {"eps": 0}}) == [f"optimizer.eps: got 0; allowed: > 0 (e.g. 1e-8) and <= {fp32_max}"]
    assert problems({"zero_optimization": {}, "optimizer": {"type": "AdamW", "params": {"eps": 0.0}}}) == [
        f"optimizer.params.eps: got 0.0; allowed: > 0 (e.g. 1e-8) and <= {fp32_max}"]
    assert problems({"optimizer": {"eps": INF}}) == [
        f"optimizer.eps: got inf; allowed: a finite number > 0 (e.g. 1e-8) and <= {fp32_max}"]
    assert problems({"bf16": {"enabled": True}, "optimizer": {"params": {"eps": NAN}}}) == [
        f"optimizer.params.eps: got nan; allowed: a finite number > 0 (e.g. 1e-8) and <= {fp32_max}"]
    # A positive float64 that is 0 in FP32 made the first update 0 / 0 = NaN (issue 27).
    assert problems({"optimizer": {"eps": 5e-324}}) == [
        "optimizer.eps: got 5e-324, which is 0 in FP32, the dtype the engine computes with; allowed: >= "
        "1.1754944e-38 (FP32's smallest normal number), e.g. 1e-8"]
    assert parse({"optimizer": {"eps": 1.1754944e-38}}).optimizer.eps == 1.1754944e-38  # the smallest allowed
    assert parse({"fp16": {"enabled": True}, "optimizer": {"params": {"eps": 1e-6}}}).optimizer.eps == 1e-6


def test_unknown_keys_suggest_the_closest_known_key():
    assert "did you mean 'optimizer.lr'?" in problems({"optimizer": {"lrr": 1}})[0]
    assert "did you mean 'loss_scale.window'?" in problems({"loss_scale_window": 5})[0]
    assert "did you mean 'gradient_accumulation_steps'?" in problems({"gradient_accumulation_step": 2})[0]
    assert "did you mean 'zero_optimization.stage'?" in problems({"zero_optimization": {}, "stage": 2})[0]
    assert "did you mean 'fp16.loss_scale_window'?" in problems({"fp16": {"loss_scale_windows": 2}})[0]
    far = problems({"completely_unrelated_thing": 1})[0]
    assert "did you mean" not in far and "known keys: stage, precision" in far
    (line,) = problems({3: "x"})  # a non-string key is named, not a crash
    assert line.startswith("3: unknown or unsupported key (got 'x')")


def test_cross_key_rules():
    assert problems({"bf16": {"enabled": True}, "fp16": {"enabled": True}}) == [
        "bf16.enabled and fp16.enabled: both true; allowed: enable at most one"]
    (line,) = problems({"precision": "fp16", "loss_scale": {"initial_scale_power": 4, "min_scale": 32}})
    assert line.startswith("loss_scale.min_scale: got 32, above the initial loss scale "
                           "2**loss_scale.initial_scale_power = 16")
    (line,) = problems({"fp16": {"enabled": True, "initial_scale_power": 3, "min_loss_scale": 9}})
    assert line.startswith("fp16.min_loss_scale: got 9, above the initial loss scale") and "allowed: <= 8" in line
    parse({"precision": "bf16", "loss_scale": {"initial_scale_power": 4, "min_scale": 32}})  # unused in bf16
    (line,) = problems({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    assert line.startswith("train_batch_size: got 10; allowed: a multiple of train_micro_batch_size_per_gpu (2) x "
                           "gradient_accumulation_steps (2) = 4")
    parse({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})


def test_json_files_name_the_file(tmp_path):
    twice = tmp_path / "twice.json"
    twice.write_text('{"stage": 1, "optimizer": {"lr": 0.1, "lr": 0.2}, "stage": 2, "precision": "x"}')
    text = "\n".join(problems(str(twice)))
    assert f"lr: given twice in one object of config file {str(twice)!r}" in text
    assert f"stage: given twice in one object of config file {str(twice)!r}" in text
    assert "precision: got 'x'" in text  # reported together with the rest
    latin = tmp_path / "latin1.json"
    latin.write_bytes('{"precision": "bf16é"}'.encode("latin-1"))
    (line,) = problems(str(latin))
    assert str(latin) in line and "not UTF-8" in line
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]")
    assert problems(str(arr)) == [f"config file {str(arr)!r}: got a list; allowed: a JSON object of keys"]
    nan = tmp_path / "nan.json"
    nan.write_text('{"optimizer": {"lr": NaN}}')  # Python's json reads NaN; the check rejects it
    assert problems(str(nan)) == ["optimizer.lr: got nan; allowed: a finite number >= 0 and <= 3.4028234e+38 (FP32's "
                                  "largest finite number)"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    (line,) = problems(str(bad))
    assert str(bad) in line and "not valid JSON" in line


def test_a_config_that_is_not_a_mapping():
    assert problems([("stage", 1)]) == [
        "config: got a list; allowed: a dict, a JSON file path or a zerort.config.Config"]


# ---- configs that cannot crash the parser (issue 14) ---------------------------------------

def test_deep_nesting_is_a_config_error_not_a_recursion_error(tmp_path):
    from zerort.config import MAX_DEPTH

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)  # past the JSON parser's own limit
    assert problems(str(deep)) == [f"config file {str(deep)!r}: nested too deep for the JSON parser; allowed: at most "
                                   f"{MAX_DEPTH} levels of objects and lists (a zerort or DeepSpeed config needs 4)"]
    deep.write_text('{"stage3": ' + '{"a": ' * 100 + "1" + "}" * 101)  # parses, but deeper than MAX_DEPTH
    (line,) = problems(str(deep))
    assert line.startswith(f"config file {str(deep)!r}: nested more than {MAX_DEPTH} levels deep"), line
    cfg = d = {}
    for _ in range(100_000):  # the same as a dict
        d["x"] = {}
        d = d["x"]
    (line,) = problems(cfg)
    assert line.startswith(f"config: nested more than {MAX_DEPTH} levels deep"), line
    ok = v = {}
    for _ in range(MAX_DEPTH - 2):  # with the config around it and the innermost {}: MAX_DEPTH levels
        v["x"] = {}
        v = v["x"]
    (line,) = problems({"bogus": ok})  # at the limit: parsed, and the unknown key is shown short
    assert line.startswith("bogus: unknown or unsupported key (got {'x': {'x': {'x': {'x': {...}}}}})"), line
    loop = {"a": 1}
    loop["self"] = loop  # a cycle under an unknown key: shown, not walked forever
    (line,) = problems({"bogus": loop})
    assert line.startswith("bogus: unknown or unsupported key (got {'a': 1, 'self': {'a': 1, 'self': {'a': 1, "
                           "'self': {'a': 1, 'self': {...}}}}})"), line  # four levels shown


def test_messages_show_values_cut_short(tmp_path):
    big = [0] * 7_750_000  # 62 MB of list
    (line,) = problems({"bogus": big})
    assert "(got [0, 0, 0, 0, 0, 0, 0, 0, ...] (a list of 7750000 items))" in line and len(line) < 600, line[:700]
    (line,) = problems({"stage": "9" * 1_000_000})
    assert line == f"stage: got {'9' * 200!r}...(1000000 chars) (a str); allowed: an integer >= 0 and <= 3"
    (line,) = problems({"k" * 100_000: 1})
    assert line.startswith("k" * 200 + "…(100000 chars): unknown or unsupported key (got 1); known keys: stage"), \
        line[:300]
    f = tmp_path / "big.json"
    f.write_text(json.dumps({"bogus": list(range(1_000_000)), "optimizer": {"lr": "x" * 500_000}}))
    text = "\n".join(problems(str(f)))
    assert len(text) < 1500 and "(a list of 1000000 items)" in text and "...(500000 chars)" in text, text[:2000]
