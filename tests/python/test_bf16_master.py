"""bf16.bf16_master_weights_and_grads with bf16_optimizer_states (config optimizer.master_dtype
and state_dtype "bf16"): the master, the gradient shard and Adam's m and v in bf16.

- bf16_master_worker.py, W = 2 under torchrun, DeepSpeed's config form through the facade, at
  stages 1-3: the losses against plain torch written here, a bf16 model whose update is
  torch.optim.AdamW's FP32 arithmetic on the widened bf16 values with the parameter and both
  moments stored back rounded to bf16, its gradient the two ranks' sum in FP32 rounded once;
  the master, m and v too; the memory report (measured = estimate = 2 bytes per element of the
  master, m and v); a checkpoint that reloads bit for bit.
- The config's rules in both forms, and the estimator's 8 bytes per element of the shard."""
import copy
import os

import pytest
import torch

import zerort
from zerort._testing.launch import launch
from zerort.accounting.memory import estimate_memory
from zerort.config import parse

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def worker():
    import bf16_master_worker

    return bf16_master_worker


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, worker):
    d = tmp_path_factory.mktemp("bf16_master")
    launch("torchrun", worker.W, os.path.join(HERE, "bf16_master_worker.py"), str(d / "out"), str(d), timeout=600)
    return torch.load(str(d / "out.pt"))


def bf16_model(model):
    """model in bf16 but its LayerNorms, which keep FP32 and compute in it: zerort's rule
    (zerort.layout.precision)."""
    model.to(torch.bfloat16)
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.float()
            m.register_forward_pre_hook(lambda mod, args: tuple(a.float() for a in args))
            m.register_forward_hook(lambda mod, args, out: out.to(torch.bfloat16))
    return model


