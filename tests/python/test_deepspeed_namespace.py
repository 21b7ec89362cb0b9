"""zerort.integrations.deepspeed as real DeepSpeed scripts use it, in one process: a schedule
built on the user's own optimizer drives the update (against torch.optim.AdamW with the
same schedule), optimizer errors, the modules scripts import (accelerator, ops.adam, utils,
runtime.zero), names zerort does not provide, the engine methods scripts call, and
GatheredParameters tensors read after the block. The launcher and deepspeed.comm across
ranks: test_deepspeed_launcher.py."""
import copy

import pytest
import torch
import torch.nn as nn

import zerort.integrations.deepspeed as deepspeed
from zerort.errors import ConfigError, UsageError
from zerort.integrations.deepspeed.names import NotProvidedError

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


def test_refused_optimizers_name_themselves():
    with pytest.raises(ConfigError, match="no LAMB"):
        deepspeed.ops.lamb.FusedLamb(model().parameters())


def test_names_not_provided_say_so():
    with pytest.raises(NotProvidedError, match=r"deepspeed\.pipe_magic: zerort's DeepSpeed drop-in"):
        deepspeed.pipe_magic
    with pytest.raises(NotProvidedError, match=r"deepspeed\.comm\.all_to_all_magic"):
        deepspeed.comm.all_to_all_magic
    assert not hasattr(deepspeed.utils, "no_such_helper")  # still an AttributeError for hasattr
    assert deepspeed.__version__ == "0.19.8"


def test_init_distributed_takes_torchs_per_device_backend_form():
    from zerort.integrations.deepspeed.comm import _backend

    assert _backend(None) == "gloo" and _backend("gloo") == "gloo"
    assert _backend("cpu:gloo,cuda:nccl") == "gloo"  # this CPU build of torch has no NCCL: the CPU entry
    with pytest.raises(ConfigError, match="dist_backend='ucc'"):
        _backend("ucc")


def test_accelerator_on_cpu_measures_real_bytes():
    acc = deepspeed.accelerator.get_accelerator()
    assert acc.device_name() == "cpu" and acc.current_device_name() == "cpu" and acc.device_name(1) == "cpu"
    assert acc.communication_backend_name() == "gloo" and acc.is_bf16_supported() and acc.is_fp16_supported()
    assert acc.device_count() >= 1 and acc.is_available()
    before = acc.memory_allocated()
    acc.reset_peak_memory_stats()
    t = torch.empty(1 << 20, dtype=torch.float32)  # 4 MiB through zerort's counting allocator
    assert acc.memory_allocated() - before >= 4 << 20
    assert acc.max_memory_allocated() >= before + (4 << 20)
    del t
    acc.manual_seed(5)
    a = torch.rand(3)
    acc.manual_seed(5)
    assert torch.equal(a, torch.rand(3))
    assert acc.pin_memory(torch.ones(2)).sum() == 2
    acc.synchronize()
    acc.empty_cache()


def test_the_helpers_deepspeed_chat_and_superoffload_import():
    from zerort.integrations.deepspeed.compression.helper import recursive_getattr, recursive_setattr

    m = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 3)))
    assert recursive_getattr(m, "1.0") is m[1][0]
    recursive_setattr(m, "1.0", nn.Identity())
    assert isinstance(m[1][0], nn.Identity)
    assert deepspeed.utils.set_z3_leaf_modules(m, [nn.Linear]) == [m[0]] and m[0]._z3_leaf
    assert deepspeed.get_accelerator() is deepspeed.accelerator.get_accelerator()


def test_zero_param_status_and_runtime_names():
    from zerort.integrations.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    assert {s.name for s in ZeroParamStatus} == {"AVAILABLE", "NOT_AVAILABLE", "INFLIGHT"}
    assert deepspeed.runtime.zero.partition_parameters.GatheredParameters is deepspeed.zero.GatheredParameters


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_engine_methods_scripts_call(stage, tmp_path):
    m = model()
    data = torch.utils.data.TensorDataset(torch.randn(16, 6), torch.randn(16, 3))
    cfg = config(stage, optimizer={"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.99]}},
                 csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"})
    engine, _, loader, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(), training_data=data,
                                                config=cfg)
    assert engine.training_dataloader is loader and engine.dp_world_size == 1
    assert engine.get_mom() == [(0.8, 0.99)]
    for x, y in loader:
        engine.backward(loss_of(engine(x), y))
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
    with pytest.raises(UsageError, match="gradient_accumulation_steps=1"):
        engine.set_gradient_accumulation_boundary(False)
    assert engine.tput_timer.avg_samples_per_sec() > 0  # 4 updates, the first 2 left out
    assert engine.monitor.enabled
    engine.monitor.write_events([("eval/loss", 0.5, 4)])
    assert (tmp_path / "j" / "events.csv").read_text().strip() == "eval/loss,0.5,4"
    engine.empty_partition_cache()
    master = engine.full_state_dict(master=True)
    engine.destroy()
    # destroy(): the model is plain FP32 again, holding the master; a second initialize takes it.
    for name, p in m.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), master[name]), name
    engine2, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    x, y = batch(0)
    engine2.backward(loss_of(engine2(x), y))
    engine2.step()
    engine2.destroy()


