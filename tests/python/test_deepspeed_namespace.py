"""zerort.integrations.deepspeed as real DeepSpeed scripts use it, in one process: a schedule
built on the user's own optimizer drives the update (against torch.optim.AdamW with the
same schedule), and optimizer errors. The modules scripts import (accelerator, ops, utils,
runtime.zero), names zerort does not provide, the engine methods scripts call and
GatheredParameters: test_deepspeed_modules.py. The launcher and deepspeed.comm across
ranks: test_deepspeed_launcher.py."""
import copy

import pytest
import torch
import torch.nn as nn

import zerort.integrations.deepspeed as deepspeed
from zerort.errors import ConfigError, UsageError

INPROC = {"zerort": {"comm": {"backend": "inprocess"}}}


def config(stage, precision="fp32", **extra):
    c = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
         "bf16": {"enabled": precision == "bf16"}, **INPROC}
    c.update(extra)
    return c


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def loss_of(out, y):
    return nn.functional.mse_loss(out.float(), y)


SCHEDULES = {
    # DeepSpeed-Chat's and HuggingFace get_scheduler's pattern: a LambdaLR on the user's AdamW.
    "lambda_warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4)),
    # OneCycleLR with cycle_momentum moves beta1 too.
    "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=10,
                                                                 cycle_momentum=True, base_momentum=0.8,
                                                                 max_momentum=0.95),
}


def reference(schedule, steps):
    """torch.optim.AdamW and the same schedule, in FP32: the parameters after each step."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05)
    sched = SCHEDULES[schedule](opt)
    out = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss_of(m(x), y).backward()
        opt.step()
        sched.step()
        out.append(([g["lr"] for g in opt.param_groups], [p.detach().clone() for p in m.parameters()]))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_schedule_on_the_users_optimizer_drives_the_update(stage, schedule):
    steps = 8
    expected = reference(schedule, steps)
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05)
    engine, optimizer, _, sched = deepspeed.initialize(model=m, optimizer=opt, lr_scheduler=SCHEDULES[schedule](opt),
                                                       config=config(stage))
    assert optimizer.param_groups[0] is opt.param_groups[0]  # Note [shared param groups]
    for step in range(steps):
        x, y = batch(step)
        engine.backward(loss_of(engine(x), y))
        engine.step()
        lrs, params = expected[step]
        assert engine.get_lr() == pytest.approx(lrs, rel=1e-12), step
        master = engine.full_state_dict(master=True)
        for (name, _), want in zip(m.named_parameters(), params):
            torch.testing.assert_close(master[name], want, rtol=0, atol=2e-6, msg=f"step {step} {name}")
    engine.destroy()


def test_the_lr_each_update_used_is_the_schedules():
    """Before Note [shared param groups] every update used 2.5e-3, the lr read at initialize."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = SCHEDULES["lambda_warmup"](opt)
    engine, *_ = deepspeed.initialize(model=m, optimizer=opt, lr_scheduler=sched, config=config(2))
    used = []
    for step in range(4):
        used.append(engine.get_lr()[0])
        x, y = batch(step)
        engine.backward(loss_of(engine(x), y))
        engine.step()
    assert used == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    engine.destroy()


def test_a_schedule_on_another_optimizer_is_an_error():
    m = model()
    stray = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    with pytest.raises(ConfigError, match="build it on engine.optimizer"):
        deepspeed.initialize(model=m, model_parameters=m.parameters(),
                             lr_scheduler=torch.optim.lr_scheduler.LambdaLR(stray, lambda s: 1.0),
                             config=config(2, optimizer={"type": "AdamW", "params": {"lr": 1e-3}}))


@pytest.mark.parametrize("stage", [1, 2])
def test_no_optimizer_at_stages_1_and_2_is_an_error_naming_both_ways(stage):
    with pytest.raises(ConfigError, match=rf"none given, and ZeRO stage {stage}.*add an \"optimizer\" section.*or "
                                          "pass optimizer="):
        deepspeed.initialize(model=model(), config=config(stage))


