"""The nccl branch of zerort.comm.topology (C++ Note [nccl parts], comm/nccl/nccl_split.h) on this
CPU machine: with _C's make_nccl_part and make_two_hop_communicator replaced by recorders, every
rank of W = 1, 4 and 6 splits its row and then its column with the colors, keys and group names
that the grid of consecutive ranks gives (worked out here from the ranks, not from the code);
shard_size, stage3.secondary_shard_size and comm.topology two_hop are accepted under nccl and
build their parts that way, the two-hop communicator on the flat communicator's GPU; auto stays
flat under nccl without a split (its probe times host buffers); in-process is still refused by
name; and the two-hop factory takes a CUDA device only for device parts, its W = 1 reduce being the flat
one's. The splits themselves run on a GPU: tests/gpu/test_gpu_nccl_parts.py (scripts/gpu_check.sh)."""
import types

import pytest
import torch

import zerort
from zerort import _C
from zerort.comm import topology


class Recorder:
    """Stands in for zerort._C: each make_nccl_part call is recorded and returns its own token."""

    def __init__(self):
        self.splits, self.two_hops = [], []

    def make_nccl_part(self, comm, color, key, group, timeout_s, debug):
        self.splits.append((comm, color, key, group, timeout_s, debug))
        return ("part", color, key)

    def make_two_hop_communicator(self, flat, intra, inter, inter_dtype, timeout_s, debug, device):
        self.two_hops.append((flat, intra, inter, inter_dtype, device))
        return "hops"


