"""Config parsing: our keys and DeepSpeed's JSON subset; every bad key is named, all at once."""
import json

import pytest

from zerort.config import parse
from zerort.errors import ConfigError


def problems(cfg):
    with pytest.raises(ConfigError) as e:
        parse(cfg)
    return e.value.problems


def test_defaults_and_our_keys():
    c = parse({"stage": 1, "precision": "fp16", "optimizer": {"lr": 3e-4, "betas": [0.8, 0.99]},
               "loss_scale": {"initial_scale_power": 12, "window": 50}, "gradient_clipping": 1.0,
               "comm": {"backend": "mpi", "timeout_s": 30}})
    assert (c.stage, c.precision, c.optimizer.lr, c.optimizer.betas) == (1, "fp16", 3e-4, (0.8, 0.99))
    assert (c.loss_scale.initial_scale_power, c.loss_scale.window, c.comm.backend, c.comm.timeout_s) == \
        (12, 50, "mpi", 30)
    assert parse(None).stage == 2


def test_deepspeed_json(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "gradient_clipping": 1.0, "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7},
          "fp16": {"enabled": True, "initial_scale_power": 14, "loss_scale_window": 500,
                   "hysteresis": 3, "min_loss_scale": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.05}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    c = parse(str(path))
    s = c.loss_scale
    assert (c.stage, c.precision, c.reduce_bucket_numel, s.initial_scale_power) == (3, "fp16", 50_000_000, 14)
    assert (s.window, s.hysteresis, s.min_scale, c.optimizer.lr, c.optimizer.weight_decay) == (500, 3, 2, 1e-4, 0.05)
    assert (c.batch.gradient_accumulation_steps, c.batch.train_micro_batch_size_per_gpu) == (2, 4)


def test_each_bad_key_is_named_with_value_and_allowed():
    p = problems({"stage": 4, "optimizer": {"lr": -1.0}, "precision": "int8", "bogus": 1})
    text = "\n".join(p)
    assert "stage: got 4; allowed: >= 0 and <= 3" in text
    assert "optimizer.lr: got -1.0; allowed: >= 0" in text
    assert "precision: got 'int8'; allowed: 'bf16' | 'fp16' | 'fp32'" in text
    assert "bogus: unknown or unsupported key" in text
    assert len(p) == 4  # all reported together


def test_deepspeed_bad_keys():
    text = "\n".join(problems({"bf16": {"enabled": True}, "fp16": {"enabled": True},
                               "zero_optimization": {"stage": 5, "offload_optimizer": {"device": "gpu"}},
                               "optimizer": {"type": "Lamb"}, "scheduler": {"type": "Noam"}}))
    assert "bf16.enabled and fp16.enabled: both true" in text
    assert "zero_optimization.stage: got 5" in text
    assert ("zero_optimization.offload_optimizer.device: got 'gpu'; allowed: 'none' | 'cpu' | 'nvme'") in text
    assert "optimizer.type: got 'Lamb'" in text
    assert "scheduler.type: got 'Noam'; allowed: 'WarmupLR' | " in text


def test_bad_files(tmp_path):
    assert "No such file" in problems(str(tmp_path / "missing.json"))[0]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not valid JSON" in problems(str(bad))[0]


def test_fp32_modules_adds_and_removes_in_both_spellings():
    assert parse({}).fp32_modules == ()  # the norm rule alone (zerort.layout.precision)
    change = ["MoEGate", "-BatchNorm2d"]
    change_t = tuple(change)
    assert parse({"fp32_modules": change}).fp32_modules == ("MoEGate", "-BatchNorm2d")
    assert parse({"bf16": {"enabled": True}, "zerort": {"fp32_modules": change}}).fp32_modules == change_t
    (line,) = problems({"zero_optimization": {"stage": 2}, "zerort": {"fp32_modules": ["LayerNorm", "-LayerNorm"]}})
    assert line == ("zerort.fp32_modules: got ['LayerNorm', '-LayerNorm']; allowed: each class added or removed, "
                    "not both: LayerNorm")
    (line,) = problems({"fp32_modules": ["torch.nn.LayerNorm"]})
    assert line.startswith("fp32_modules: got ['torch.nn.LayerNorm']; allowed: a list of module class names")
    assert "not a dotted path" in line
