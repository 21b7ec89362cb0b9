"""Learning-rate schedules on engine.optimizer, in one process.

DeepSpeed's five schedules from the config, each against its formula written out here
(DeepSpeed's documented formulas and step semantics: built at iteration -1, stepped after
every applied update, so Adam step n runs at iteration n - 2), including a resume from a
checkpoint mid-warm-up; a skipped step does not advance the schedule; and torch's own
LRSchedulers built on engine.optimizer drive the lr exactly as on torch.optim.AdamW.
"""
import math

import pytest
import torch
import torch.nn as nn

import zerort

INPROC = {"comm": {"backend": "inprocess"}}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def groups(m):
    return [{"params": [p for p in m.parameters() if p.ndim > 1], "lr": 2e-2},
            {"params": [p for p in m.parameters() if p.ndim == 1], "lr": 1e-2, "weight_decay": 0.0}]


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def engine(scheduler, stage=2, precision="fp32", **extra):
    m = model()
    cfg = dict({"stage": stage, "precision": precision, "scheduler": scheduler}, **INPROC, **extra)
    return zerort.initialize(m, cfg, param_groups=groups(m)), m


def run(e, steps, start=0, poison=()):
    """The lr of every group at each Adam step (read before the step)."""
    lrs = []
    for step in range(start, start + steps):
        lrs.append(e.get_lr())
        x, y = batch(step)
        loss = nn.functional.mse_loss(e(x).float(), y)
        e.backward(loss * math.inf if step in poison else loss)
        e.step()
    return lrs


def flat(lrs):
    return [lr for step in lrs for lr in step]


def iteration(n):
    return n - 2  # the schedule's iteration when Adam step n (1-based) runs


def warm(i, w, kind):
    return math.log(i + 1) / math.log(w) if kind == "log" else i / w


# name: (config params, lr of group k at Adam step n)
def warmup_lr(n, k, lo=1e-4, hi=(5e-3, 2e-3), w=5, kind="log"):
    i = iteration(n)
    return lo if i < 0 else lo + (hi[k] - lo) * (warm(i, w, kind) if i < w else 1.0)


def warmup_decay_lr(n, k, lo=0.0, hi=3e-3, w=4, total=10, kind="linear"):
    i = iteration(n)
    if i < 0:
        return lo
    g = warm(i, w, kind) if i < w else max(0.0, (total - i) / max(1.0, total - w))
    return lo + (hi - lo) * g


def warmup_cosine_lr(n, k, base=(2e-2, 1e-2), wmr=0.1, w=3, cmr=0.01, total=9):
    i = iteration(n)
    if i < 0:
        return 0.0
    if i < w:
        ratio = wmr + (1 - wmr) * warm(i, w, "log")
    else:
        p = min(1.0, (i - w + 1) / max(1, total - w))
        ratio = cmr + (1 - cmr) * (1 + math.cos(math.pi * p)) / 2
    return base[k] * ratio


def range_test_lr(n, k, lo=1e-3, size=3, rate=0.5, stairs=True):
    i = iteration(n)
    x = (i + 1) / size
    return lo * (1 + rate * (math.floor(x) if stairs else x))


def one_cycle_lr(n, k, lo=1e-3, hi=1e-2, first=3, second=2, decay_rate=0.5, decay_size=2):
    i = iteration(n)
    total = first + second
    if i < total:
        t = i + 1
        x = 1 + t / total - math.floor(1 + t / total)
        r = first / total
        s = x / r if x <= r else (x - 1) / (r - 1)
        return lo + (hi - lo) * s
    return lo / (1 + decay_rate * (i - total + 1) / decay_size)


CASES = {
    "WarmupLR": ({"warmup_min_lr": 1e-4, "warmup_max_lr": [5e-3, 2e-3], "warmup_num_steps": 5}, warmup_lr),
    "WarmupDecayLR": ({"warmup_max_lr": 3e-3, "warmup_num_steps": 4, "total_num_steps": 10,
                       "warmup_type": "linear"}, warmup_decay_lr),
    "WarmupCosineLR": ({"warmup_min_ratio": 0.1, "warmup_num_steps": 3, "cos_min_ratio": 0.01,
                        "total_num_steps": 9}, warmup_cosine_lr),
    "LRRangeTest": ({"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 0.5,
                     "lr_range_test_staircase": True}, range_test_lr),
    "OneCycle": ({"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3,
                  "cycle_second_step_size": 2, "decay_lr_rate": 0.5, "decay_step_size": 2,
                  "cycle_momentum": False}, one_cycle_lr),
}
STEPS = 12


