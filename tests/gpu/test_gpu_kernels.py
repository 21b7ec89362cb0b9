"""The CUDA kernels against the CPU kernels, on fresh random data every run (the seed is
printed; never zeros): casts, the local sum and AdamW bitwise, the unscale
pass bitwise on the gradient and to FP64 summation order on the sum of squares. Sizes 0, 1,
odd and large, and pointers that are not 16-byte aligned (the vector paths' scalar tails)."""
import os

import pytest
import torch

from zerort._testing import kernels
from zerort._testing.kernels import cast

SEED = int.from_bytes(os.urandom(4), "little")
SIZES = [0, 1, 7, 1000, (1 << 22) + 5]
print(f"[gpu kernels] seed {SEED}")


def gen(n, offset=0):
    g = torch.Generator().manual_seed(SEED + n + offset)
    return g


def normal(n, scale=1.0, offset=0):
    return torch.randn(n, generator=gen(n, offset)) * scale


def misaligned(t, device):
    """t's values on device, starting one element into a buffer: not 16-byte aligned."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
    buf[1:].copy_(t)
    return buf[1:]


def same_bits(a, b):
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        both_nan = torch.isnan(a.float()) & torch.isnan(b.float())
        a_bits = a.view(torch.int16 if a.element_size() == 2 else torch.int32)
        b_bits = b.view(torch.int16 if b.element_size() == 2 else torch.int32)
        return bool(((a_bits == b_bits) | both_nan).all())
    return torch.equal(a, b)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("aligned", [True, False])
def test_casts_match_cpu_bitwise(n, dtype, aligned):
    bits = torch.randint(-2**31, 2**31 - 1, (n,), generator=gen(n), dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)  # every bit pattern: NaN, Inf, subnormals
    dev = x.cuda() if aligned else misaligned(x, "cuda")
    assert same_bits(cast(dev, dtype), cast(x, dtype))
    half = torch.randint(-2**15, 2**15 - 1, (n,), generator=gen(n, 1), dtype=torch.int32).to(torch.int16).view(dtype)
    hdev = half.cuda() if aligned else misaligned(half, "cuda")
    assert same_bits(cast(hdev, torch.float32), cast(half, torch.float32))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("accumulate", [False, True])
def test_sum_chunks_matches_cpu_bitwise(n, world, dtype, accumulate):
    chunks = (normal(world * n, 3.0) * torch.logspace(-4, 4, max(world * n, 1))[: world * n]).to(dtype)
    out = normal(n, offset=2)
    ref = kernels.sum_chunks_to_f32(chunks, out.clone(), accumulate)
    got = kernels.sum_chunks_to_f32(chunks.cuda(), out.cuda(), accumulate)
    assert same_bits(got, ref)
    if n > 0 and not accumulate:
        exact = chunks.double().view(world, n).sum(0).float()  # the independent reference
        assert same_bits(ref, exact)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, None])
@pytest.mark.parametrize("aligned", [True, False])
def test_adamw_matches_cpu(n, out_dtype, aligned):
    grad, master = normal(n, 1e-2), normal(n, offset=1)
    m, v = normal(n, 1e-3, offset=2), normal(n, 1e-3, offset=3).square()
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, step=7, grad_multiplier=0.5)
    cpu = [t.clone() for t in (grad, master, m, v)]
    dev = [(t.cuda() if aligned else misaligned(t, "cuda")) for t in (grad, master, m, v)]
    p_cpu = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    p_dev = None if out_dtype is None else torch.empty(n, dtype=out_dtype, device="cuda")
    kernels.adamw_step(*cpu, p_cpu, **hyper)
    kernels.adamw_step(*dev, p_dev, **hyper)
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), dev[1:], cpu[1:]):
        # One arithmetic on both sides (optim/adamw_math.h: each operation rounded on its own,
        # the same two FMAs), so the bits are the CPU kernel's.
        assert same_bits(a.cpu(), b), f"{name}: CUDA AdamW differs from the CPU kernel's bits (seed {SEED})"
    if out_dtype is not None:  # the low-precision copy is the rounded master, on each side
        assert same_bits(p_dev, cast(dev[1].contiguous(), out_dtype))


@pytest.mark.parametrize("n", SIZES)
def test_unscale_and_check_matches_cpu(n):
    g = normal(n, 100.0)
    if n > 3:
        g[n // 2], g[n // 3] = float("nan"), float("inf")
    cpu, dev = g.clone(), g.cuda()
    bad_c, _ = kernels.unscale_and_check(cpu, 1.0 / 1024)
    bad_d, _ = kernels.unscale_and_check(dev, 1.0 / 1024)
    assert bad_c == bad_d == (2 if n > 3 else 0)
    assert same_bits(dev, cpu)  # one correctly rounded multiply per element on both sides
    clean = normal(n, 100.0, offset=5)
    _, ss_c = kernels.unscale_and_check(clean.clone(), 1.0 / 1024)
    _, ss_d = kernels.unscale_and_check(clean.cuda(), 1.0 / 1024)
    ref = ((clean * (1.0 / 1024)).double() ** 2).sum().item()  # FP64 sums, different orders
    assert abs(ss_d - ref) <= 1e-12 * ref and abs(ss_c - ref) <= 1e-12 * ref, (ss_d, ss_c, ref)
