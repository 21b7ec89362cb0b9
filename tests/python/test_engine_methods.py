"""The engine methods DeepSpeed users call, and param groups' errors, in one process."""
import os

import pytest
import torch
import torch.nn as nn

import zerort
from zerort import UsageError
from test_engine_api import INPROC, DictUnits


class Net(DictUnits):
    tag = "net"  # a plain attribute of the module, for engine attribute forwarding


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def engine(stage=1, groups=None, **cfg):
    m = Net()
    return zerort.initialize(m, dict({"stage": stage, "precision": "fp32"}, **INPROC, **cfg), param_groups=groups), m


def micro(e, step):
    x, y = batch(step)
    e.backward(nn.functional.mse_loss(e(x).float(), y))


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_locally_like_gradient_accumulation(stage):
    acc, _ = engine(stage, gradient_accumulation_steps=2)
    for step in range(4):
        micro(acc, step)
        acc.step()
    e, _ = engine(stage)
    for update in range(2):
        with e.no_sync():
            micro(e, 2 * update)
            with pytest.raises(UsageError, match="inside engine.no_sync"):
                e.step()
        micro(e, 2 * update + 1)
        e.step()
    # Both see the same two micro-batches per update; no_sync's step sums them where
    # accumulation averages, and Adam's update does not change with the gradient's scale
    # (up to eps). Dropping either micro-batch would move the weights by ~lr.
    assert e.global_steps == acc.global_steps == 2
    want = acc.full_state_dict(master=True)
    for k, v in e.full_state_dict(master=True).items():
        assert torch.allclose(v, want[k], rtol=0, atol=1e-6), k


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_names_the_stage(stage):
    e, _ = engine(stage)
    with pytest.raises(UsageError, match=f"not at ZeRO stage {stage}, which reduce-scatters"):
        with e.no_sync():
            pass


def test_boundary_applied_and_norm_follow_the_accumulation_window():
    e, _ = engine(2, gradient_accumulation_steps=2, gradient_clipping=0.5)
    assert e.get_global_grad_norm() is None
    seen = []
    for step in range(4):
        seen.append(e.is_gradient_accumulation_boundary())
        micro(e, step)
        e.step()
        assert e.was_step_applied() == seen[-1]
    assert seen == [False, True, False, True]
    assert e.get_global_grad_norm() == pytest.approx(e.stats["grad_norm"]) and e.get_global_grad_norm() > 0
    assert (e.global_steps, e.skipped_steps) == (2, 0)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_grad_is_free_after_step_and_an_error_after_backward(stage):
    e, _ = engine(stage, gradient_accumulation_steps=2)
    ref, _ = engine(stage, gradient_accumulation_steps=2)
    for step in range(4):
        if stage >= 2 or step % 2 == 0:
            e.zero_grad()  # at stages 2-3 a loop may start every micro-step with it, as many do
        micro(e, step)
        micro(ref, step)
        with pytest.raises(UsageError, match="zero_grad\\(\\): called after backward\\(\\) and before the step"):
            e.zero_grad()
        e.step()
        ref.step()
        if stage == 1 and step % 2 == 0:  # stage 1 holds the window's local sum until its end
            with pytest.raises(UsageError, match="at stages 0 and 1 inside an accumulation window"):
                e.optimizer.zero_grad()
    want = ref.full_state_dict(master=True)
    assert all(torch.equal(v, want[k]) for k, v in e.full_state_dict(master=True).items())


def test_train_eval_and_module_attributes():
    e, m = engine(1)
    assert e.eval() is e and not m.training
    assert e.train() is e and m.training
    assert e.tag == "net" and e.a is m.a  # the module's attributes
    with pytest.raises(AttributeError, match="neither the zerort engine nor its module"):
        e.nonexistent


def test_param_group_errors_name_the_parameter():
    m = Net()
    with pytest.raises(ValueError, match="trainable parameters are in no param group, first 'b.weight'"):
        zerort.initialize(m, INPROC and {"comm": {"backend": "inprocess"}},
                          param_groups=[{"params": [m.a.weight, m.a.bias, m.norm.weight, m.norm.bias]}])
    m = Net()
    with pytest.raises(ValueError, match="parameter 'a.weight' is in param_groups\\[0\\] and in param_groups\\[1\\]"):
        zerort.initialize(m, {"comm": {"backend": "inprocess"}},
                          param_groups=[{"params": list(m.parameters())}, {"params": [m.a.weight]}])
    m = Net()
    with pytest.raises(ValueError, match="param_groups\\[0\\] holds a tensor of shape \\[3\\] that is not a param"):
        zerort.initialize(m, {"comm": {"backend": "inprocess"}},
                          param_groups=[{"params": list(m.parameters()) + [nn.Parameter(torch.zeros(3))]}])
    m = Net()
    with pytest.raises(ValueError, match="param_groups\\[0\\]\\['amsgrad'\\] = True is not supported"):
        zerort.initialize(m, {"comm": {"backend": "inprocess"}}, param_groups=[{"params": m.parameters(),
                                                                                "amsgrad": True}])
    m = Net()
    m.norm.requires_grad_(False)  # frozen parameters in a group are dropped, as torch skips them
    e = zerort.initialize(m, {"comm": {"backend": "inprocess"}}, param_groups=[{"params": list(m.parameters())}])
    assert len(e.optimizer.param_groups[0]["params"]) == 4


