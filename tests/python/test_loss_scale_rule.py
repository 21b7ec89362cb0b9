"""The fp16 dynamic loss scale through the real engine (W = 1, one process), step by step,
against DeepSpeed >= 0.17.1's rule (its PR #6976): the window counts clean steps from the
step after the last overflow, so the scale first doubles on the (window + 1)-th clean step
in a row. Before that change zerort doubled one step early (from 2^8 with window 2, ten
clean steps read 256, 512, 512, 1024, ..., 8192).

The table holds every trajectory that DeepSpeed's tests state for the loss scale,
written out as numbers: tests/unit/runtime/half_precision/test_dynamic_loss_scale.py
(TestFused, TestUnfused) and test_zero_optim_overflow.py (TestZeROFloat16, ZeRO 1 and 2).
DeepSpeed's fused and unfused FP16 optimizers have no hysteresis (hysteresis 1 here) and
stay at min_loss_scale; ZeRO's DynamicLossScaler, like zerort, raises on an overflow with
the scale already at the minimum, so those runs end in an error here at the step noted.
Those tests do not cover hysteresis > 1; the last two rows are derived by hand from
DeepSpeed's DynamicLossScaler.update_scale. tests/cpp/test_loss_scaler.cpp checks the
same table on the C++ scaler alone. Each run uses both config spellings: ours
(loss_scale.*) and DeepSpeed's fp16 block."""
import math

import pytest
import torch
import torch.nn as nn

import zerort
from zerort.errors import NonFiniteError

# name: (initial_scale_power, window, hysteresis, min scale, consecutive_hysteresis,
#        events: 'C' clean, 'O' overflow, one per step,
#        the scale read after each step; when shorter than events, the next step raises)
TRAJECTORIES = {
    # test_no_overflow (fused, unfused; ZeRO with the default hysteresis 2); the example
    "no_overflow": (8, 2, 2, 1, False, "CCCCCCCCCC", [256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096, 4096]),
    "no_overflow_hysteresis1": (8, 2, 1, 1, False, "CCCCCCCCCC",
                                [256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096, 4096]),
    # test_some_overflow: 2 overflows (256 / 4 = 64), window + 1 clean steps (64 x 2 = 128),
    # 1 overflow (64); DeepSpeed checks the scale at the end of each of the three runs.
    "some_overflow": (8, 2, 1, 1, False, "OOCCCO", [128, 64, 64, 64, 128, 64]),
    # TestZeROFloat16.test_all_overflow: 8 overflows halve 2^8 down to the minimum 1, no error
    "zero_all_overflow": (8, 2, 1, 1, False, "OOOOOOOO", [128, 64, 32, 16, 8, 4, 2, 1]),
    # TestFused.test_all_overflow (DeepSpeed's FP16_Optimizer: 8, 4, 2, 1, 1, 1, 1, 1)
    "fused_all_overflow": (4, 2, 1, 1, False, "OOOOOOOO", [8, 4, 2, 1]),
    # TestUnfused.test_all_overflow, min_loss_scale 2 (FP16_UnfusedOptimizer: 8, 4, 2, 2, 2, 2, 2, 2)
    "unfused_all_overflow": (4, 2, 1, 2, False, "OOOOOOOO", [8, 4, 2]),
    # hysteresis 2 absorbs one overflow; only a doubling refills it ...
    "hysteresis2": (8, 2, 2, 1, False, "OOCCCOCCOO", [256, 128, 128, 128, 256, 256, 256, 256, 128, 64]),
    # ... or, with consecutive_hysteresis, every clean step
    "hysteresis2_consecutive": (8, 2, 2, 1, True, "OOCCCOCCOO", [256, 128, 128, 128, 256, 256, 256, 256, 256, 128]),
}

OVERFLOWS = (math.inf, -math.inf, math.nan)  # as DeepSpeed's tests: +inf, -inf and NaN in turn


