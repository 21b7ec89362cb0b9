"""DeepSpeed's config semantics where it is lenient on purpose (zerort.config.lenient;
docs/DEEPSPEED.md, "Where DeepSpeed is lenient"): each key DeepSpeed 0.19.8 accepts and does
nothing with is accepted in DeepSpeed's form, changes nothing in the Config (but its
`ignored`) nor in what trains (a W = 1 run with and without it gives the same bits), and
rank 0's banner names it; each refusal kept still names its key. DeepSpeed-Chat's
get_train_ds_config (offload_param written at every stage) at ZeRO-2 with --offload runs at
W = 2 to the bits of the same config without offload_param (lenient_worker.py)."""
import copy
import functools
import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from engine_models import batch, loss_fn, make_model  # noqa: E402

from zerort._testing.launch import launch  # noqa: E402
from zerort.config import Config, parse, replace  # noqa: E402
from zerort.errors import ConfigError  # noqa: E402

INPROC = {"zerort": {"comm": {"backend": "inprocess"}}}


def merged(base, extra):
    """base with extra's keys put in, section by section (copies)."""
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = merged(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def base(stage):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}}


Z = "zero_optimization."
# (stage, the keys added to base(stage), the key path the banner names): each a key DeepSpeed
# reads and does nothing with in that config.
LENIENT = {
    "offload_param-z0": (0, {"zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True}}},
                         Z + "offload_param.device"),
    "offload_param-z1": (1, {"zero_optimization": {"offload_param": {"device": "cpu"}}}, Z + "offload_param.device"),
    "offload_param-nvme-z2": (2, {"zero_optimization": {"offload_param": {"device": "nvme", "buffer_count": 3}}},
                              Z + "offload_param.device"),  # no nvme_path: DeepSpeed never reads the section
    "cpu_offload_param-z2": (2, {"zero_optimization": {"cpu_offload_param": True}}, Z + "cpu_offload_param"),
    "offload_optimizer-z0": (0, {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}},
                             Z + "offload_optimizer.device"),
    "offload_optimizer-nvme-z0": (0, {"zero_optimization": {"offload_optimizer": {
        "device": "nvme", "nvme_path": "/nonexistent", "buffer_count": 0}}}, Z + "offload_optimizer.device"),
    "cpu_offload-z0": (0, {"zero_optimization": {"cpu_offload": True}}, Z + "cpu_offload"),
    "zero_quantized_weights-z2": (2, {"zero_optimization": {"zero_quantized_weights": True}},
                                  Z + "zero_quantized_weights"),
    "zero_quantized_gradients-z1": (1, {"zero_optimization": {"zero_quantized_gradients": True}},
                                    Z + "zero_quantized_gradients"),
    "zero_hpz_partition_size-z2": (2, {"zero_optimization": {"zero_hpz_partition_size": 2}},
                                   Z + "zero_hpz_partition_size"),  # 2 does not divide W = 1: never read
    "zero_quantized_nontrainable_weights-z2": (2, {"zero_optimization": {"zero_quantized_nontrainable_weights": True}},
                                               Z + "zero_quantized_nontrainable_weights"),
    "leaf_module-z1": (1, {"zero_optimization": {"leaf_module": {"classes": ["TransformerEncoderLayer"]}}},
                       Z + "leaf_module"),
    "dump_state": (3, {"dump_state": True}, "dump_state"),
    "memory_breakdown": (2, {"memory_breakdown": True}, "memory_breakdown"),
    "flops_profiler": (1, {"flops_profiler": {"enabled": True, "profile_step": 1, "detailed": True}},
                       "flops_profiler"),
    "wandb": (2, {"wandb": {"enabled": True, "project": "p", "group": "g"}}, "wandb"),
    "comet": (0, {"comet": {"enabled": True, "project": "p"}}, "comet"),
    "comms_logger": (3, {"comms_logger": {"enabled": True, "verbose": True, "prof_all": True}}, "comms_logger"),
    "use_data_before_expert_parallelism": (2, {"use_data_before_expert_parallelism": True},
                                           "use_data_before_expert_parallelism"),
    "fp32_optimizer_states": (2, {"optimizer": {"params": {"fp32_optimizer_states": False}}},
                              "optimizer.params.fp32_optimizer_states"),
    "pipeline": (2, {"pipeline": {"stages": 2, "partition": "best", "seed_layers": False}}, "pipeline"),
    "checkpoint.parallel_write": (1, {"checkpoint": {"parallel_write": {"pipeline_stage": True}}},
                                  "checkpoint.parallel_write"),
    "activation_checkpointing": (3, {"activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
        "number_checkpoints": 2, "synchronize_checkpoint_boundary": True, "profile": True}},
        "activation_checkpointing.partition_activations"),
}