@pytest.fixture
def fake_c(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(topology, "_C", recorder)
    return recorder


def nccl_comm(rank, size, device="cuda:1"):
    return types.SimpleNamespace(rank=rank, size=size, _c=f"flat{rank}", device=torch.device(device))


def expected_splits(rank, size, per_row):
    """(color, key, name) of the row, then the column, from the ranks laid out row by row."""
    grid = [list(range(r, r + per_row)) for r in range(0, size, per_row)]
    row = next(i for i, ranks in enumerate(grid) if rank in ranks)
    index = grid[row].index(rank)
    column = [ranks[index] for ranks in grid]
    return [(row, index, f"row {row} of {len(grid)} (ranks {','.join(map(str, grid[row]))})"),
            (index, row, f"column {index} of {per_row} (ranks {','.join(map(str, column))})")]


@pytest.mark.parametrize("size,per_row", [(1, 1), (4, 2), (6, 2), (6, 3)])
def test_grid_parts_split_rows_then_columns_with_named_groups(fake_c, size, per_row):
    for rank in range(size):
        fake_c.splits.clear()
        row, column = topology.grid_parts(nccl_comm(rank, size), "nccl", per_row, 7.5, True)
        got = [(color, key, group) for _, color, key, group, _, _ in fake_c.splits]
        assert got == expected_splits(rank, size, per_row)
        assert all(c == f"flat{rank}" and t == 7.5 and d is True for c, _, _, _, t, d in fake_c.splits)
        assert row == ("part",) + got[0][:2] and column == ("part",) + got[1][:2]


def test_the_issues_example_name():
    assert topology.group_name("row", 1, 2, [2, 3]) == "row 1 of 2 (ranks 2,3)"


def test_shard_size_and_hpz_are_split_under_nccl(fake_c):
    comm = nccl_comm(3, 4)
    group, replicas = topology.shard_groups(comm, "nccl", 2, 10, False, {})
    assert (group, replicas) == (("part", 1, 1), ("part", 1, 1))  # rank 3: row 1 index 1, column 1 row 1
    assert [s[3] for s in fake_c.splits] == ["row 1 of 2 (ranks 2,3)", "column 1 of 2 (ranks 1,3)"]
    fake_c.splits.clear()
    assert topology.node_part(nccl_comm(2, 6), "nccl", 3, 10, False, {}) == ("part", 0, 2)
    assert [s[3] for s in fake_c.splits] == ["row 0 of 2 (ranks 0,1,2)", "column 2 of 3 (ranks 2,5)"]
    fake_c.splits.clear()  # a group of the whole world, or of one rank: no split at all
    assert topology.shard_groups(comm, "nccl", 4, 10, False, {}) == (None, None)
    assert topology.node_part(comm, "nccl", 1, 10, False, {}) is None
    assert fake_c.splits == []


def test_two_hop_under_nccl_splits_and_runs_on_the_gpu(fake_c, monkeypatch):
    monkeypatch.setattr(topology, "layout", lambda comm, env: ((2, 2), None))
    comm = nccl_comm(2, 4, "cuda:3")
    hops, decision = topology.two_hop(comm, "nccl", "two_hop", "fp8_e4m3", 10, False, {})
    assert (hops, decision) == ("hops", None)
    assert [s[3] for s in fake_c.splits] == ["row 1 of 2 (ranks 2,3)", "column 0 of 2 (ranks 0,2)"]
    assert fake_c.two_hops == [("flat2", ("part", 1, 0), ("part", 0, 1), "fp8_e4m3", 3)]


def test_host_backends_keep_the_host_two_hop(fake_c, monkeypatch):
    monkeypatch.setattr(topology, "layout", lambda comm, env: ((2, 2), None))
    monkeypatch.setattr(topology, "grid_parts", lambda comm, backend, per_row, t, d: ("intra", "inter"))
    topology.two_hop(nccl_comm(0, 4, "cpu"), "mpi", "two_hop", "int8", 10, False, {})
    assert fake_c.two_hops == [("flat0", "intra", "inter", "int8", -1)]


def test_auto_stays_flat_under_nccl_without_splitting(fake_c, monkeypatch):
    monkeypatch.setattr(topology, "layout", lambda comm, env: pytest.fail("auto under nccl probes nothing"))
    assert topology.two_hop(nccl_comm(0, 4), "nccl", "auto", "fp32", 10, False, {}) == (None, None)
    assert fake_c.splits == [] and fake_c.two_hops == []


def test_inprocess_is_still_refused_by_name(fake_c):
    comm = nccl_comm(1, 4, "cpu")
    refused = "'two_hop' is built for the mpi, gloo, nccl backends, not 'inprocess'"
    with pytest.raises(zerort.ConfigError, match=refused):
        topology.two_hop(comm, "inprocess", "two_hop", "fp32", 10, False, {})
    for call in (lambda: topology.shard_groups(comm, "inprocess", 2, 10, False, {}),
                 lambda: topology.node_part(comm, "inprocess", 2, 10, False, {})):
        with pytest.raises(zerort.ConfigError, match="built for the mpi, gloo, nccl backends, not 'inprocess'"):
            call()


def test_the_two_hop_factory_takes_a_device_only_for_device_parts():
    """make_two_hop_communicator's device: -1 for host parts (here in-process ones of one rank), a
    refusal naming the backend otherwise; at W = 1 the two-hop communicator's reduce is its flat
    one's, bit for bit the FP64 sum."""
    make = lambda: _C.make_communicator("inprocess", 10.0, False)
    with pytest.raises(zerort.Error, match="'inprocess' moves host memory: pass device -1, got device 0"):
        _C.make_two_hop_communicator(make(), make(), make(), "int8", 10.0, False, 0)
    hops = _C.make_two_hop_communicator(make(), make(), make(), "int8", 10.0, False)
    assert hops.backend == "inprocess+two-hop" and not hops.device_memory
    x = (torch.randn(1001, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    got = torch.randn(1001, generator=torch.Generator().manual_seed(2))
    want = got.clone()
    _C.sum_chunks_to_f32(x.data_ptr(), "bfloat16", 1, 1001, want.data_ptr(), True)
    hops.reduce_scatter_accumulate(x.data_ptr(), "bfloat16", got.data_ptr(), 1001, True)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