def config(spelling, stage, power, window, hysteresis, min_scale, consecutive):
    if spelling == "ours":
        return {"stage": stage, "precision": "fp16", "optimizer": {"lr": 1e-3}, "comm": {"backend": "inprocess"},
                "loss_scale": {"initial_scale_power": power, "window": window, "hysteresis": hysteresis,
                               "min_scale": min_scale, "consecutive_hysteresis": consecutive}}
    return {"zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "fp16": {"enabled": True, "initial_scale_power": power, "loss_scale_window": window,
                     "hysteresis": hysteresis, "min_loss_scale": min_scale, "consecutive_hysteresis": consecutive}}


def make_engine(spelling, stage, name):
    power, window, hysteresis, min_scale, consecutive, *_ = TRAJECTORIES[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    engine = zerort.initialize(model, config(spelling, stage, power, window, hysteresis, min_scale, consecutive))
    assert engine.config.precision == "fp16" and engine.loss_scale == 2.0 ** power
    return engine


def drive(engine, name, begin=0, end=None):
    """Steps begin..end of the trajectory: the scales read after each engine.step(), and
    (step, message) of the step that raised."""
    events = TRAJECTORIES[name][5]
    overflows = events[:begin].count("O")
    scales = []
    for step in range(begin, len(events) if end is None else end):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)
        loss = nn.functional.mse_loss(engine(x).float(), y)
        if events[step] == "O":
            loss = loss * OVERFLOWS[overflows % len(OVERFLOWS)]
            overflows += 1
        engine.backward(loss)
        try:
            s = engine.step()
        except NonFiniteError as e:
            return scales, (step + 1, str(e))
        assert s["boundary"] and s["skipped"] == (events[step] == "O"), (name, step, s)
        assert engine.skipped_steps == overflows and engine.global_step == step + 1
        scales.append(engine.loss_scale)
    return scales, None


def check(spelling, stage, name):
    *_, events, want = TRAJECTORIES[name]
    scales, error = drive(make_engine(spelling, stage, name), name)
    assert scales == want, (name, spelling, stage, scales)
    if len(want) < len(events):
        step, message = error
        min_scale = TRAJECTORIES[name][3]
        assert step == len(want) + 1, (name, message)
        assert (f"gradients overflowed at step {step} with the loss scale already at its minimum {min_scale:g}"
                in message)
    else:
        assert error is None, error


@pytest.mark.parametrize("spelling", ["ours", "deepspeed"])
@pytest.mark.parametrize("name", list(TRAJECTORIES))
def test_deepspeed_trajectories(name, spelling):
    check(spelling, 2, name)


@pytest.mark.parametrize("spelling", ["ours", "deepspeed"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["no_overflow", "hysteresis2"])
def test_every_stage_follows_the_rule(name, stage, spelling):
    check(spelling, stage, name)  # stage 3 runs python/zerort/engine/stage3.py over the same ShardOptimizer


def test_the_default_window_doubles_on_the_1001st_clean_step():
    model = nn.Linear(2, 1)
    nn.init.zeros_(model.weight), nn.init.zeros_(model.bias)  # zero gradients: never an overflow at 2^16
    engine = zerort.initialize(model, {"precision": "fp16", "stage": 1, "comm": {"backend": "inprocess"}})
    assert engine.loss_scale == 2.0 ** 16
    x, y = torch.ones(1, 2), torch.zeros(1, 1)
    for step in range(1, 1002):
        engine.backward(nn.functional.mse_loss(engine(x).float(), y))
        engine.step()
        assert engine.loss_scale == 2.0 ** (17 if step == 1001 else 16), step


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name,split", [("no_overflow", 3), ("hysteresis2", 3), ("hysteresis2", 6),
                                        ("hysteresis2_consecutive", 6)])
def test_a_checkpoint_resumes_the_scaler_mid_trajectory(tmp_path, name, split, stage):
    # Saved mid-window (step 3) or right after an overflow that hysteresis absorbed (step 6):
    # the loaded engine continues the same trajectory (window count, hysteresis left).
    want = TRAJECTORIES[name][6]
    first = make_engine("ours", stage, name)
    assert drive(first, name, 0, split) == (want[:split], None)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    second = make_engine("deepspeed", stage, name)
    second.load_checkpoint(str(tmp_path / "ckpt"))
    assert (second.loss_scale, second.global_step) == (want[split - 1], split)
    assert drive(second, name, split) == (want[split:], None)
