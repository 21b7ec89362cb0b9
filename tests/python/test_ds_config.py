"""DeepSpeed configs under zerort: every key of zerort.config.deepspeed_keys' table in its class, the
key sets of HuggingFace's DeepSpeed test configs and of DeepSpeed's documentation examples
(values here are our own), "auto" outside the HuggingFace integration, and the mapped keys
(fp16.loss_scale, the optimizer types, communication and accumulation dtypes, the stage-3
sizes, the batch triple, the zerort section)."""
import os

import pytest
import torch
import torch.nn as nn

import zerort
from zerort.config import deepspeed_keys as ds_keys
from zerort.config import parse, resolve_batch
from zerort.errors import ConfigError
from zerort.layout.units import prefetch_units

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def problems(cfg):
    with pytest.raises(ConfigError) as e:
        parse(cfg)
    return e.value.problems


def hf_zero2(auto=None):
    """The keys of HuggingFace's tests/deepspeed/ds_config_zero2.json; "auto" values filled
    with numbers (or left "auto" with auto=True)."""
    a = (lambda v: "auto") if auto else (lambda v: v)
    return {
        "fp16": {"enabled": a(True), "loss_scale": 0, "loss_scale_window": 500, "initial_scale_power": 12,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": a(False)},
        "optimizer": {"type": "AdamW", "params": {"lr": a(3e-5), "betas": a([0.9, 0.999]), "eps": a(1e-8),
                                                  "weight_decay": a(0.01)}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": a(0), "warmup_max_lr": a(3e-5),
                                                     "warmup_num_steps": a(10)}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "allgather_partitions": True, "allgather_bucket_size": 1e8, "overlap_comm": True,
                              "reduce_scatter": True, "reduce_bucket_size": 3e7, "contiguous_gradients": True},
        "gradient_accumulation_steps": a(2), "gradient_clipping": a(1.0), "steps_per_print": 1000,
        "train_batch_size": a(16), "train_micro_batch_size_per_gpu": a(4), "wall_clock_breakdown": False,
    }


def hf_zero3(auto=None):
    """The keys of HuggingFace's tests/deepspeed/ds_config_zero3.json, filled likewise."""
    cfg = hf_zero2(auto)
    del cfg["bf16"]
    a = (lambda v: "auto") if auto else (lambda v: v)
    cfg["zero_optimization"] = {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e13, "reduce_bucket_size": a(4096), "stage3_prefetch_bucket_size": a(3686),
        "stage3_param_persistence_threshold": a(640), "stage3_max_live_parameters": 1e8,
        "stage3_max_reuse_distance": 1e8, "stage3_gather_16bit_weights_on_model_save": True}
    return cfg


def no_offload(cfg):
    for key in ("offload_optimizer", "offload_param"):
        if key in cfg["zero_optimization"]:
            cfg["zero_optimization"][key]["device"] = "none"
    return cfg