def bf16_reference(worker):
    """Plain torch: the bf16 model (its LayerNorms in FP32, as zerort keeps them), torch.optim.AdamW
    on FP32 copies of its parameters, every parameter and moment rounded to bf16 after each step.
    Returns (losses per step per rank, {name: (master, m, v)})."""
    model = bf16_model(worker.gpt2())
    params = dict(model.named_parameters())
    shadow = {n: p.detach().float().clone().requires_grad_(False) for n, p in params.items()}
    hyper = worker.config(2)["optimizer"]["params"]
    opt = torch.optim.AdamW(list(shadow.values()), lr=hyper["lr"], betas=tuple(hyper["betas"]), eps=hyper["eps"],
                            weight_decay=hyper["weight_decay"], foreach=False)
    losses = []
    for step in range(worker.STEPS):
        grads, row = {n: torch.zeros_like(s) for n, s in shadow.items()}, []
        for rank in range(worker.W):
            t = worker.batch(step, rank)
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=t, labels=t).loss
            loss.backward()
            row.append(loss.item())
            for n, p in params.items():
                grads[n] += p.grad.float()  # the sum over ranks in FP32
        losses.append(row)
        for n, s in shadow.items():  # rounded once to the bf16 shard, then averaged in FP32
            s.grad = grads[n].to(torch.bfloat16).float() * (1.0 / worker.W)
        opt.step()
        with torch.no_grad():
            for n, s in shadow.items():
                s.copy_(s.to(torch.bfloat16).float())
                st = opt.state[s]
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k].copy_(st[k].to(torch.bfloat16).float())
                params[n].copy_(s)  # bf16 values: exact in an FP32 LayerNorm too
    return losses, {n: (s, opt.state[s]["exp_avg"], opt.state[s]["exp_avg_sq"]) for n, s in shadow.items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_losses_and_states_track_plain_torch_with_a_bf16_master(ranks, worker, stage):
    losses, ref = bf16_reference(worker)
    got = ranks[stage]
    assert got["dtypes"] == {"torch.bfloat16"}
    for step, (a, b) in enumerate(zip(got["losses"], losses)):
        for r in range(worker.W):  # measured: equal bits (the same arithmetic throughout)
            assert abs(a[r] - b[r]) <= 1e-5 * abs(b[r]), (stage, step, r, a[r], b[r])
    for n, (master, m, v) in got["states"].items():
        assert torch.equal(master, master.to(torch.bfloat16).float()), n  # bf16 values
        for what, x, y in zip(("master", "exp_avg", "exp_avg_sq"), (master, m, v), ref[n]):
            # within one bf16 step of each element (2**-8 relative); measured: equal bits
            assert ((x - y).abs() <= 2 ** -8 * y.abs() + 1e-30).all(), (stage, n, what, (x - y).abs().max())
    assert got["reload_bitwise"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_memory_report_counts_two_bytes_per_element(ranks, stage):
    got = ranks[stage]
    n = got["master_numel"]
    for k in ("master", "adam_m", "adam_v"):
        measured, estimate = got["rows"][k]
        assert measured == estimate == 2 * n, (stage, k, got["rows"][k])
    measured, estimate = got["rows"]["grad_shard"]
    assert measured == estimate and 2 * n < measured <= 6 * n, (stage, got["rows"]["grad_shard"])


def test_the_config_in_both_forms_and_its_refusals():
    ds = parse({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                "zero_optimization": {"stage": 2}}, form="deepspeed")
    assert (ds.optimizer.master_dtype, ds.optimizer.state_dtype) == ("bf16", "bf16")
    ours = parse({"precision": "bf16", "stage": 3, "optimizer": {"master_dtype": "bf16"}})
    assert (ours.optimizer.master_dtype, ours.optimizer.state_dtype) == ("bf16", "fp32")
    with pytest.raises(zerort.errors.ConfigError, match=r"bf16.bf16_master_weights_and_grads: works at stages 1-3"):
        parse({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 0}},
              form="deepspeed")
    with pytest.raises(zerort.errors.ConfigError, match=r"optimizer.master_dtype: a bf16 master needs bf16 compute"):
        parse({"precision": "fp16", "stage": 2, "optimizer": {"master_dtype": "bf16"}})
    with pytest.raises(zerort.errors.ConfigError, match=r"offload_optimizer.device 'nvme'"):
        parse({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
              form="deepspeed")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_estimator_counts_eight_bytes_per_element_of_the_shard(stage):
    numel, w = 10 ** 8, 4  # many buckets: the scratch is one of them
    fp32 = estimate_memory(numel, w, stage)["exact"]
    bf16 = estimate_memory(numel, w, stage, optimizer_state_dtype="bf16", master_dtype="bf16")["exact"]
    for k in ("master", "adam_m", "adam_v"):
        assert bf16[k] * 2 == fp32[k], k
    assert fp32["grad_shard"] / 2 < bf16["grad_shard"] < fp32["grad_shard"]  # plus one bucket's FP32 scratch


def test_a_checkpoint_of_a_bf16_master_loads_into_an_fp32_master_run(tmp_path, worker):
    base = worker.gpt2()
    cfg = {"stage": 2, "precision": "bf16", "comm": {"backend": "inprocess"}}
    e = zerort.initialize(copy.deepcopy(base), {**cfg, "optimizer": {"master_dtype": "bf16", "state_dtype": "bf16"}})
    for step in range(2):
        t = worker.batch(step, 0)
        e.backward(e(input_ids=t, labels=t).loss)
        e.step()
    e.save_checkpoint(str(tmp_path))
    e32 = zerort.initialize(copy.deepcopy(base), {**cfg, "optimizer": {"state_dtype": "bf16"}})
    e32.load_checkpoint(str(tmp_path))
    a, b = e.full_state_dict(master=True), e32.full_state_dict(master=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert e32._impl.master(0).dtype == torch.float32 and e._impl.master(0).dtype == torch.bfloat16


def test_micro_steps_accumulate_into_the_bf16_shard_rounding_once_each(worker):
    """Gradient accumulation 2 at W = 1: each micro-step stores bf16(float(old) + gradient), then the
    step averages in FP32 (Adam's moments FP32 here: a bf16 master alone). The reference does that
    with plain torch; the masters agree within one bf16 step of each element (measured: equal bits)."""
    base = worker.gpt2()
    e = zerort.initialize(copy.deepcopy(base), {"stage": 2, "precision": "bf16", "comm": {"backend": "inprocess"},
                                                "gradient_accumulation_steps": 2,
                                                "optimizer": {"lr": 3e-3, "master_dtype": "bf16"}})
    model = bf16_model(copy.deepcopy(base))
    params = dict(model.named_parameters())
    shadow = {n: p.detach().float().clone() for n, p in params.items()}
    opt = torch.optim.AdamW(list(shadow.values()), lr=3e-3, weight_decay=e.config.optimizer.weight_decay,
                            foreach=False)
    for step in range(3):
        acc = {n: torch.zeros_like(p) for n, p in params.items()}
        for micro in range(2):
            t = worker.batch(step, micro)
            e.backward(e(input_ids=t, labels=t).loss)
            e.step()
            model.zero_grad(set_to_none=True)
            model(input_ids=t, labels=t).loss.backward()
            for n, p in params.items():
                acc[n] = (acc[n].float() + p.grad.float()).to(torch.bfloat16)
        for n, s in shadow.items():
            s.grad = acc[n].float() * 0.5
        opt.step()
        with torch.no_grad():
            for n, s in shadow.items():
                s.copy_(s.to(torch.bfloat16).float())
                params[n].copy_(s)
    got = e.full_state_dict(master=True)
    for n, s in shadow.items():
        assert ((got[n] - s).abs() <= 2 ** -8 * s.abs() + 1e-30).all(), (n, (got[n] - s).abs().max())
