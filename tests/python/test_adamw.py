"""The fused AdamW kernel against torch.optim.AdamW(foreach=False) over 100 steps with
hyperparameters that change every step (lr from a warmup+cosine schedule, random betas,
eps and weight decay), and the fused unscale/finite-check/sum-of-squares pass against torch."""
import math

import numpy as np
import pytest
import torch

import zerort
from zerort._testing.kernels import adamw_step, unscale_and_check


def schedule(step, total=100, peak=3e-3):
    warm = 10
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))


def rel_err(a, b):
    if b.numel() == 0:
        return 0.0
    scale = b.abs().max().item()
    return 0.0 if scale == 0 else (a - b).abs().max().item() / scale


@pytest.mark.parametrize("n", [0, 1, 1001, (1 << 16) * 3 + 7])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lp_dtype", [torch.bfloat16, torch.float16])
def test_matches_torch_adamw_100_steps(n, grad_dtype, lp_dtype):
    gen = torch.Generator().manual_seed(n * 7 + (grad_dtype == torch.bfloat16))
    rng = np.random.default_rng(n)
    init = torch.randn(n, generator=gen)
    ref = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ref], foreach=False)
    master, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    lp = torch.empty(n, dtype=lp_dtype)
    for step in range(1, 101):
        hyper = dict(lr=schedule(step - 1), betas=(float(rng.uniform(0.3, 0.99)), float(rng.uniform(0.9, 0.9999))),
                     eps=float(10 ** rng.uniform(-9, -6)), weight_decay=float(rng.uniform(0, 0.2)))
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        for k, val in hyper.items():
            opt.param_groups[0][k] = val
        ref.grad = grad.float()
        opt.step()
        adamw_step(grad, master, m, v, lp, step=step, **hyper)
    state = opt.state[ref] if n else {"exp_avg": torch.zeros(0), "exp_avg_sq": torch.zeros(0)}
    for name, ours, theirs in [("master", master, ref.detach()), ("exp_avg", m, state["exp_avg"]),
                               ("exp_avg_sq", v, state["exp_avg_sq"])]:
        err = rel_err(ours, theirs)
        assert err <= 1e-6, f"{name}: max |diff| / max |ref| = {err:.3e}"
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6 * theirs.abs().max().item() if n else 0)
    # The low-precision copy is the master rounded to nearest even, bit for bit.
    assert torch.equal(lp.view(torch.int16), master.to(lp_dtype).view(torch.int16))


def test_fixed_betas_200_steps_match_torch():
    # Constant hyperparameters: errors in how 1 - beta2 or lr / bc1 are rounded would add up
    # step after step here instead of averaging out.
    n = 50_001
    gen = torch.Generator().manual_seed(5)
    ref = torch.nn.Parameter(torch.randn(n, generator=gen))
    master, m, v = ref.detach().clone(), torch.zeros(n), torch.zeros(n)
    hyper = dict(lr=1e-3, betas=(0.9, 0.9999), eps=1e-8, weight_decay=0.1)
    opt = torch.optim.AdamW([ref], foreach=False, **hyper)
    for step in range(1, 201):
        grad = torch.randn(n, generator=gen)
        ref.grad = grad
        opt.step()
        adamw_step(grad, master, m, v, None, step=step, **hyper)
    st = opt.state[ref]
    for name, ours, theirs in [("master", master, ref.detach()), ("exp_avg", m, st["exp_avg"]),
                               ("exp_avg_sq", v, st["exp_avg_sq"])]:
        assert rel_err(ours, theirs) <= 1e-6, f"{name}: {rel_err(ours, theirs):.3e}"


def test_bf16_weight_write_is_rne_of_master():
    master = torch.randn(4099) * 100
    lp = torch.empty(4099, dtype=torch.bfloat16)
    adamw_step(torch.zeros(4099), master, torch.zeros(4099), torch.zeros(4099), lp, lr=0.0,
               betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=1)
    assert torch.equal(lp.view(torch.int16), master.bfloat16().view(torch.int16))


def test_adamw_rejects_bad_hyperparameters():
    t = torch.zeros(3)
    with pytest.raises(zerort.Error, match="betas must be in"):
        adamw_step(t, t.clone(), t.clone(), t.clone(), None, lr=1e-3, betas=(1.0, 0.9), eps=1e-8,
                   weight_decay=0.0, step=1)
    with pytest.raises(zerort.Error, match="step count must be >= 1"):
        adamw_step(t, t.clone(), t.clone(), t.clone(), None, lr=1e-3, betas=(0.9, 0.9), eps=1e-8,
                   weight_decay=0.0, step=0)


@pytest.mark.parametrize("n", [0, 1, 7, 65536 * 2 + 5])
def test_unscale_and_check(n):
    g = torch.randn(n, dtype=torch.float64)
    g32 = (g * 1024).float()
    expect = (g32.double() / 1024)
    nonfinite, sumsq = unscale_and_check(g32, 1 / 1024)
    assert nonfinite == 0
    assert torch.equal(g32, (expect).float())
    assert math.isclose(sumsq, float((g32.double() ** 2).sum()), rel_tol=1e-12, abs_tol=0)
    if n:
        g32[n // 2] = float("inf")
        g32[0] = float("nan")
        nonfinite, _ = unscale_and_check(g32, 1.0)
        assert nonfinite == (2 if n > 1 else 1)


def test_unscale_sum_is_reproducible_across_thread_counts():
    import subprocess
    import sys
    code = ("import torch, zerort._testing.kernels as k; g = torch.randn(1 << 20, generator=torch.Generator()"
            ".manual_seed(3)); print(repr(k.unscale_and_check(g, 0.5)[1]))")
    outs = {subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ,
                                                               "ZERORT_NUM_THREADS": str(t)},
                           capture_output=True, text=True, check=True).stdout for t in (1, 2, 3)}
    assert len(outs) == 1, outs