def test_group_values_are_checked_at_the_step_and_direct_optimizer_calls_are_refused():
    e, m = engine(2, groups=None)
    e.optimizer.param_groups[0]["eps"] = 0.0
    micro(e, 0)
    with pytest.raises(ValueError, match="param_groups\\[0\\]\\['eps'\\] = 0.0; it must be a finite number > 0"):
        e.step()
    e.optimizer.param_groups[0]["eps"] = 1e-8
    e.step()
    with pytest.raises(UsageError, match="engine.optimizer.step\\(\\): zerort's update is engine.step"):
        e.optimizer.step()
    with pytest.raises(UsageError, match="add_param_group: zerort lays out"):
        e.optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_per_group_values_reach_the_update():
    """lr 0 in one group: its parameters do not move, the other group's do."""
    m = Net()
    e = zerort.initialize(m, dict({"stage": 2, "precision": "fp32"}, **INPROC), param_groups=[
        {"params": [m.a.weight, m.a.bias], "lr": 0.0, "weight_decay": 0.0},
        {"params": [m.norm.weight, m.norm.bias, m.b.weight, m.b.bias]}])
    before = e.full_state_dict(master=True)
    micro(e, 0)
    e.step()
    after = e.full_state_dict(master=True)
    assert torch.equal(before["a.weight"], after["a.weight"]) and torch.equal(before["a.bias"], after["a.bias"])
    assert not torch.equal(before["b.weight"], after["b.weight"])


def test_checkpoint_keeps_param_groups_and_loads_by_option(tmp_path):
    groups = lambda m: [{"params": [m.a.weight, m.b.weight], "weight_decay": 0.1, "name": "decay"},
                        {"params": [m.a.bias, m.norm.weight, m.norm.bias, m.b.bias], "weight_decay": 0.0}]
    m = Net()
    e = zerort.initialize(m, dict({"stage": 1, "precision": "fp32"}, **INPROC), param_groups=groups(m))
    for step in range(2):
        micro(e, step)
        e.step()
    e.optimizer.param_groups[1]["lr"] = 5e-4
    path = e.save_checkpoint(str(tmp_path), client_state={"epoch": 3, "t": torch.arange(3)}, save_latest=False)
    assert not os.path.exists(tmp_path / "latest") and os.path.basename(path) == "step2"
    assert e.load_checkpoint(str(tmp_path)) == (None, None)  # no `latest`: nothing loaded, as DeepSpeed
    m2 = Net()
    fresh = zerort.initialize(m2, dict({"stage": 3, "precision": "fp32"}, **INPROC), param_groups=groups(m2))
    got, client = fresh.load_checkpoint(str(tmp_path), tag="step2")
    assert got == path and client["epoch"] == 3 and torch.equal(client["t"], torch.arange(3))
    assert fresh.optimizer.param_groups[1]["lr"] == 5e-4 and fresh.optimizer.param_groups[0]["name"] == "decay"
    assert fresh.global_steps == 2
    weights_only = zerort.initialize(Net(), dict({"stage": 2, "precision": "fp32"}, **INPROC))
    with pytest.raises(zerort.CheckpointError, match="the saved optimizer has 2 param groups, this engine 1"):
        weights_only.load_checkpoint(str(tmp_path), tag="step2")
    assert weights_only.global_steps == 0  # the failed load changed nothing
    weights_only.load_checkpoint(str(tmp_path), tag="step2", load_optimizer_states=False)
    assert weights_only.global_steps == 2 and weights_only._impl.adam_steps == 0  # Adam starts over
    full = weights_only.full_state_dict(master=True)
    assert all(torch.equal(full[k], v) for k, v in e.full_state_dict(master=True).items())
    module = zerort.initialize(Net(), dict({"stage": 2, "precision": "fp32"}, **INPROC))
    module.load_checkpoint(str(tmp_path), tag="step2", load_module_only=True)
    assert module.global_steps == 0
    with pytest.raises(zerort.state.checkpoint.CheckpointError,
                       match="client_state .* cannot be saved so that it loads"):
        e.save_checkpoint(str(tmp_path), tag="bad", client_state={"f": Net})
    assert not os.path.exists(tmp_path / "bad")


