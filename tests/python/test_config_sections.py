"""The Config's shape: frozen sections, replace() by section, the flat names a checkpoint
saves (Note [saved config names]), and the C++ options built from the sections field by
field (zerort.config.native, Note [options by name])."""
import dataclasses

import pytest
import torch

from zerort import _C
from zerort.config import Config, native, parse, replace, resolve_batch, to_dict
from zerort.errors import ConfigError

# Every value differs from its default, so each C++ field shows where it came from.
OURS = {"stage": 3, "precision": "fp16", "reduce_bucket_numel": 999, "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5, "overlap_param_gather": True, "stage3": {"gather_dtype": "int8"},
        "optimizer": {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.2, "bias_correction": False,
                      "state_dtype": "bf16"},
        "loss_scale": {"initial_scale_power": 10, "window": 7, "hysteresis": 3, "min_scale": 2.0,
                       "consecutive_hysteresis": True},
        "offload": {"optimizer": {"device": "nvme", "nvme_path": "/states", "buffer_count": 6, "chunk_numel": 4096,
                                  "gradient_in_file": True},
                    "param": {"device": "nvme", "nvme_path": "/params"},
                    "aio": {"block_size": 1 << 16, "queue_depth": 4, "io_backend": "threads"}}}
# C++ fields no config key sets: the Engine sets replicated (stage 0) and alignment itself;
# DeepSpeed's scaler has no factor key. dynamic is at its default in OURS (see the static test),
# param_host follows offload_param "cpu" and the model's device (see the tier test). master_dtype
# bf16 needs precision bf16, and OURS is fp16 (tests/python/test_bf16_master.py sets it). ram_fraction
# excludes gradient_in_file, which OURS sets (test_offload_nvme's ram_fraction test sets it), and so does
# gradient_on_device (test_offload_nvme's gradient_on_device test sets it).
UNSET = {"OptimizerOptions.owner_ranks", "EngineOptions.alignment", "LossScalerOptions.factor",
         "LossScalerOptions.dynamic", "EngineOptions.param_host", "OptimizerOptions.master_dtype",
         "NvmeStateOptions.ram_fraction", "EngineOptions.gradient_on_device"}


def fields(o):
    return [n for n, v in vars(type(o)).items() if isinstance(v, property)]


def test_sections_are_frozen_and_replace_makes_a_new_config():
    c = parse(OURS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.optimizer.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.stage = 1
    d = replace(c, stage=2, stage3={"prefetch": 5})
    assert (d.stage, d.stage3.prefetch, d.stage3.persistence_threshold, d.optimizer) == (2, 5, 0, c.optimizer)
    assert (c.stage, c.stage3.prefetch) == (3, 1)


def test_a_checkpoint_saves_the_flat_names():
    d = to_dict(resolve_batch(parse(OURS), 2))
    assert {"lr", "betas", "optimizer_state_dtype", "loss_scale_window", "min_loss_scale", "static_loss_scale",
            "comm_backend", "comm_timeout_s", "comm_debug", "monitor_csv", "monitor_tensorboard", "prefetch",
            "gradient_accumulation_steps", "train_batch_size", "stage"} <= d.keys()
    assert (d["loss_scale_window"], d["min_loss_scale"], d["gradient_accumulation_steps"]) == (7, 2.0, 4)


def test_the_engine_options_are_the_sections_field_by_field():
    e = native.engine_options(parse(OURS), torch.device("cpu"))
    o, adamw, scale = e.optimizer, e.optimizer.adamw, e.optimizer.loss_scale
    assert (e.stage, e.reduce_bucket_numel) == (3, 999)
    assert (o.precision, o.state_dtype, o.gradient_clipping, o.gradient_accumulation_steps) == ("f16", "bf16", 0.5, 4)
    assert (adamw.lr, adamw.beta1, adamw.beta2, adamw.eps, adamw.weight_decay, adamw.bias_correction) == \
        (3e-4, 0.8, 0.9, 1e-6, 0.2, False)
    assert (scale.dynamic, scale.initial_scale, scale.window, scale.hysteresis, scale.min_scale,
            scale.consecutive_hysteresis) == (True, 1024.0, 7, 3, 2.0, True)
    static = native.loss_scaler_options(parse({"precision": "fp16", "loss_scale": {"static": 64}}).loss_scale)
    assert (static.dynamic, static.initial_scale) == (False, 64.0)


def test_every_cpp_option_has_a_config_key():
    built = native.engine_options(parse(OURS), torch.device("cpu"))
    structs = [("EngineOptions", built, _C.EngineOptions()),
               ("OptimizerOptions", built.optimizer, _C.OptimizerOptions()),
               ("AdamWHyper", built.optimizer.adamw, _C.AdamWHyper()),
               ("LossScalerOptions", built.optimizer.loss_scale, _C.LossScalerOptions()),
               ("NvmeStateOptions", built.nvme, _C.NvmeStateOptions())]
    for name, got, default in structs:
        for f in fields(got):
            if isinstance(getattr(got, f), (int, float, str, bool)) and f"{name}.{f}" not in UNSET:
                assert getattr(got, f) != getattr(default, f), f"{name}.{f} is not set from the Config"


def test_options_take_their_fields_as_keywords_and_refuse_others():
    o = _C.LossScalerOptions(window=5, min_scale=0.5)
    assert (o.window, o.min_scale, o.hysteresis) == (5, 0.5, _C.LossScalerOptions().hysteresis)
    with pytest.raises(ConfigError, match="LossScalerOptions: unknown keyword 'windw'"):
        _C.LossScalerOptions(windw=5)
    assert Config().batch.gradient_accumulation_steps == 1


def test_the_state_tier_follows_the_offload_device_and_the_models():
    """offload_optimizer 'cpu' is the 'cpu' tier beside a GPU model, and for a CPU model whose
    step is asked to overlap the next forward (overlap_step true); memory for a CPU model by
    default, where its states already are."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # a device value: no GPU is needed
    tier = lambda model, **o: native.engine_options(parse({"stage": 2, "offload": {"optimizer": o}}), model).state_tier
    assert tier(cpu, device="cpu") == "memory" and tier(cuda, device="cpu") == "cpu"
    assert tier(cpu, device="cpu", overlap_step=True) == "cpu"
    assert tier(cpu, device="cpu", overlap_step=False) == "memory" and tier(cuda, device="cpu", overlap_step=False) \
        == "cpu"
    assert tier(cpu, device="nvme", nvme_path="/tmp") == "nvme" and tier(cuda, device="none") == "memory"
    zero3 = parse({"stage": 3, "offload": {"optimizer": {"device": "cpu"}, "param": {"device": "cpu"}}})
    assert native.engine_options(zero3, cuda).param_host  # stage 3's shards in host memory beside the states
    assert not native.engine_options(zero3, cpu).param_host  # a CPU model's are there already
    zero3 = parse({"stage": 3, "offload": {"optimizer": {"device": "cpu", "overlap_step": True},
                                           "param": {"device": "cpu"}}})
    assert native.engine_options(zero3, cpu).param_host  # the 'cpu' tier's, a memcpy away on a CPU model
