"""HuggingFace's DeepSpeed test configs, ds_config_zero2.json and ds_config_zero3.json (CPU
offload on, "auto" values), run unchanged on a CPU GPT2 at W = 2 (hf_offload_worker.py):
under zerort.integrations.hf.Trainer, which fills the "auto" values, and under
zerort.integrations.deepspeed.initialize with the "auto" values filled as HuggingFace fills
them. For a CPU model device "cpu" is where the states already are (See Note [offload
tiers]), so each run equals the same run with the offload sections removed bit for bit, and
the log line and the memory report say where the states are.

The files themselves are read from /work/shared/reference/hf-deepspeed-configs when that
folder exists (the test is skipped, saying why, where it does not); the same key sets built
here (the files' keys and "auto" values, our own numbers elsewhere) run everywhere.
"""
import json
import os
import sys

import pytest
import torch

pytest.importorskip("accelerate")  # transformers' Trainer needs it (requirements.txt pins it)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zerort._testing.launch import launch  # noqa: E402

REFERENCE = "/work/shared/reference/hf-deepspeed-configs"
FILES = {name: os.path.join(REFERENCE, f"ds_config_{name}.json") for name in ("zero2", "zero3")}
STATED = "offload optimizer states on cpu"
CPU_MODEL = "(a CPU model: host memory is where they already are)"