# The keys of examples in DeepSpeed's documentation and tutorials (our own values).
DOCS = {
    "getting-started": {"train_batch_size": 8, "gradient_accumulation_steps": 1,
                        "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "fp16": {"enabled": True},
                        "zero_optimization": True},
    "cifar10": {"train_batch_size": 16, "steps_per_print": 100,
                "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                         "weight_decay": 3e-7}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                             "warmup_num_steps": 100}},
                "wall_clock_breakdown": False},
    "zero-stage2": {"zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                                          "reduce_scatter": True, "reduce_bucket_size": 5e8,
                                          "allgather_bucket_size": 5e8}},
    "zero3-bf16": {"train_batch_size": 8, "gradient_clipping": 1.0, "prescale_gradients": False,
                   "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "reduce_scatter": True,
                                                                    "overlap_comm": False,
                                                                    "contiguous_gradients": False}},
    "one-cycle": {"train_batch_size": 32, "scheduler": {"type": "OneCycle", "params": {
        "cycle_first_step_size": 100, "cycle_first_stair_count": 50, "cycle_second_step_size": 100,
        "cycle_second_stair_count": 50, "decay_step_size": 100, "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
        "decay_lr_rate": 1e-3, "cycle_min_mom": 0.85, "cycle_max_mom": 0.99, "decay_mom_rate": 0.0}}},
    "lr-range-test": {"train_batch_size": 32, "scheduler": {"type": "LRRangeTest", "params": {
        "lr_range_test_step_size": 5, "lr_range_test_step_rate": 1.0, "lr_range_test_min_lr": 1e-4,
        "lr_range_test_staircase": True}}},
    "autotuning-off": {"autotuning": {"enabled": False, "results_dir": "results", "fast": True, "metric": "throughput",
                                      "start_profile_step": 3, "end_profile_step": 5}},
    "monitors-off": {"train_batch_size": 8, "tensorboard": {"enabled": False, "output_path": "runs"},
                     "csv_monitor": {"enabled": False}, "wandb": {"enabled": False},
                     "flops_profiler": {"enabled": False, "profile_step": 1}},
    # Parsed; initialize refuses the NVMe tier (test_engine_parity's test_bad_engine_config_names_the_key).
    "zero3-offload": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                            "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
    "fp16-static": {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True, "loss_scale": 128},
                    "zero_optimization": {"stage": 1}, "communication_data_type": "fp16",
                    "data_types": {"grad_accum_dtype": "fp16"}},
    # Accepted and ignored, as DeepSpeed ignores them here (tests/python/test_ds_lenient.py).
    "flops-profiler": {"train_batch_size": 8, "flops_profiler": {"enabled": True, "profile_step": 1}},
    "pipeline": {"train_batch_size": 8, "pipeline": {"stages": 2}},
    # ZeRO++'s tutorial: int8 weight gathers, hpZ within a node of 8, quantized gradients across nodes.
    "zero++": {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 8,
                                     "zero_quantized_gradients": True}},
}
# Documentation examples of features zerort does not have: each named, in one error.
DOCS_UNSUPPORTED = {
    # not Lamb's params; partition_activations is ignored (deepspeed.checkpointing's)
    "bert-lamb": ({"train_batch_size": 64, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 0.3}},
                   "activation_checkpointing": {"partition_activations": True}}, ["optimizer.type"]),
}


def test_huggingface_test_configs_parse_with_auto_filled_offload_included():
    o2, o3 = parse(hf_zero2()).offload, parse(hf_zero3()).offload
    assert (o2.optimizer.device, o2.optimizer.pin_memory, o2.param.device) == ("cpu", True, "none")
    assert (o3.optimizer.device, o3.param.device, o3.param.pin_memory, o3.param.buffer_count) == ("cpu", "cpu", True, 5)
    assert parse(no_offload(hf_zero3())).offload == zerort.config.Config().offload
    c = parse(hf_zero2())
    assert (c.stage, c.precision, c.reduce_bucket_numel, c.loss_scale.static) == (2, "fp16", 30_000_000, 0.0)
    b = c.batch
    assert (b.train_batch_size, b.train_micro_batch_size_per_gpu, b.gradient_accumulation_steps) == (16, 4, 2)
    assert c.optimizer.scheduler == {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                          "warmup_num_steps": 10}}
    assert (c.monitor.steps_per_print, c.loss_scale.initial_scale_power, c.loss_scale.window) == (1000, 12, 500)
    c = parse(hf_zero3())
    s3 = c.stage3
    assert (c.stage, c.reduce_bucket_numel, s3.prefetch_numel, s3.persistence_threshold, s3.max_live_numel) == \
        (3, 4096, 3686, 640, 100_000_000)


def test_auto_is_an_error_outside_the_huggingface_integration_all_in_one():
    lines = problems(no_offload(hf_zero3(auto=True)))
    autos = [ln.split(":")[0] for ln in lines]
    assert autos == ["fp16.enabled", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
                     "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
                     "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
                     "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold", "gradient_accumulation_steps",
                     "gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu"]
    assert all("HuggingFace's Trainer integration fills in" in ln for ln in lines)


@pytest.mark.parametrize("name", list(DOCS))
def test_documentation_examples_parse(name):
    parse(DOCS[name])


