"""The Python engine's API and edge cases, in one process (world size 1)."""
import math

import pytest
import torch
import torch.nn as nn

import zerort
from zerort.errors import ConfigError

INPROC = {"comm": {"backend": "inprocess"}}


class DictUnits(nn.Module):
    """Units that return a dict, a scaled buffer, and a LayerNorm (an FP32 module)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.b = nn.Linear(8, 2)
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, x):
        h = self.a(x * self.scale)
        out = {"h": self.norm(h)}
        return self.b(out["h"])


def train(stage, steps=4, config=None):
    model = DictUnits()
    e = zerort.initialize(model, dict({"stage": stage, "precision": "bf16", "optimizer": {"lr": 1e-2}},
                                      **INPROC, **(config or {})))
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
        e.backward(nn.functional.mse_loss(e(x).float(), y))
        e.step()
    return e, model


def test_all_stages_agree_with_dict_outputs_buffers_and_fp32_norms():
    base = train(0)[0].full_state_dict(master=True)
    for stage in (1, 2, 3):
        other = train(stage)[0].full_state_dict(master=True)
        for k in base:
            assert torch.equal(base[k], other[k]), (stage, k)


def test_stage3_frees_gathered_units_and_gathered_parameters_pins_them():
    e, model = train(3)
    assert [n for n in e.unit_names if n != "persistent"]  # units to free
    assert e._impl.gathered_bytes == 0  # every unit released after the step
    assert model.a.weight.numel() == 0  # sharded: this rank holds no whole weight
    with e.gathered_parameters():
        assert model.a.weight.shape == (8, 6)
        with torch.no_grad():
            e(torch.randn(2, 6))  # a forward inside must not free them
        assert model.a.weight.shape == (8, 6) and model.b.weight.shape == (2, 8)
    assert model.a.weight.numel() == 0
    full = e.full_state_dict()
    assert full["a.weight"].shape == (8, 6) and full["a.weight"].dtype == torch.bfloat16
    assert full["norm.weight"].dtype == torch.float32


def test_set_lr_checks_and_schedule_errors_leave_state_clean():
    e, _ = train(2, steps=1)
    with pytest.raises(ValueError, match="finite number"):
        e.set_lr(math.inf)
    e.set_lr(0.0)
    before = e.full_state_dict(master=True)
    x, y = torch.randn(4, 6), torch.randn(4, 2)
    e.backward(nn.functional.mse_loss(e(x).float(), y))
    e.step()
    after = e.full_state_dict(master=True)
    for k in before:  # lr 0 and no weight decay: nothing moves (Adam's state still does)
        assert torch.equal(before[k], after[k]), k

    bad = {"lr_schedule": lambda step: float("nan") if step == 2 else 1e-3}
    e, _ = train(2, steps=1, config=bad)
    with pytest.raises(RuntimeError, match="set_lr: this engine has an lr_schedule"):
        e.set_lr(1e-3)
    e.backward(nn.functional.mse_loss(e(x).float(), y))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\] = nan \(from the config's lr_schedule\)"):
        e.step()


def test_deepspeed_batch_size_is_checked_against_world_and_accumulation():
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    zerort.initialize(DictUnits(), ds, comm=zerort.comm.init("inprocess"))
    with pytest.raises(ConfigError, match=r"train_batch_size: got 16; .* = 8"):
        zerort.initialize(DictUnits(), dict(ds, train_batch_size=16), comm=zerort.comm.init("inprocess"))
    c = zerort.config.parse({"bf16": {"enabled": True}})
    assert (c.stage, c.optimizer.weight_decay) == (0, 0.0)  # DeepSpeed's defaults


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dropped_engine_is_freed_at_once_and_its_hooks_say_so(stage):
    """The model's hooks hold the engine weakly: with the garbage collector off, dropping the
    engine frees it (and its buffers, GPU memory on CUDA) at once, on the dropping thread.
    Using the model afterwards raises a clear error instead of training a dead engine."""
    import gc
    import weakref

    gc.disable()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
        engine = zerort.initialize(model, {"stage": stage})
        x = torch.randn(2, 4)
        engine.backward(engine(x).sum())
        engine.step()
        ref = weakref.ref(engine)
        del engine
        assert ref() is None
        if stage == 3:
            with pytest.raises(RuntimeError, match="engine this model was wrapped by has been deleted"):
                model(x)
    finally:
        gc.enable()


def test_nccl_on_a_machine_without_a_gpu_says_why():
    """This build has NCCL when nvcc was found; without a visible GPU the communicator fails
    with an error that says what is missing, and an engine of a CPU model asked for nccl
    names the config key before it tries."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: tests/gpu covers NCCL here")
    expected = "needs a CUDA device" if zerort._C.with_nccl else "not in this build"
    with pytest.raises(RuntimeError, match=expected):
        zerort.comm.init("nccl")
    with pytest.raises(ConfigError, match="comm.backend: got 'nccl' but the model is on cpu"):
        zerort.initialize(nn.Linear(3, 2), {"comm": {"backend": "nccl"}})
