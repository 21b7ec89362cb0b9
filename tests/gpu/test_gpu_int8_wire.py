"""The 8-bit wires' CUDA kernels (comm/int8_blocks_cuda.h) against the CPU codes (Note [int8
blocks]) on the vectors of tests/python/test_int8_wire.py: the wire's bytes (codes, padding and
FP32 scales) equal byte for byte, the decoded values bit for bit (a block with a NaN or an
infinity: NaN in the same places, Note [one 8-bit arithmetic]), for int8 and fp8_e4m3, sizes 0,
1, odd and not multiples of blocks of 64, 256 and 2048; ties of both codes; zero, tiny and
non-finite blocks (several NaNs: the first one's magnitude is the scale); and the FP64 sum of
W = 1, 3 and 4 decoded wires against the CPU decode and sum_chunks_to_f32, with accumulate."""
import pytest
import torch

from test_int8_wire import gradient_like
from zerort import _C
from zerort._testing.kernels import int8_blocks

CODES = ["int8", "fp8_e4m3"]


def same_bits(a, b):
    a, b = a.cpu(), b.cpu()
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | both_nan).all())


def cuda_blocks(x, block, code):
    """(wire, decoded) from the CUDA kernels, on the CPU for comparison."""
    n = x.numel()
    wire = torch.full((_C.int8_wire_bytes(n, block),), 0xAB, dtype=torch.uint8, device="cuda")  # padding is written
    out = torch.empty(n, dtype=torch.float32, device="cuda")
    xd = x.cuda()
    _C.encode_8bit_blocks_cuda(code, xd.data_ptr(), n, wire.data_ptr(), block)
    _C.decode_8bit_blocks_cuda(code, wire.data_ptr(), n, out.data_ptr(), block)
    return wire.cpu(), out.cpu()


def special_vectors(block, code):
    """Zero, tiny, ties and non-finite blocks, one block each."""
    x = gradient_like(8 * block, block)
    x[:block] = 0
    x[block:2 * block] = 1e-44  # the scale rounds to 0: zeros are sent
    top = 127.0 if code == "int8" else 448.0  # scale exactly 1: the codes' own ties
    ties = torch.arange(block, dtype=torch.float32) % 100 + 0.5 if code == "int8" else \
        torch.tensor([3 * 2.0 ** -10, 5 * 2.0 ** -10, 1 + 1 / 16, 1 + 3 / 16, 17.0, 19.0, 2.5, -2.25] * block)[:block]
    x[2 * block:3 * block] = ties
    x[2 * block] = top
    x[3 * block + 3] = float("inf")
    x[4 * block + 9] = -float("nan")  # the first NaN's magnitude is the block's a
    x[4 * block + 1] = float("inf")
    x[4 * block + block - 1] = float("nan")
    x[5 * block:6 * block] = -x[5 * block:6 * block].abs()  # one sign
    x[6 * block:7 * block] = top * (torch.arange(block) % 2 * 2 - 1).float()  # at the largest code
    return x


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("block", [64, 256, 2048])
@pytest.mark.parametrize("n", [0, 1, 7, 255, 257, 1001, 5000])
def test_kernels_equal_the_cpu_codes(code, n, block):
    x = gradient_like(n, n * 31 + block)
    wire, decoded = int8_blocks(x, block, code)
    got_wire, got = cuda_blocks(x, block, code)
    assert torch.equal(got_wire, wire)
    assert same_bits(got, decoded)


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("block", [64, 256])
def test_special_blocks_equal_the_cpu_codes(code, block):
    x = special_vectors(block, code)
    wire, decoded = int8_blocks(x, block, code)
    got_wire, got = cuda_blocks(x, block, code)
    assert torch.equal(got_wire, wire)
    assert same_bits(got, decoded)
    assert torch.isnan(got[3 * block:5 * block]).all() and not torch.isnan(got[:3 * block]).any()


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 257, 5000])
@pytest.mark.parametrize("accumulate", [False, True])
def test_the_sum_of_decoded_wires_equals_the_cpu_sum(code, world, n, accumulate):
    wire_bytes = _C.int8_wire_bytes(n, _C.INT8_BLOCK)
    wires, decoded = torch.empty(world * wire_bytes, dtype=torch.uint8), torch.empty(world * n)
    for r in range(world):
        w, d = int8_blocks(gradient_like(n, 97 * r + n) * 2.0 ** r, _C.INT8_BLOCK, code)
        wires[r * wire_bytes:(r + 1) * wire_bytes], decoded[r * n:(r + 1) * n] = w, d
    start = gradient_like(n, 5)
    want = start.clone()
    _C.sum_chunks_to_f32(decoded.data_ptr(), "float32", world, n, want.data_ptr(), accumulate)
    got = start.cuda()
    _C.sum_8bit_wires_cuda(code, wires.cuda().data_ptr(), world, n, got.data_ptr(), accumulate)
    assert same_bits(got, want)


@pytest.mark.parametrize("n", [0, 1, 1001, 5000])
def test_stage3_int8_gather_on_the_gpu_equals_the_cpu_codes(n):
    """runtime/int8_gather.h on cuda:0 over an nccl communicator of one rank: the bf16 chunk cast
    to FP32, coded, gathered and decoded into bf16, against the CPU's casts and codes."""
    comm = _C.make_nccl_communicator(0, 1, 0, _C.nccl_unique_id(), 20.0, False)
    own = (gradient_like(n, n + 3) * 100).to(torch.bfloat16)
    x = torch.empty(n, dtype=torch.float32)
    _C.cast_to_f32(own.data_ptr(), "bfloat16", x.data_ptr(), n)
    _, decoded = int8_blocks(x, _C.INT8_BLOCK, "int8")
    want = torch.empty(n, dtype=torch.bfloat16)
    _C.cast_from_f32(decoded.data_ptr(), want.data_ptr(), "bfloat16", n)
    full = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    _C.gather_int8_blocks(comm, own.cuda().data_ptr(), "bfloat16", n, full.data_ptr(), 0)
    assert torch.equal(full.cpu().view(torch.int16), want.view(torch.int16))
