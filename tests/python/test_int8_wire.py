"""The two-hop int8 wire (C++ Note [int8 blocks], comm/int8_blocks.h) against a reference
quantizer written here in torch: per block of `block` elements the scale a / 127 in FP32 (a the
largest magnitude), codes round(x / scale) to nearest even, the receiver's code * scale in FP32.
Bit for bit, at sizes 0, 1, odd and not multiples of the block, for blocks of 64, 256 and 2048;
the stated error bound; zero, tiny and non-finite blocks; and the wire's size. Then the same
wire for stage 3's weight gathers (stage3.gather_dtype int8, DeepSpeed's zero_quantized_weights)."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from zerort import _C  # noqa: E402
from zerort._testing.kernels import int8_blocks  # noqa: E402


def reference(x, block):
    """(codes as int8, scales as float32, decoded float32): the quantizer as Note [int8 blocks] states it."""
    n = x.numel()
    codes, scales, out = torch.zeros(n, dtype=torch.int8), [], torch.empty(n, dtype=torch.float32)
    for lo in range(0, n, block):
        xb = x[lo:lo + block]
        a = xb.abs().max() if not torch.isnan(xb).any() else torch.tensor(float("nan"))
        if not torch.isfinite(a):
            scale = a.to(torch.float32)
            codes[lo:lo + block] = 0
        else:
            scale = (a / 127).to(torch.float32)
            q = torch.zeros_like(xb) if scale == 0 else torch.round(xb / scale)
            codes[lo:lo + block] = q.to(torch.int8)
        scales.append(scale.item())
        out[lo:lo + block] = codes[lo:lo + block].to(torch.float32) * scale
    return codes, torch.tensor(scales, dtype=torch.float32), out


def split_wire(wire, n, block):
    codes = wire[:n].view(torch.int8)
    pad = (n + 3) // 4 * 4
    assert torch.all(wire[n:pad] == 0)
    return codes, wire[pad:].view(torch.float32)


def gradient_like(n, seed):
    """Values over many magnitudes, both signs, as gradients are."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 4, (n,), generator=g).float())).float()


@pytest.mark.parametrize("block", [64, 256, 2048])
@pytest.mark.parametrize("n", [0, 1, 7, 255, 257, 1001, 5000])
def test_the_kernel_equals_the_reference_bit_for_bit(n, block):
    x = gradient_like(n, n * 31 + block)
    wire, decoded = int8_blocks(x, block)
    assert wire.numel() == _C.int8_wire_bytes(n, block) == (n + 3) // 4 * 4 + 4 * math.ceil(n / block)
    codes, scales, want = reference(x, block)
    got_codes, got_scales = split_wire(wire, n, block)
    assert torch.equal(got_codes, codes)
    assert torch.equal(got_scales, scales)
    assert torch.equal(decoded, want)


@pytest.mark.parametrize("block", [64, 256, 2048])
def test_each_value_is_within_half_a_step_of_its_block(block):
    x = gradient_like(10_000, block)
    _, decoded = int8_blocks(x, block)
    for lo in range(0, x.numel(), block):
        xb, db = x[lo:lo + block].double(), decoded[lo:lo + block].double()
        a = xb.abs().max().item()
        assert (db - xb).abs().max().item() <= a / 254 + a * 2.0 ** -22


def test_zero_tiny_and_non_finite_blocks():
    block = 64
    x = gradient_like(4 * block, 5)
    x[:block] = 0  # a zero block sends zeros
    x[block:2 * block] = 1e-44  # below 127 subnormals: the scale rounds to 0, zeros are sent
    x[2 * block + 3] = float("inf")  # the whole block arrives as NaN: the step's check sees it
    x[3 * block + 9] = float("nan")
    _, decoded = int8_blocks(x, block)
    assert torch.equal(decoded[:2 * block], torch.zeros(2 * block))
    assert torch.isnan(decoded[2 * block:]).all()


def fp8_reference(x, block):
    """fp8_e4m3 blocks through torch's own float8_e4m3fn cast (round to nearest even)."""
    out = torch.empty_like(x)
    for lo in range(0, x.numel(), block):
        xb = x[lo:lo + block]
        a = xb.abs().max() if not torch.isnan(xb).any() else torch.tensor(float("nan"))
        if not torch.isfinite(a):
            out[lo:lo + block] = float("nan")
            continue
        scale = (a / 448).to(torch.float32)
        q = torch.zeros_like(xb) if scale == 0 else (xb / scale).to(torch.float8_e4m3fn).to(torch.float32)
        out[lo:lo + block] = q * scale
    return out


@pytest.mark.parametrize("block", [64, 256, 2048])
@pytest.mark.parametrize("n", [0, 1, 7, 255, 257, 1001, 5000])
def test_fp8_equals_torchs_e4m3_cast_bit_for_bit(n, block):
    x = gradient_like(n, n * 17 + block)
    wire, decoded = int8_blocks(x, block, "fp8_e4m3")
    assert wire.numel() == _C.int8_wire_bytes(n, block)
    assert torch.equal(decoded, fp8_reference(x, block))
    xb = torch.tensor([448.0, -448.0, 3 * 2.0 ** -10, 5 * 2.0 ** -10, 1.0 + 1 / 16, 1.0 + 3 / 16])  # ties, subnormals
    _, got = int8_blocks(xb, 6, "fp8_e4m3")
    assert torch.equal(got, fp8_reference(xb, 6))


def test_fp8_non_finite_blocks_arrive_as_nan():
    x = gradient_like(128, 3)
    x[70] = float("inf")
    _, decoded = int8_blocks(x, 64, "fp8_e4m3")
    assert not torch.isnan(decoded[:64]).any() and torch.isnan(decoded[64:]).all()


def test_the_default_block_is_the_notes():
    assert _C.INT8_BLOCK == 256
    wire, _ = int8_blocks(torch.ones(1000))
    assert wire.numel() == 1000 + 4 * 4


def test_zero_quantized_weights_is_stage3_int8_gathers():
    from zerort.config import native, parse

    ds = parse({"train_batch_size": 8, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}})
    ours = parse({"stage": 3, "stage3": {"gather_dtype": "int8"}})
    assert ds.stage3.gather_dtype == ours.stage3.gather_dtype == "int8"
    assert native.engine_options(ours, torch.device("cpu")).gather_int8
    assert not native.engine_options(parse({"stage": 3}), torch.device("cpu")).gather_int8


def test_int8_gathers_at_stage_3_w2(tmp_path):
    """GPT-2 from a small config at W = 2 (torchrun, gloo): every rank ends with the same
    weights, not the plain run's, and each step's loss within 2% of the plain run's; its
    save_16bit_model holds the master's values cast to bf16."""
    from test_engine_parity import launch

    plain = "gpt2:3:bf16:1:6:bucket@1999"
    ranks = launch("torchrun", 2, [plain, f"{plain}:int8gather"], tmp_path)
    q = [r[f"{plain}:int8gather"] for r in ranks]
    for name, t in q[0]["params"].items():
        assert torch.equal(q[1]["params"][name], t), name
    assert any(not torch.equal(t, ranks[0][plain]["params"][n]) for n, t in q[0]["params"].items())
    for a, b in zip(q[0]["losses"], ranks[0][plain]["losses"]):
        assert abs(a - b) <= 0.02 * abs(b), (a, b)
    for name, t in q[0]["saved16"].items():  # save_16bit_model: the master cast, not the decoded weights
        want = q[0]["master"][name].to(t.dtype) if t.is_floating_point() else q[0]["master"][name]
        assert torch.equal(t, want), name
