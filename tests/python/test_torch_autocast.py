"""config autocast, DeepSpeed's torch_autocast: the keys in both forms, and training at W = 2
under torchrun (autocast_worker.py) against plain torch.autocast: FP32 parameters at stages 0-3
(every loss bit for bit, the masters within 1 FP32 step of torch.optim.AdamW's), and bf16
compute under autocast (the loss bit for bit)."""
import json
import os

import pytest
import torch

import zerort
from zerort.config import parse
from zerort._testing.launch import launch
from zerort.layout.precision import autocast_dtype

HERE = os.path.dirname(os.path.abspath(__file__))


def ds(section, **more):
    return parse({"zero_optimization": {"stage": 2}, "torch_autocast": section, **more}, form="deepspeed")


def test_the_keys_in_both_forms():
    assert ds({"enabled": True, "dtype": "bfloat16"}).autocast == "bf16"
    assert ds({"enabled": True, "dtype": "torch.bfloat16"}).precision == "fp32"  # DeepSpeed's FP32 parameters
    assert ds({"enabled": True}, bf16={"enabled": True}).autocast == "device"  # torch's default for the device
    assert ds({"enabled": False, "dtype": "fp16"}).autocast is None  # off: DeepSpeed takes any of its dtypes
    assert ds({"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear"]}).autocast == "device"
    assert parse({"autocast": "bf16", "precision": "fp32"}).autocast == "bf16"
    assert parse({"autocast": None}).autocast is None and parse({}).autocast is None


@pytest.mark.parametrize("cfg,match", [
    ({"torch_autocast": {"enabled": True, "dtype": "float16"}}, "torch_autocast.dtype: got 'float16'.*fp16.enabled"),
    ({"torch_autocast": {"enabled": True}, "fp16": {"enabled": True}}, "torch_autocast.enabled and fp16.enabled"),
    ({"autocast": "bf16", "precision": "fp16"}, "autocast: got 'bf16'; allowed: null with precision"),
])
def test_what_is_refused_names_the_key(cfg, match):
    with pytest.raises(zerort.errors.ConfigError, match=match):
        parse(cfg)


def test_the_device_default_is_refused_on_cuda_only():
    assert autocast_dtype("device", torch.device("cpu")) is torch.bfloat16
    assert autocast_dtype("bf16", torch.device("cuda")) is torch.bfloat16
    assert autocast_dtype(None, torch.device("cpu")) is None
    with pytest.raises(zerort.errors.ConfigError, match="set torch_autocast.dtype to \"bfloat16\""):
        autocast_dtype("device", torch.device("cuda"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("autocast") / "out"
    launch("torchrun", 2, os.path.join(HERE, "autocast_worker.py"), out, timeout=300)
    return json.loads(out.with_suffix(".json").read_text())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_parameters_under_autocast_train_as_plain_torch(trained, stage):
    r = trained[f"fp32-s{stage}"]
    print(f"stage {stage}: losses {r['losses']}, masters within {r['max_param_ulps']} FP32 steps "
          f"({r['max_param_diff']:.3g}) of torch.optim.AdamW's")
    assert r["losses"] == r["want_losses"]  # measured: equal at every step, every stage
    assert r["loss_dtype"] == "torch.float32"  # cross-entropy runs in FP32 under autocast
    assert r["accessors"] == [True, "torch.bfloat16"]  # DeepSpeed's torch_autocast_enabled() and _dtype()
    assert r["first_loss_without_autocast"] != r["losses"][0]  # the forward did run under autocast
    assert r["same_signs"] and r["max_param_ulps"] <= 1, r  # measured: 1 step (1.5e-8) after 4 updates


def test_bf16_compute_under_autocast_is_plain_autocast(trained):
    r = trained["bf16-s2"]
    assert r["loss"] == r["want"] != r["without_autocast"], r