@pytest.mark.parametrize("name", list(LENIENT))
def test_each_lenient_key_is_accepted_and_changes_nothing_in_the_config(name):
    stage, extra, key = LENIENT[name]
    plain, lenient = parse(base(stage)), parse(merged(base(stage), extra))
    assert plain.ignored == ()
    assert any(line.startswith(f"{key} ") for line in lenient.ignored), lenient.ignored
    assert replace(lenient, ignored=()) == plain  # the tier, the wire, the shards: all as without the key


def ds_chat_train(offload, dtype, stage):
    """A config of the shape DeepSpeed-Chat's get_train_ds_config builds (dschat/utils/ds_utils.py;
    our own values): offload_param and offload_optimizer written at every stage, "none" unless
    --offload; the precision section "bfloat16" for bf16; the hybrid engine and TensorBoard off."""
    device = "cpu" if offload else "none"
    precision = {"fp16": {"enabled": True, "loss_scale_window": 100}} if dtype == "fp16" else \
        {"bfloat16": {"enabled": True}}
    return {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10,
            "zero_optimization": {"stage": stage, "overlap_comm": True, "offload_param": {"device": device},
                                  "offload_optimizer": {"device": device},
                                  "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e7,
                                  "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False},
            **precision, "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
            "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                              "release_inference_cache": False, "pin_parameters": True,
                              "tp_gather_partition_size": 8},
            "tensorboard": {"enabled": False, "output_path": "/tmp/unused/ds_tensorboard_logs/",
                            "job_name": "step1_tensorboard"}}


def ds_chat_eval(offload, dtype, stage=0):
    """The shape of DeepSpeed-Chat's get_eval_ds_config: offload_param alone, at stage 0 by default."""
    cfg = ds_chat_train(offload, dtype, stage)
    for k in ("hybrid_engine", "tensorboard"):
        del cfg[k]
    cfg["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 1e4,
                                "offload_param": {"device": "cpu" if offload else "none"},
                                "memory_efficient_linear": False}
    return cfg


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_deepspeed_chat_configs_parse_at_every_stage_with_and_without_offload(dtype):
    for stage in range(4):
        off, on = parse(ds_chat_train(False, dtype, stage)), parse(ds_chat_train(True, dtype, stage))
        assert off.ignored == () and (off.offload.optimizer.device, off.offload.param.device) == ("none", "none")
        tiers = (on.offload.optimizer.device, on.offload.param.device)
        named = sorted(line.split(" ")[0] for line in on.ignored)
        if stage == 3:
            assert tiers == ("cpu", "cpu") and named == []
        elif stage > 0:
            assert tiers == ("cpu", "none") and named == [Z + "offload_param.device"]
        else:
            assert tiers == ("none", "none") and named == [Z + "offload_optimizer.device", Z + "offload_param.device"]
        assert replace(on, ignored=(), offload=Config().offload) == off  # nothing else moved
        evaluation = parse(ds_chat_eval(True, dtype, stage))
        assert (evaluation.offload.param.device == "cpu") == (stage == 3)


def test_ignored_tiers_reach_no_tier_check_estimate_or_description():
    from zerort.accounting.nvme_tier import NvmeTier
    from zerort.config.offload import check_tier, describe

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")  # a device value: no GPU is needed to decide
    for cfg in ({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}},
                {"zero_optimization": {"stage": 2, "cpu_offload_param": True}},
                {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"},
                                       "offload_param": {"device": "nvme", "nvme_path": "/n"}}},
                {"zero_optimization": {"stage": 0, "cpu_offload": True, "cpu_offload_param": True}}):
        c = parse(cfg)
        assert c.offload == Config().offload, cfg
        check_tier(c, cuda)  # a CUDA model's host or NVMe tiers are refused when they are real: here none is
        assert describe(c, cpu) == describe(c, cuda) == "offload none"
        assert NvmeTier.of(c) is None  # the estimator's NVMe tier