@pytest.mark.parametrize("name", list(CASES))
def test_each_schedule_follows_its_formula_and_resumes_mid_warmup(name, tmp_path):
    params, formula = CASES[name]
    e, _ = engine({"type": name, "params": params})
    got = run(e, STEPS)
    want = [[formula(n, k) for k in range(2)] for n in range(1, STEPS + 1)]
    assert flat(got) == pytest.approx(flat(want), rel=1e-12, abs=1e-15)
    # Save after 2 updates (inside every warm-up here), resume in a new engine.
    e, _ = engine({"type": name, "params": params})
    run(e, 2)
    e.save_checkpoint(str(tmp_path))
    resumed, _ = engine({"type": name, "params": params})
    assert resumed.get_lr() == pytest.approx(want[0])  # a new schedule starts at its beginning
    resumed.load_checkpoint(str(tmp_path))
    assert flat(run(resumed, STEPS - 2, start=2)) == pytest.approx(flat(want[2:]), rel=1e-12, abs=1e-15)
    assert resumed.lr_scheduler.state_dict() == {"last_batch_iteration": STEPS - 1}


def test_one_cycle_cycles_the_first_beta_inversely():
    params = dict(CASES["OneCycle"][0], cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9)
    e, _ = engine({"type": "OneCycle", "params": params})
    betas = []
    for step in range(7):
        betas.append(tuple(e.optimizer.param_groups[0]["betas"]))
        run(e, 1, start=step)
    first = [b[0] for b in betas]
    assert first[0] == 0.8  # built at the minimum
    # Then max - (max - min) * scale, the scale rising over 3 iterations and falling over 2;
    # after the cycle (5 iterations) the decay phase holds the maximum (decay_mom_rate 0).
    scale = [1 / 3, 2 / 3, 1.0, 0.5, 0.0, 0.0]
    assert first[1:] == pytest.approx([0.9 - 0.1 * s for s in scale])
    assert all(b[1] == 0.99 for b in betas)


def test_a_skipped_step_does_not_advance_the_schedule():
    e, _ = engine({"type": "WarmupDecayLR", "params": CASES["WarmupDecayLR"][0]}, precision="fp16",
                  loss_scale={"initial_scale_power": 4})
    lrs = run(e, 6, poison={2})
    assert e.skipped_steps == 1
    assert lrs[3] == lrs[2] and lrs[2] != lrs[1]  # step 3 was skipped: step 4 runs at its lr
    assert lrs[4] == pytest.approx([warmup_decay_lr(4, k) for k in range(2)])


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[3e-2, 2e-2], total_steps=8),
], ids=["LambdaLR", "CosineAnnealingLR", "OneCycleLR"])
@pytest.mark.parametrize("stage", [1, 3])
def test_a_torch_lr_scheduler_drives_engine_optimizer_as_torch_adamw(make, stage):
    against_torch_adamw(stage, make)


def against_torch_adamw(stage, make, device="cpu", comm=None, atol=1e-6):
    """The engine with a torch schedule built on engine.optimizer, against
    torch.optim.AdamW with the same groups and schedule, on `device` (tests/gpu runs it
    on CUDA): the lr and betas at every step, the weights after 6."""
    m = model().to(device)
    cfg = {"stage": stage, "precision": "fp32", "optimizer": {"weight_decay": 0.1}}
    e = zerort.initialize(m, cfg if comm else dict(cfg, **INPROC), comm=comm, param_groups=groups(m))
    sched = make(e.optimizer)
    ref = model().to(device)
    opt = torch.optim.AdamW(groups(ref), lr=1e-3, weight_decay=0.1, foreach=False)
    ref_sched = make(opt)
    for step in range(6):
        assert e.get_lr() == pytest.approx([g["lr"] for g in opt.param_groups], rel=1e-12)
        assert [g["betas"] for g in e.optimizer.param_groups] == [g["betas"] for g in opt.param_groups]
        x, y = (t.to(device) for t in batch(step))
        e.backward(nn.functional.mse_loss(e(x).float(), y))
        e.step()
        sched.step()
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        ref_sched.step()
    got = e.full_state_dict(master=True)
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k].float(), v, rtol=0, atol=atol), k


def test_a_schedule_passed_to_initialize_is_stepped_by_the_engine():
    m = model()
    e = zerort.initialize(m, dict({"stage": 2, "precision": "fp32"}, **INPROC), param_groups=groups(m),
                          lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s))
    run(e, 3)
    assert e.get_lr() == pytest.approx([2e-2 / 8, 1e-2 / 8])
    with pytest.raises(zerort.config.ConfigError, match="scheduler: the config has one and initialize"):
        zerort.initialize(model(), dict({"scheduler": {"type": "WarmupLR"}}, **INPROC),
                          lr_scheduler=lambda opt: None)