@pytest.mark.parametrize("stage", [0, 3])
def test_no_optimizer_at_stages_0_and_3_gives_a_forward_only_engine(stage):
    """DeepSpeed-Chat's reference and reward models: forward runs, training is refused."""
    m = model()
    plain = copy.deepcopy(m)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=m, config=config(stage))
    assert optimizer is None and scheduler is None
    x, y = batch(0)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), plain(x), rtol=0, atol=1e-6)
    loss = loss_of(engine(x), y)
    with pytest.raises(UsageError, match="runs forward only; to train it, add an \"optimizer\" section"):
        engine.backward(loss)
    with pytest.raises(UsageError, match="runs forward only"):
        engine.step()
    engine.destroy()


def test_a_half_precision_model_is_taken_as_deepspeed_takes_it():
    """A model loaded in bf16 (torch_dtype=torch.bfloat16): its values become the FP32 master exactly."""
    m = model().to(torch.bfloat16)
    values = {n: p.detach().float().clone() for n, p in m.named_parameters()}
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                      config=config(2, "bf16", optimizer={"type": "AdamW", "params": {"lr": 1e-3}}))
    master = engine.full_state_dict(master=True)
    assert all(torch.equal(master[n], v) for n, v in values.items())
    engine.destroy()


@pytest.mark.parametrize("cls", ["FusedAdam", "DeepSpeedCPUAdam"])
def test_deepspeed_adam_classes_are_taken_over_as_adamw(cls):
    expected = reference("lambda_warmup", 3)
    m = model()
    opt = getattr(deepspeed.ops.adam, cls)(m.parameters(), lr=1e-2, weight_decay=0.05)
    engine, *_ = deepspeed.initialize(model=m, optimizer=opt, lr_scheduler=SCHEDULES["lambda_warmup"](opt),
                                      config=config(2))
    for step in range(3):
        x, y = batch(step)
        engine.backward(loss_of(engine(x), y))
        engine.step()
    master = engine.full_state_dict(master=True)
    for (name, _), want in zip(m.named_parameters(), expected[-1][1]):
        torch.testing.assert_close(master[name], want, rtol=0, atol=2e-6)
    engine.destroy()


def adam_without_bias_correction(steps, lr, betas, eps, wd):
    """DeepSpeed's bias_correction=False update written out in FP64: the moments used as
    they are, decoupled decay."""
    m = model().double()
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in m.parameters()]
    for step in range(steps):
        x, y = batch(step)
        m.zero_grad()
        loss_of(m(x.double()), y.double()).backward()
        with torch.no_grad():
            for p, (m1, v) in zip(m.parameters(), state):
                m1.mul_(betas[0]).add_(p.grad, alpha=1 - betas[0])
                v.mul_(betas[1]).addcmul_(p.grad, p.grad, value=1 - betas[1])
                p.mul_(1 - lr * wd).sub_(lr * m1 / (v.sqrt() + eps))
    return [p.detach() for p in m.parameters()]


@pytest.mark.parametrize("source", ["FusedAdam", "config"])
def test_bias_correction_false_is_honoured(source):
    steps, lr, betas, eps, wd = 5, 1e-2, (0.9, 0.99), 1e-8, 0.05
    expected = adam_without_bias_correction(steps, lr, betas, eps, wd)
    m = model()
    if source == "FusedAdam":
        opt = deepspeed.ops.adam.FusedAdam(m.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd,
                                           bias_correction=False)
        engine, *_ = deepspeed.initialize(model=m, optimizer=opt, config=config(2))
    else:
        params = {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": wd, "bias_correction": False}
        engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                          config=config(2, optimizer={"type": "AdamW", "params": params}))
    for step in range(steps):
        x, y = batch(step)
        engine.backward(loss_of(engine(x), y))
        engine.step()
    master = engine.full_state_dict(master=True)
    for (name, _), want in zip(m.named_parameters(), expected):
        torch.testing.assert_close(master[name].double(), want, rtol=0, atol=5e-6, msg=name)
    # torch's AdamW (bias-corrected) with the same values ends far from it: the flag does something.
    corrected = model()
    torch_opt = torch.optim.AdamW(corrected.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd)
    for step in range(steps):
        x, y = batch(step)
        torch_opt.zero_grad()
        loss_of(corrected(x), y).backward()
        torch_opt.step()
    assert (master["0.weight"] - corrected[0].weight.detach()).abs().max() > 1e-3
    engine.destroy()