def test_refusals_kept_still_name_the_key():
    def problems(cfg):
        with pytest.raises(ConfigError) as e:
            parse(cfg)
        return e.value.problems

    # DeepSpeed asserts a partial optimizer offload below stage 3, at stage 0 too.
    for stage in (0, 2):
        (line,) = problems({"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu",
                                                                                      "ratio": 0.5}}})
        assert line.startswith(Z + "offload_optimizer.ratio: got 0.5") and "stage 3 only" in line
    # Stage 3 reads these, and zerort does not build them.
    for key, value in (("zero_quantized_nontrainable_weights", True), ("leaf_module", {"classes": ["Linear"]})):
        (line,) = problems({"zero_optimization": {"stage": 3, key: value}})
        assert line.startswith(f"{Z}{key}: got ") and "zerort does not support" in line
    # The legacy key with the key that replaces it: DeepSpeed refuses the pair at every stage.
    (line,) = problems({"zero_optimization": {"stage": 1, "cpu_offload_param": True,
                                              "offload_param": {"device": "cpu"}}})
    assert line.startswith(Z + "cpu_offload_param: given with " + Z + "offload_param")
    # An ignored key still has its type.
    (line,) = problems({"optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": "no"}}})
    assert line.startswith("optimizer.params.fp32_optimizer_states: got 'no' (a str)")
    # zerort's own form is not DeepSpeed's: a tier at a stage that has none stays an error there.
    (line,) = problems({"stage": 2, "offload": {"param": {"device": "cpu"}}})
    assert line.startswith("offload.param.device: got 'cpu' at stage 2; parameter offload works at stage 3 only")
    (line,) = problems({"stage": 0, "offload": {"optimizer": {"device": "cpu"}}})
    assert line.startswith("offload.optimizer.device: got 'cpu' at stage 0; optimizer offload works at stages 1-3")


def train_w1(config, steps=2):
    """FP32 masters after `steps` updates of the tiny transformer at W = 1 through
    zerort.integrations.deepspeed.initialize, the engine's config and its memory report."""
    import zerort.integrations.deepspeed as deepspeed

    engine, _, _, _ = deepspeed.initialize(model=make_model("tiny"), config=merged(config, INPROC))
    for i in range(steps * engine.gradient_accumulation_steps()):
        x, y = batch("tiny", i, 0, 0, size=engine.train_micro_batch_size_per_gpu())
        engine.backward(loss_fn("tiny", engine(x), y))
        engine.step()
    masters, config, report = engine.full_state_dict(master=True), engine.config, engine.memory_report().table()
    engine.destroy()
    return masters, config, report


@functools.lru_cache(maxsize=None)
def plain_w1(stage):
    return train_w1(base(stage))[0]


@pytest.mark.parametrize("name", list(LENIENT))
def test_each_lenient_key_trains_the_same_bits_and_the_banner_names_it(name, capsys):
    stage, extra, key = LENIENT[name]
    plain = plain_w1(stage)
    capsys.readouterr()
    lenient, config, report = train_w1(merged(base(stage), extra))
    out = capsys.readouterr().out
    assert plain.keys() == lenient.keys() and all(torch.equal(plain[k], lenient[k]) for k in plain), name
    banner = [line for line in out.splitlines() if line.startswith("zerort: ")]
    assert banner[0].startswith(f"zerort: ZeRO stage {stage}, bf16, W=1") and "offload none" in banner[0], banner
    assert any(line.startswith(f"zerort: ignored {key} ") for line in banner[1:]), banner
    assert len(banner) == 1 + len(config.ignored)
    assert "offload none" in report and " on cpu" not in report and " on nvme" not in report, report


def test_deepspeed_chat_zero2_with_offload_trains_as_without_offload_param_at_w2(tmp_path):
    """DeepSpeed-Chat's sweep runs step 1 at ZeRO-2 with --offload; DeepSpeed ignores its
    offload_param there. The run equals the same config without offload_param, and without
    any offload (a CPU model's states are in host memory already), bit for bit."""
    as_is = ds_chat_train(True, "bf16", 2)
    no_param = copy.deepcopy(as_is)
    del no_param["zero_optimization"]["offload_param"]
    configs = {"as_is": as_is, "no_offload_param": no_param, "no_offload": ds_chat_train(False, "bf16", 2)}
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(configs))
    out = launch("torchrun", 2, os.path.join(HERE, "lenient_worker.py"), tmp_path / "masters.pt", path,
                 timeout=600).stdout
    masters = torch.load(tmp_path / "masters.pt")
    for name in ("no_offload_param", "no_offload"):
        assert all(torch.equal(masters["as_is"][k], masters[name][k]) for k in masters["as_is"]), name
    runs = dict(part.split("\n", 1) for part in out.split("== ")[1:])
    ignored = [line for line in runs["as_is"].splitlines() if line.startswith("zerort: ignored")]
    assert ignored == ["zerort: ignored zero_optimization.offload_param.device 'cpu': DeepSpeed offloads "
                       "parameters at stage 3 only and does not read the key at stage 2; the parameters stay "
                       "with the model"], runs["as_is"]
    assert "zerort: ZeRO stage 2, bf16, W=2" in runs["as_is"] and "offload optimizer states on cpu" in runs["as_is"]
    assert not any("zerort: ignored" in runs[name] for name in ("no_offload_param", "no_offload"))
