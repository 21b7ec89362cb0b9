"""zerort's casts against torch's .to(): all 65,536 bf16 and f16 bit patterns, and 10^6
random fp32 values with specials.

NaN: torch 2.13 itself does not give one NaN bit pattern. On this CPU, f32 -> bf16 gives
0xFFFF under AVX2/AVX-512 dispatch but 0x7FC0 under ATEN_CPU_CAPABILITY=default, and f16 ->
f32 gives 0x7FFFFFFF for short tensors but a sign- and payload-keeping quiet NaN for long
ones. So for NaN inputs we require a NaN output, and we pin our own documented pattern
(sign and top payload bits kept, quiet bit set, as x86 F16C and AVX512-BF16 do) exactly.
Every other value, Inf and subnormals included, must match torch bit for bit.
"""
import numpy as np
import pytest
import torch

import zerort
from zerort._testing.kernels import cast

U16 = {torch.bfloat16: np.uint16, torch.float16: np.uint16}


def bits16(t):
    return t.view(torch.int16).numpy().view(np.uint16)


def bits32(t):
    return t.view(torch.int32).numpy().view(np.uint32)


def from_bits16(b, dtype):
    return torch.from_numpy(b.astype(np.uint16).view(np.int16)).view(dtype)


def random_fp32(n, seed):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)  # every pattern
    normal = rng.standard_normal(n // 4).astype(np.float32).view(np.uint32)
    raw[: n // 4] = normal  # common magnitudes
    specials = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
                         0x7F800001, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x477FF000, 0x477FEFFF,
                         0x33000000, 0x33000001, 0x387FE000, 0x3F808000, 0x3F818000], np.uint32)
    raw[-len(specials):] = specials
    return torch.from_numpy(raw.view(np.float32))


def expect_nan_pattern_narrow(x_bits, out_bits, dtype):
    shift, quiet = (16, 0x0040) if dtype == torch.bfloat16 else (13, 0x0200)
    sign = (x_bits >> 16) & 0x8000
    exp = 0x7F80 if dtype == torch.bfloat16 else 0x7C00
    mant_mask = 0x7F if dtype == torch.bfloat16 else 0x3FF
    want = sign | exp | quiet | ((x_bits & 0x7FFFFF) >> shift & mant_mask)
    np.testing.assert_array_equal(out_bits, want.astype(np.uint16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_16bit_patterns_widen(dtype):
    pats = np.arange(65536, dtype=np.uint32)
    h = from_bits16(pats, dtype)
    ours = cast(h, torch.float32)
    ref = h.to(torch.float32)
    nan = torch.isnan(ref).numpy()
    assert nan.sum() == (254 if dtype == torch.bfloat16 else 2046)
    np.testing.assert_array_equal(bits32(ours)[~nan], bits32(ref)[~nan])
    assert torch.isnan(ours).numpy()[nan].all()
    # our NaN pattern: the 16-bit pattern widened, quiet bit set
    shift = 16 if dtype == torch.bfloat16 else 13
    p = pats[nan]
    mant = (p & (0x7F if dtype == torch.bfloat16 else 0x3FF)) << shift
    want = ((p & 0x8000) << 16) | 0x7F800000 | mant | (0 if dtype == torch.bfloat16 else 0x400000)
    np.testing.assert_array_equal(bits32(ours)[nan], want.astype(np.uint32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_16bit_patterns_round_trip_narrow(dtype):
    # Every 16-bit value widened to fp32 and narrowed back gives the same bits as torch.
    h = from_bits16(np.arange(65536, dtype=np.uint32), dtype)
    f = h.to(torch.float32)
    ours, ref = bits16(cast(f, dtype)), bits16(f.to(dtype))
    nan = torch.isnan(f).numpy()
    np.testing.assert_array_equal(ours[~nan], ref[~nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_million_random_fp32_narrow(dtype):
    x = random_fp32(1_000_000, seed=7 if dtype == torch.bfloat16 else 8)
    ours, ref = bits16(cast(x, dtype)), bits16(x.to(dtype))
    nan = torch.isnan(x).numpy()
    assert 1000 < nan.sum() < 10000  # the random patterns include many NaNs
    mismatch = np.nonzero(ours[~nan] != ref[~nan])[0]
    assert mismatch.size == 0, (
        f"{mismatch.size} mismatches, first input bits {bits32(x)[~nan][mismatch[0]]:#010x}: "
        f"ours {ours[~nan][mismatch[0]]:#06x} torch {ref[~nan][mismatch[0]]:#06x}")
    assert torch.isnan(cast(x, dtype)[torch.from_numpy(nan)].float()).all()
    expect_nan_pattern_narrow(bits32(x)[nan].astype(np.uint32), ours[nan], dtype)


def test_cast_rejects_bad_dtypes():
    with pytest.raises(TypeError, match="one side must be torch.float32"):
        cast(torch.zeros(3, dtype=torch.float16), torch.bfloat16)
    with pytest.raises(zerort.Error, match="target dtype must be bf16, f16 or f32"):
        cast(torch.zeros(3), torch.int32)
