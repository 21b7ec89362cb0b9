"""The NCCL split at W = 1 (C++ Note [nccl parts], comm/nccl/nccl_split.h): a group of 1 over a
world of 1 still goes through ncclCommSplit. Its parts form (rank 0 of 1, their own nccl
communicators), reduce CUDA buffers (the FP64 local sum: the CPU's bits), carry the two-hop
communicator on the GPU (Note [two hops on the device]), and are destroyed with their owners
while the parent keeps working, 20 times over. Bad splits are refused naming the group and the
rank: a negative color and a parent that is not nccl (a late split: test_gpu_nccl_split_timeout.py)."""
import gc

import pytest
import torch

import zerort
from zerort import _C
from zerort.comm import Communicator, topology

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def world():
    impl = _C.make_nccl_communicator(0, 1, 0, _C.nccl_unique_id(), TIMEOUT_S, False)
    return Communicator(impl, "cuda:0")


def reduce_bits(comm, n=1001):
    """reduce_scatter_accumulate of bf16 values into an FP32 start on the GPU, and the CPU's."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 3).to(torch.bfloat16)
    start = torch.randn(n, generator=g)
    want = start.clone()
    _C.sum_chunks_to_f32(x.data_ptr(), "bfloat16", 1, n, want.data_ptr(), True)
    out, xd = start.cuda(), x.cuda()
    comm.reduce_scatter_accumulate(xd.data_ptr(), "bfloat16", out.data_ptr(), n, True)
    torch.cuda.synchronize()
    return out.cpu(), want


def test_a_part_of_one_forms_and_reduces(world):
    part = _C.make_nccl_part(world._c, 0, 0, topology.group_name("row", 0, 1, [0]), TIMEOUT_S, False)
    assert (part.rank, part.size, part.backend) == (0, 1, "nccl")
    got, want = reduce_bits(part)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    buf = torch.arange(7, dtype=torch.float32, device="cuda")
    Communicator(part, "cuda:0").all_reduce(buf, "sum")
    assert torch.equal(buf.cpu(), torch.arange(7, dtype=torch.float32))


def test_grid_parts_and_the_two_hop_over_them(world):
    row, column = topology.grid_parts(world, "nccl", 1, TIMEOUT_S, False)
    hops = _C.make_two_hop_communicator(world._c, row, column, "int8", TIMEOUT_S, False, 0)
    assert hops.backend == "nccl+two-hop"
    got, want = reduce_bits(hops)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # A part of the two-hop communicator is split off its flat one.
    again = _C.make_nccl_part(hops, 0, 0, "row 0 of 1 (ranks 0)", TIMEOUT_S, False)
    assert again.size == 1


def test_parts_are_destroyed_and_the_parent_keeps_working(world):
    for i in range(20):
        part = _C.make_nccl_part(world._c, 0, 0, f"row 0 of 1 (ranks 0), split {i}", TIMEOUT_S, False)
        reduce_bits(part, 33)
        del part
        gc.collect()
    got, want = reduce_bits(world._c)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    buf = torch.ones(3, device="cuda")
    world.all_reduce(buf, "sum")
    assert torch.equal(buf.cpu(), torch.ones(3))


def test_bad_splits_name_the_group_and_the_rank(world):
    with pytest.raises(zerort.ConfigError, match=r"splitting off row 1 of 2 \(ranks 2,3\) on rank 0 of 1 "
                                                 r"\(color -1, key 0\): color and key must be >= 0"):
        _C.make_nccl_part(world._c, -1, 0, "row 1 of 2 (ranks 2,3)", TIMEOUT_S, False)
    host = _C.make_communicator("inprocess", TIMEOUT_S, False)
    not_nccl = r"column 0 of 1 \(ranks 0\): the parent communicator is 'inprocess', not nccl"
    with pytest.raises(zerort.Error, match=not_nccl):
        _C.make_nccl_part(host, 0, 0, "column 0 of 1 (ranks 0)", TIMEOUT_S, False)
    got, want = reduce_bits(world._c)  # a refused split leaves the parent as it was
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))