def hf_zero2():
    """The keys of ds_config_zero2.json, "auto" where it has "auto"; the other values our own."""
    return {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 500, "initial_scale_power": 12,
                     "hysteresis": 2, "min_loss_scale": 1},
            "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
            "scheduler": {"type": "WarmupLR", "params": {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr",
                                                                             "warmup_num_steps")}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "allgather_partitions": True, "allgather_bucket_size": 1e8, "overlap_comm": True,
                                  "reduce_scatter": True, "reduce_bucket_size": 3e7, "contiguous_gradients": True},
            **{k: "auto" for k in ("gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                                   "train_micro_batch_size_per_gpu")},
            "steps_per_print": 1000, "wall_clock_breakdown": False}


def hf_zero3():
    """The keys of ds_config_zero3.json likewise."""
    cfg = hf_zero2()
    del cfg["bf16"]
    cfg["zero_optimization"] = {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e13, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e8,
        "stage3_max_reuse_distance": 1e8, "stage3_gather_fp16_weights_on_model_save": True}
    return cfg


def run(tmp_path, configs):
    with open(tmp_path / "configs.json", "w") as f:
        json.dump(configs, f)
    done = launch("torchrun", 2, os.path.join(HERE, "hf_offload_worker.py"), tmp_path / "out",
                  tmp_path / "configs.json", timeout=600)
    with open(tmp_path / "out.json") as f:
        return json.load(f), torch.load(tmp_path / "out.pt"), done.output


def check(result, masters, output, names):
    for name in names:
        for side in ("trainer", "deepspeed"):
            as_is, bare = result[f"{side}:{name}:as_is"], result[f"{side}:{name}:no_offload"]
            assert len(as_is["losses"]) == 3 * (2 if side == "deepspeed" else 1), as_is
            assert as_is["losses"] == bare["losses"], (side, name)
            a, b = masters[f"{side}:{name}:as_is"], masters[f"{side}:{name}:no_offload"]
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (side, name)
            assert f"{STATED}" in as_is["report"] and CPU_MODEL in as_is["report"], as_is["report"]
            assert "offload none" in bare["report"] and STATED not in bare["report"]
        assert result[f"deepspeed:{name}:as_is"]["stage"] == {"zero2": 2, "zero3": 3}[name]
    assert "zero3" not in names or "stage-3 parameters on cpu" in result["trainer:zero3:as_is"]["report"]
    # rank 0's line at initialize, once per engine: 2 sides x the configs with offload
    assert output.count(f"{STATED}") == 2 * len(names), output[-3000:]


def test_the_key_sets_built_here_run_with_cpu_offload_as_without(tmp_path):
    result, masters, output = run(tmp_path, {"zero2": hf_zero2(), "zero3": hf_zero3()})
    check(result, masters, output, ("zero2", "zero3"))


def keys(d, prefix=""):
    """Every key path of d, with its value when the value is "auto"."""
    return {k for name, v in d.items() for k in (keys(v, f"{prefix}{name}.") if isinstance(v, dict) and v else
                                                 {prefix + name + (": auto" if v == "auto" else "")})}


@pytest.mark.skipif(not all(map(os.path.exists, FILES.values())),
                    reason=f"HuggingFace's config files are not here ({REFERENCE}): the key sets built in this file "
                           "run instead")
def test_huggingfaces_files_as_they_are_run_with_cpu_offload_as_without(tmp_path):
    for name, make in (("zero2", hf_zero2), ("zero3", hf_zero3)):
        with open(FILES[name]) as f:
            assert keys(json.load(f)) == keys(make()), name  # the key sets built here are the files'
    result, masters, output = run(tmp_path, FILES)
    check(result, masters, output, ("zero2", "zero3"))


def test_tiers_not_built_are_refused_naming_the_key_and_what_to_do():
    from zerort.config import parse
    from zerort.config.offload import check_tier
    from zerort.errors import ConfigError

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # a device value: no GPU is needed to decide
    zero3 = parse({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                         "offload_param": {"device": "cpu"}}})
    check_tier(zero3, cpu)  # a CPU model: accepted
    check_tier(parse({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}), cuda)  # built:
    check_tier(zero3, cuda)  # the Engine's 'cpu' tier, with param_host (tests/cpp/test_engine_host_tier.cpp)
    with pytest.raises(ConfigError) as e:
        check_tier(parse({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}), cuda)
    par, = e.value.problems
    assert par.startswith("zero_optimization.offload_param.device (") and "got 'cpu'" in par, par
    assert "with offload_optimizer.device 'none'; for a model on cuda:0" in par
    assert "set zero_optimization.offload_optimizer.device to 'cpu' too" in par
    nvme = parse({"stage": 2, "offload": {"optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})
    check_tier(nvme, cpu)  # a CPU model's optimizer states on NVMe: built (tests/python/test_offload_nvme.py)
    check_tier(nvme, cuda)  # the same tier beside a GPU model (tests/gpu/test_offload_overlap_gpu.py)
    nvme_param = parse({"stage": 3, "offload": {"param": {"device": "nvme", "nvme_path": "/tmp"}}})
    with pytest.raises(ConfigError, match=r"offload_param.device: got 'nvme' with offload_optimizer.device 'none'; "
                                          r"with the optimizer states in memory, stage 3 gathers"):
        check_tier(nvme_param, cpu)
    both = parse({"stage": 3, "offload": {"param": {"device": "nvme", "nvme_path": "/tmp"},
                                          "optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})
    check_tier(both, cpu)  # built: tests/python/test_offload_nvme.py
    check_tier(both, cuda)  # built: tests/gpu/test_offload_overlap_gpu.py
    with pytest.raises(ConfigError, match=r"ratio: got 0.5 with device 'nvme'; a partial NVMe offload with the rest "
                                          r"on the model's device is not built yet.*ram_fraction keeps a part in host"):
        check_tier(parse({"stage": 3, "offload": {"optimizer": {"device": "nvme", "nvme_path": "/tmp",
                                                                "ratio": 0.5}}}), cuda)
    check_tier(parse({"offload": {"optimizer": {"device": "none"}}}), cuda)  # none: today's path


def test_both_forms_and_the_legacy_keys_read_the_same_offload_section():
    from zerort.config import Config, ConfigError, parse, replace

    ds = parse({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n",
                                                                       "buffer_count": 6, "ratio": 0.5},
                                      "offload_param": {"device": "cpu", "buffer_size": 1e7}},
                "aio": {"block_size": 262144, "queue_depth": 16, "use_gds": False}})
    ours = parse({"stage": 3, "offload": {"optimizer": {"device": "nvme", "nvme_path": "/n", "buffer_count": 6,
                                                        "ratio": 0.5},
                                          "param": {"device": "cpu", "buffer_size": 10_000_000},
                                          "aio": {"block_size": 262144, "queue_depth": 16, "use_gds": False}}})
    assert ds.offload == ours.offload and ds.offload.param.max_in_cpu == 1_000_000_000  # DeepSpeed's default
    assert replace(Config(stage=3), offload={"optimizer": {"device": "nvme", "nvme_path": "/n", "buffer_count": 6,
                                                           "ratio": 0.5}}).offload.optimizer == ours.offload.optimizer
    legacy = parse({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                          "cpu_offload_use_pin_memory": False}}).offload
    assert (legacy.optimizer.device, legacy.param.device, legacy.optimizer.pin_memory) == ("cpu", "cpu", True)
    assert parse({"zero_optimization": {"stage": 2, "offload_optimizer": None}, "aio": None}).offload == \
        Config().offload  # null sections are absent ones, as in DeepSpeed
    with pytest.raises(ConfigError) as e:
        parse({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "ratio": 0.5}},
               "aio": {"use_gds": True}})
    assert sorted(ln.split(":")[0] for ln in e.value.problems) == [
        "aio.use_gds", "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_optimizer.ratio"]
    with pytest.raises(ConfigError) as e:  # zerort's own key, in either form: only with the states on NVMe
        parse({"stage": 2, "offload": {"optimizer": {"device": "cpu", "gradient_in_file": True}}})
    (line,) = e.value.problems
    assert line.startswith("offload.optimizer.gradient_in_file: true with device 'cpu'") and "device 'nvme'" in line
    assert parse({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/n", "gradient_in_file": True}}}).offload.optimizer.gradient_in_file
