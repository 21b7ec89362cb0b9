"""zerort.integrations.deepspeed as real DeepSpeed scripts use it, in one process, part 2 (the
schedules and optimizers: test_deepspeed_namespace.py, whose model and config these share):
the modules scripts import (accelerator, ops, utils, runtime.zero), names zerort does not
provide, the engine methods scripts call, and GatheredParameters tensors read after the
block."""
import os
import sys

import pytest
import torch
import torch.nn as nn

import zerort.integrations.deepspeed as deepspeed
from zerort.errors import ConfigError, UsageError
from zerort.integrations.deepspeed.names import NotProvidedError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_deepspeed_namespace import batch, config, loss_of, model  # noqa: E402


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
    assert acc.communication_backend_name() == "gloo" and acc.is_bf16_supported()
    # DeepSpeed's answer on the CPU: oneDNN's fp16 support, which scripts choose their precision by.
    assert acc.is_fp16_supported() == torch.ops.mkldnn._is_mkldnn_fp16_supported()
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


def stage3_engine(m):
    """deepspeed.initialize's engine for m at stage 3 in bf16, every parameter in a unit."""
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                      config=config(3, "bf16", optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
                                                    zero_optimization={"stage": 3,
                                                                       "stage3_param_persistence_threshold": 0}))
    return engine


def test_gathered_parameters_tensors_stay_readable_after_the_block():
    m = model()
    engine = stage3_engine(m)
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
    engine = stage3_engine(m)
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


def test_safe_set_full_refuses_a_wrong_shape_a_frozen_parameter_and_an_unknown_key():
    m = model()
    engine = stage3_engine(m)
    weight = m[2].weight
    with pytest.raises(UsageError, match=r"has shape \[.*\]; got a value of shape \[3\]"):
        deepspeed.utils.safe_set_full_fp32_param(weight, torch.zeros(3))
    with pytest.raises(AttributeError, match="key 'momentum'"):
        deepspeed.utils.safe_set_full_optimizer_state(weight, torch.zeros(weight.ds_shape), "momentum")
    engine.destroy()