@pytest.mark.parametrize("name", list(DOCS_UNSUPPORTED))
def test_unsupported_features_are_each_named(name):
    cfg, keys = DOCS_UNSUPPORTED[name]
    lines = problems(cfg)
    assert sorted(ln.split(":")[0] for ln in lines) == sorted(keys)


def _not_off(key):
    """A value that turns the (d) key's feature on."""
    for v in (True, {"enabled": True}, {"x": 1}, 4, "sum", {"device": "cpu"}, {"autotp_size": 2}, "bf16", False):
        if not key.off(v):
            return v
    raise AssertionError(key.path)


def _nested(path, value, stage=None):
    cfg = d = {"zero_optimization": {} if stage is None else {"stage": stage}}
    parts = path.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value
    return cfg


@pytest.mark.parametrize("key", [k for k in ds_keys.KEYS if k.cls == "d"], ids=lambda k: k.path)
def test_each_rejected_key_is_named_when_on_and_accepted_when_off(key):
    (line,) = problems(_nested(key.path, _not_off(key), key.ignored_below))  # at a stage that reads it
    assert line.startswith(f"{key.path}: got ") and "zerort does not support" in line and key.off_text in line
    assert parse(_nested(key.path, None if key.off(None) else _off(key), key.ignored_below)).ignored == ()
    if key.ignored_below:  # below it DeepSpeed never reads the key: ignored, and named in the banner
        (line,) = parse(_nested(key.path, _not_off(key), key.ignored_below - 1)).ignored
        assert line.startswith(f"{key.path} ") and f"stage {key.ignored_below - 1}" in line


def _off(key):
    for v in (False, {"enabled": False}, {}, "mean", True, {"autotp_size": 1}):
        if key.off(v):
            return v
    raise AssertionError(key.path)


@pytest.mark.parametrize("key", [k for k in ds_keys.KEYS if k.cls == "i"], ids=lambda k: k.path)
def test_each_ignored_key_is_accepted_and_named_in_the_banner_when_on(key):
    on = next(v for v in (True, False, {"enabled": True}, {"x": 1}) if not key.off(v) and
              (key.kind is None or isinstance(v, key.kind)))
    (line,) = parse(_nested(key.path, on)).ignored
    assert line.startswith(f"{key.path} ") and line.split(": ", 1)[1] == key.note
    assert parse(_nested(key.path, _off(key))).ignored == ()
    if key.kind is not None:
        (line,) = problems(_nested(key.path, [1]))
        assert line.startswith(f"{key.path}: got [1] (a list); allowed: a JSON"), line


@pytest.mark.parametrize("key", [k for k in ds_keys.KEYS if k.cls == "a" and k.kind], ids=lambda k: k.path)
def test_each_accepted_key_is_taken_and_type_checked(key):
    good = {bool: True, int: 8, str: "Ignore", dict: {}, (int, float): 2.0}[key.kind]
    parse(_nested(key.path, good))
    (line,) = problems(_nested(key.path, [1]))
    assert line.startswith(f"{key.path}: got [1] (a list); allowed: a JSON"), line


def test_the_docs_hold_the_key_table():
    with open(os.path.join(ROOT, "docs", "CONFIG.md")) as f:
        assert ds_keys.markdown() in f.read(), \
            "docs/CONFIG.md's DeepSpeed key table is stale: python -m zerort.config.deepspeed_keys"


def test_loss_scale_zero_is_dynamic_and_a_number_is_static():
    def run(loss_scale):
        torch.manual_seed(0)
        cfg = {"fp16": {"enabled": True, "loss_scale": loss_scale, "initial_scale_power": 8, "hysteresis": 1},
               "zero_optimization": {"stage": 2}, "zerort": {"comm": {"backend": "inprocess"}}}
        e = zerort.initialize(nn.Linear(4, 2), cfg)
        scales = []
        for poison in (False, True, False):
            loss = e(torch.randn(3, 4)).float().pow(2).mean()
            e.backward(loss * float("inf") if poison else loss)
            scales.append(e.step()["loss_scale"])
        return scales, e.loss_scale, e.skipped_steps

    assert run(0) == ([256.0, 256.0, 128.0], 128.0, 1)  # dynamic: halves after the overflow
    assert run(128) == ([128.0, 128.0, 128.0], 128.0, 1)  # static: skips, keeps its scale