def test_disabled_monitor_is_deepspeeds():
    m = model()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                      config=config(1, optimizer={"type": "AdamW", "params": {"lr": 1e-3}}))
    assert not engine.monitor.enabled
    engine.monitor.write_events([("x", 1.0, 1)])  # nothing to write to, no error
    engine.destroy()


def test_gathered_parameters_tensors_stay_readable_after_the_block():
    m = model()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                      config=config(3, "bf16", optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
                                                    zero_optimization={"stage": 3,
                                                                       "stage3_param_persistence_threshold": 0}))
    weight = m[2].weight
    with deepspeed.zero.GatheredParameters(weight):
        taken = weight.detach().cpu()  # on CPU the same storage: no copy
        data = weight.data
        expected = weight.detach().clone()
    assert weight.numel() == 0  # released again
    assert torch.equal(taken, expected) and torch.equal(data, expected)
    engine.destroy()


def test_stage3_parameters_carry_deepspeeds_attributes():
    """DeepSpeed-Chat's _z3_params_to_fetch reads ds_id and ds_status to decide what to gather."""
    from zerort.integrations.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    m = model()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                      config=config(3, "bf16", optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
                                                    zero_optimization={"stage": 3,
                                                                       "stage3_param_persistence_threshold": 0}))
    names = [n for n, _ in m.named_parameters()]
    for index, (name, p) in enumerate(m.named_parameters()):
        assert p.ds_id == index and p.ds_shape == torch.Size(model().state_dict()[name].shape), name
        assert p.ds_numel == p.ds_shape.numel() and p.ds_status == ZeroParamStatus.NOT_AVAILABLE, name
    fetch = [p for p in m.parameters() if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    assert len(fetch) == len(names)
    with deepspeed.zero.GatheredParameters(fetch):
        assert all(p.ds_status == ZeroParamStatus.AVAILABLE for p in fetch)
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in fetch)
    assert not hasattr(torch.nn.Parameter(torch.zeros(2)), "ds_status")  # only what an engine marked
    engine.destroy()


def test_utils_full_values_and_zero_to_fp32(tmp_path):
    m = model()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                      config=config(3, "bf16", optimizer={"type": "AdamW", "params": {"lr": 1e-2}}))
    for step in range(2):
        x, y = batch(step)
        engine.backward(loss_of(engine(x), y))
        engine.step()
    master = engine.full_state_dict(master=True)
    for name, p in m.named_parameters():
        assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(p), master[name]), name
        m_ = deepspeed.utils.safe_get_full_optimizer_state(p, "exp_avg")
        assert m_.shape == master[name].shape and torch.isfinite(m_).all() and m_.abs().sum() > 0
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    from zerort.integrations.deepspeed.utils import zero_to_fp32

    sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    for name in master:
        assert torch.equal(sd[name], master[name]), name
    out = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert out.endswith("pytorch_model.bin") and torch.equal(torch.load(out)["4.weight"], master["4.weight"])
    fresh = zero_to_fp32.load_state_dict_from_zero_checkpoint(model(), str(tmp_path / "ckpt"))
    assert torch.equal(fresh[4].weight, master["4.weight"])
    with pytest.raises(NotProvidedError, match="not a parameter of a live zerort engine"):
        deepspeed.utils.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2)))
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("gas", [1, 2])
def test_safe_get_full_grad_is_torchs_gradient_of_the_window(stage, gas):
    """FP32 at W = 1: after the window's last backward, safe_get_full_grad is the gradient
    torch computes for the mean of the micro-steps' losses (within FP32 rounding), and the
    step after it is the step without it. Stages 0 and 1 reduce only in the window's last
    micro-step: asking before it is a UsageError. A frozen parameter's is None."""
    cfg = config(stage, gradient_accumulation_steps=gas, zero_optimization={
        "stage": stage, "stage3_param_persistence_threshold": 0})
    runs = []
    for ask in (True, False):
        m = model()
        m[0].bias.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=m, model_parameters=[p for p in m.parameters() if p.requires_grad],
                                          optimizer=torch.optim.AdamW([p for p in m.parameters() if p.requires_grad],
                                                                      lr=1e-2), config=cfg)
        ref = model()
        for micro in range(gas):
            x, y = batch(micro)
            engine.backward(loss_of(engine(x), y))
            (loss_of(ref(x), y) / gas).backward()
            if ask and micro < gas - 1 and stage < 2:
                with pytest.raises(UsageError, match="reduced in the accumulation window's last micro-step"):
                    deepspeed.utils.safe_get_full_grad(m[2].weight)
            if ask and micro == gas - 1:
                for (name, p), r in zip(m.named_parameters(), ref.parameters()):
                    got = deepspeed.utils.safe_get_full_grad(p)
                    if name == "0.bias":
                        assert got is None
                        continue
                    torch.testing.assert_close(got, r.grad, rtol=1e-5, atol=1e-6, msg=name)
            engine.step()
        runs.append(engine.full_state_dict(master=True))
        engine.destroy()
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name  # asking changed nothing


def test_logger_and_log_dist(capsys):
    deepspeed.utils.log_dist("hello from the test", ranks=[0])
    deepspeed.utils.log_dist("not shown", ranks=[1])
    out = capsys.readouterr().out
    assert "[Rank 0] hello from the test" in out and "not shown" not in out
    assert deepspeed.utils.logger.name == "DeepSpeed"
