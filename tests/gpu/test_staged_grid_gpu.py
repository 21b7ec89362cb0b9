"""The multi-node features on one GPU (C++ Note [staging once] in comm/staged_communicator.h): W = 4
ranks under mpirun, all on cuda:0, pretending to form 2 nodes of 2, over mpi with every CUDA buffer
staged through pinned host memory. tests/python/test_staged_grid.py proves the same grid's bits equal
the direct mpi path's with CPU buffers through the same staging code; here the CUDA mover carries them:

- comm.topology two_hop (2 x 2), shard_size 2 and stage3.secondary_shard_size 2 against plain PyTorch on
  the same GPU at W = 4 (test_engine_parity.reference, its bounds);
- int8 between the hops and on the sum across groups, and ZeRO++'s three together (int8 gathers by the
  CUDA kernels, hpZ, int8 between the hops): the last loss within 1% of the exact run's;
- hpZ gives the bits of the stage-3 run without it, and the replicas of one shard hold the same bits;
- the parts are the Note's: the world and the shard group and hpZ's pair staged, the replicas host.
"""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from test_engine_parity import BOUND, global_rel, reference  # noqa: E402
from test_staged_grid import PER_NODE, W, check_parts, same_bits  # noqa: E402

import zerort  # noqa: E402
from zerort._testing.launch import launch  # noqa: E402

WORKER = os.path.join(HERE, "..", "python", "staged_grid_worker.py")
EXACT = ["two_hop@fp32/mlp:2:bf16:1:20", "mlp:2:bf16:1:20:shard@2", "two_hop@fp32/transformer:3:bf16:1:1",
         "transformer:3:bf16:1:1", "mlp:3:bf16:1:20:shard@2"]
INT8 = {"two_hop@int8/mlp:2:bf16:1:20": EXACT[0], "mlp:2:bf16:1:20:shard@2:wire@int8": EXACT[1],
        "two_hop@int8/transformer:3:bf16:1:1:hpz@2:int8gather": EXACT[2]}  # ZeRO++'s three on the GPU
HPZ = {"transformer:3:bf16:1:1:hpz@2": "transformer:3:bf16:1:1", "mlp:3:bf16:1:20:shard@2:hpz@2": EXACT[4]}
CASES = EXACT + list(INT8) + list(HPZ)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not zerort._C.with_mpi:
        pytest.skip("this build has no MPI; the staged W = 4 grid runs under mpirun")
    prefix = str(tmp_path_factory.mktemp("staged_grid_gpu") / "run")
    launch("mpirun", W, WORKER, prefix, "cuda", PER_NODE, *CASES, timeout=400, env={"PYTHONFAULTHANDLER": "1"})
    return [torch.load(f"{prefix}.rank{r}.pt") for r in range(W)]


def test_the_parts_are_staged_on_the_gpu(ranks):
    check_parts(ranks, "cuda", CASES)


@pytest.mark.parametrize("case", EXACT)
def test_the_grid_matches_torch_on_the_gpu(ranks, case):
    run = case.split("/")[-1]
    _, ref_state = reference(run, W, device="cuda")
    worst = global_rel(ranks[0][case]["master"], ref_state)
    print(f"[gpu staged grid W={W}] {case}: max |master - reference| / max |reference| = {worst:.2e}")
    assert worst < BOUND[(run.split(":")[0], int(run.split(":")[4]))], case
    assert all(r[case]["losses"] == ranks[0][case]["losses"] for r in ranks), case
    if "shard@" in case:  # the replicas of one shard
        assert torch.equal(ranks[0][case]["own_master"], ranks[2][case]["own_master"]), case


@pytest.mark.parametrize("case", list(INT8))
def test_int8_wires_stay_within_1_percent(ranks, case):
    exact = ranks[0][INT8[case]]["losses"][-1]
    print(f"[gpu staged grid W={W}] {case}: last loss {ranks[0][case]['losses'][-1]:.5f} (fp32 wire {exact:.5f})")
    assert abs(ranks[0][case]["losses"][-1] - exact) < 0.01 * exact, case


@pytest.mark.parametrize("case", list(HPZ))
def test_hpz_gives_the_bits_without_it(ranks, case):
    for r in range(W):
        same_bits({case: ranks[r][case]}, {case: ranks[r][HPZ[case]]}, f"hpZ rank {r}")