def test_optimizer_types_and_adam_w_mode():
    assert parse({"optimizer": {"type": "adam", "params": {"weight_decay": 0.1}}}).optimizer.weight_decay == 0.1
    parse({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0, "torch_adam": True}}})
    (line,) = problems({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}})
    assert line.startswith("optimizer.params.adam_w_mode: false with weight_decay 0.1 asks for Adam's L2")
    (line,) = problems({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert line.startswith("optimizer.type: got 'SGD'; allowed: 'Adam' or 'AdamW'")


def test_communication_and_accumulation_dtypes_are_what_zerort_does():
    parse({"bf16": {"enabled": True}, "communication_data_type": "bf16", "zero_optimization": {"stage": 2},
           "data_types": {"grad_accum_dtype": "fp32"}})
    lines = problems({"bf16": {"enabled": True}, "communication_data_type": "fp32", "zero_optimization": {"stage": 2},
                      "data_types": {"grad_accum_dtype": "bf16"}})
    assert lines[0].startswith("communication_data_type: got 'fp32'; allowed: 'bf16' (or null): zerort sends")
    assert lines[1].startswith("data_types.grad_accum_dtype: got 'bf16'; allowed: 'fp32' at stage 2")


def test_the_zerort_section_reaches_our_own_keys():
    c = parse({"zero_optimization": {"stage": 3}, "zerort": {
        "comm": {"timeout_s": 30, "debug": True}, "stage3": {"prefetch": 2, "unit_modules": ["Block"]},
        "fp32_modules": ["MyGate"], "max_consecutive_skips": 5}})
    assert (c.comm.timeout_s, c.comm.debug, c.stage3.prefetch, c.stage3.unit_modules, c.fp32_modules,
            c.max_consecutive_skips) == (30, True, 2, ("Block",), ("MyGate",), 5)
    (line,) = problems({"zero_optimization": {}, "zerort": {"stage": 2}})
    assert line.startswith("zerort.stage: unknown zerort key")


def test_two_of_the_batch_triple_give_the_third():
    c = parse({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {}})
    assert resolve_batch(c, 2).batch.gradient_accumulation_steps == 4
    c = parse({"train_batch_size": 32, "gradient_accumulation_steps": 2, "zero_optimization": {}})
    assert resolve_batch(c, 4).batch.train_micro_batch_size_per_gpu == 4
    c = parse({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "zero_optimization": {}})
    assert resolve_batch(c, 2).batch.train_batch_size == 12
    with pytest.raises(ConfigError, match=r"train_batch_size: got 30; it must be a multiple of .* = 8"):
        resolve_batch(parse({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {}}), 2)


def test_stage3_element_counts_become_units_ahead():
    c = parse({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 3000}})
    assert prefetch_units([1000, 1000, 1000, 1000], c) == 3
    c = parse({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 3000,
                                     "stage3_max_live_parameters": 2500}})
    assert prefetch_units([1000, 1000, 1000, 1000], c) == 1  # 2500 holds the running unit and one more
    c = parse({"zero_optimization": {"stage": 3}})
    assert prefetch_units([1000, 1000], c) == c.stage3.prefetch  # no DeepSpeed sizes: zerort's own count


def test_deepspeed_off_values_of_schedules_and_static_scale_rules():
    c = parse({"zero_optimization": {}, "scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_stair_count": 0, "cycle_second_stair_count": 0,
        "decay_step_size": 0, "cycle_second_step_size": 0}}})
    assert c.optimizer.scheduler["params"]["cycle_second_step_size"] == 0
    (line,) = problems({"zero_optimization": {}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})
    assert line.startswith("scheduler.params.warmup_num_steps: got 0; allowed: >= 1")
    # A fixed scale has no minimum to respect.
    parse({"fp16": {"enabled": True, "loss_scale": 1024, "initial_scale_power": 2, "min_loss_scale": 16}})