def test_save_16bit_model_writes_the_working_copy(tmp_path):
    m = Net()
    e = zerort.initialize(m, dict({"stage": 3, "precision": "bf16"}, **INPROC))
    assert e.save_16bit_model(str(tmp_path), "model.safetensors") is True
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved["a.weight"].dtype == torch.bfloat16 and saved["norm.weight"].dtype == torch.float32
    full = e.full_state_dict()
    assert all(torch.equal(saved[k], full[k]) for k in full)


def test_wall_clock_breakdown_prints_deepspeed_timer_lines(capsys):
    e, _ = engine(2, gradient_accumulation_steps=2, wall_clock_breakdown=True, steps_per_print=1)
    for step in range(2):
        micro(e, step)
        e.step()
    out = capsys.readouterr().out.splitlines()
    micro_lines = [ln for ln in out if ln.startswith("time (ms) | fwd_microstep: ")]
    window = [ln for ln in out if ln.startswith("time (ms) | fwd: ")]
    assert len(micro_lines) == 2 and len(window) == 1
    assert [part.split(":")[0] for part in window[0].split(" | ")[1:]] == ["fwd", "bwd", "bwd_inner",
                                                                           "bwd_allreduce", "step"]
    assert "[Rank 0] step=1, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]" in out


def test_a_checkpoint_of_another_schedule_is_refused_before_anything_loads(tmp_path):
    m = Net()
    e = zerort.initialize(m, dict({"stage": 2, "precision": "fp32", "scheduler": {"type": "WarmupLR"}}, **INPROC))
    for step in range(3):
        micro(e, step)
        e.step()
    e.save_checkpoint(str(tmp_path))
    other = zerort.initialize(Net(), dict({"stage": 2, "precision": "fp32"}, **INPROC),
                              lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0))
    lr = other.get_lr()
    with pytest.raises(zerort.state.checkpoint.CheckpointError,
                       match="lr schedule is a WarmupLR, this engine's a LambdaLR"):
        other.load_checkpoint(str(tmp_path))
    assert other.global_steps == 0 and other.get_lr() == lr  # nothing changed
    other.load_checkpoint(str(tmp_path), load_lr_scheduler_states=False)
    assert other.global_steps == 3


def test_deepspeed_initialize_reads_deepspeed_defaults_whatever_keys_the_config_has():
    import zerort.integrations.deepspeed as deepspeed

    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    engine, optimizer, _, _ = deepspeed.initialize(model=m, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zerort": {"comm": {"backend": "inprocess"}}})
    assert (engine.config.stage, engine.config.precision) == (0, "fp32")  # DeepSpeed's defaults, not ours
    m = Net()
    coupled = torch.optim.Adam(m.parameters(), weight_decay=0.1)
    with pytest.raises(ValueError, match="the Adam optimizer has coupled weight_decay 0.1"):
        deepspeed.initialize(model=m, optimizer=coupled, config={"zerort": {"comm": {"backend": "inprocess"}}})
    m = Net()
    decoupled = torch.optim.Adam(m.parameters(), weight_decay=0.1, decoupled_weight_decay=True)
    engine, optimizer, _, _ = deepspeed.initialize(model=m, optimizer=decoupled,
                                                   config={"zerort": {"comm": {"backend": "inprocess"}}})
    assert optimizer.param_groups[0]["weight_decay"] == 0.1
    with pytest.raises(ValueError, match="load_module_strict=False and custom_load_fn are not supported"):
        engine.load_checkpoint("/nonexistent", load_module_strict=False)


def test_deepspeed_backward_arguments_and_forward():
    mean, _ = engine(2, gradient_accumulation_steps=2)
    summed, _ = engine(2, gradient_accumulation_steps=2)
    for step in range(2):
        x, y = batch(step)
        mean.backward(nn.functional.mse_loss(mean.forward(x).float(), y))
        mean.step()
        loss = nn.functional.mse_loss(summed(x).float(), y)
        summed.backward(loss, retain_graph=True, scale_wrt_gas=False)  # the micro-steps' sum: twice the mean
        summed.step()
    assert summed.get_global_grad_norm() == pytest.approx(2 * mean.get_global_grad_norm(), rel=1e-6)
    assert (mean.zero_optimization_stage(), mean.fp16_enabled(), mean.bfloat16_enabled(),
            mean.gradient_clipping(), mean.gradient_accumulation_steps()) == (2, False, False, 0.0, 2)


def test_scalar_tensor_arguments_keep_their_dtype():
    """A 0-dim float argument is a scalar (HuggingFace's num_items_in_batch), not an
    activation: bf16 would round a count of 1001 to 1000."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, count):
            self.seen = (x.dtype, count.dtype, float(count))
            return self.lin(x).float().sum() / count

    m = Scaled()
    e = zerort.initialize(m, dict({"stage": 2, "precision": "bf16"}, **INPROC))
    e(torch.randn(3, 4), count=torch.tensor(1001.0))
    assert m.seen == (torch.bfloat16, torch.float32, 1001.0)
