"""The multi-node features over the staged path (C++ Note [staging once] in comm/staged_communicator.h):
what a CUDA model under mpi or gloo runs when W ranks share one GPU, here with CPU buffers through the
same staging code (zerort.comm.init(staged='cpu')). W = 4 ranks pretend to form 2 nodes of 2 on this
host (the launcher's local rank and size rewritten, as tests/python/topology_auto_worker.py does):

- comm.topology two_hop as a 2 x 2 grid, with fp32 and int8 between the hops (gradient accumulation 2:
  the staged accumulate of Note [staged accumulate]; stage 3: the two-hop all-gather too);
- hybrid sharding, shard_size 2 and "node" (the launcher's nodes: 2), summed across groups on an fp32
  and an int8 wire, with buckets of 61 elements (shards that do not divide into the groups' pieces);
- hpZ, stage3.secondary_shard_size 2, alone and within shard_size 2;
- ZeRO++'s three together: stage3.gather_dtype int8, hpZ and int8 between the hops.

Every loss and master bit equals the direct (unstaged) mpi path's, under mpirun and under torchrun
(gloo; its two-hop and hybrid sums are the mpi ones, bit for bit). The parts are what the Note says:
the world two-hop under the staging, the shard group and hpZ's part staged, the replicas a host
communicator. tests/gpu/test_staged_grid_gpu.py runs the same grid with CUDA buffers on one GPU.
"""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import zerort  # noqa: E402
from zerort._testing.launch import launch as launch_ranks  # noqa: E402

WORKER = os.path.join(HERE, "staged_grid_worker.py")
W, PER_NODE = 4, 2
CASES = ["two_hop@fp32/mlp:2:bf16:2:4", "two_hop@fp32/transformer:3:bf16:1:2", "two_hop@int8/mlp:3:fp16:1:4",
         "two_hop@int8/mlp:1:bf16:2:3:bucket@61",
         "mlp:2:bf16:2:4:shard@2", "mlp:3:bf16:1:4:shard@node:wire@int8:bucket@61",
         "transformer:3:bf16:1:2", "transformer:3:bf16:1:2:hpz@2", "mlp:3:bf16:2:3:shard@2:hpz@2",
         "two_hop@int8/transformer:3:bf16:1:2:hpz@2:int8gather"]  # ZeRO++'s three: int8 gathers, hpZ, int8 sums


def launch(launcher, staged, tmp_path, cases=CASES):
    prefix = str(tmp_path / f"{launcher}-{staged}")
    launch_ranks(launcher, W, WORKER, prefix, staged, PER_NODE, *cases, timeout=600)
    return [torch.load(f"{prefix}.rank{r}.pt") for r in range(W)]


def same_bits(got, want, what):
    for case, w in want.items():
        g = got[case]
        assert g["losses"] == w["losses"], (what, case, g["losses"], w["losses"])
        assert g["skipped"] == w["skipped"], (what, case)
        assert w["master"].keys() == g["master"].keys(), (what, case)
        for k, v in w["master"].items():
            assert torch.equal(g["master"][k], v), (what, case, k)
        assert torch.equal(g["own_master"], w["own_master"]), (what, case)


def check_parts(ranks, staged, cases=CASES):
    """The communicators each case ran on: [world, shard group, replicas, hpZ's part]."""
    suffix = "+staged-" + {"cpu": "host", "cuda": "cuda"}[staged]
    for case in cases:
        world, shard, replicas, secondary = ranks[0][case]["backends"]
        assert world.endswith(suffix) and ("+two-hop" in world) == case.startswith("two_hop@"), (case, world)
        assert (shard is not None) == ("shard@" in case) and (secondary is not None) == ("hpz@" in case), case
        assert shard is None or shard.endswith(suffix), (case, shard)
        assert secondary is None or secondary.endswith(suffix), (case, secondary)
        assert replicas is None or "staged" not in replicas, (case, replicas)  # summed on host scratch
        assert ranks[0][case]["shard_size"] == (2 if "shard@" in case else W), case


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    if not zerort._C.with_mpi:
        pytest.skip("this build has no MPI; the direct reference runs under mpirun")
    return launch("mpirun", "none", tmp_path_factory.mktemp("direct"))


def test_staged_mpi_grid_gives_the_direct_paths_bits(direct, tmp_path):
    staged = launch("mpirun", "cpu", tmp_path)
    check_parts(staged, "cpu")
    for r in range(W):
        same_bits(staged[r], direct[r], f"mpirun staged rank {r}")
    for case in CASES:  # the replicas of one shard hold the same bits
        if "shard@" in case:
            assert torch.equal(staged[0][case]["own_master"], staged[2][case]["own_master"]), case
    hpz, plain = staged[0]["transformer:3:bf16:1:2:hpz@2"], staged[0]["transformer:3:bf16:1:2"]
    assert hpz["losses"] == plain["losses"] and all(torch.equal(hpz["master"][k], v)
                                                    for k, v in plain["master"].items())
    assert hpz["backend_calls"][3] > 0  # the re-gathers ran on the staged pair


def test_staged_gloo_grid_gives_the_direct_mpi_bits(direct, tmp_path):
    staged = launch("torchrun", "cpu", tmp_path)
    check_parts(staged, "cpu")
    for r in range(W):
        same_bits(staged[r], direct[r], f"torchrun staged rank {r}")
