"""Real multi-process runs of the Python API: gloo under torchrun, MPI under mpirun.
Each rank runs multirank_worker.py, which checks every collective and dtype against plain
torch, the reduce_scatter_accumulate accuracy, a count mismatch and a timeout."""
import os

import pytest
import torch

import zerort
from zerort._testing.launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multirank_worker.py")


def run(launcher, nranks, backend):
    out = launch(launcher, nranks, WORKER, backend, timeout=240).output
    for r in range(nranks):
        assert f"WORKER OK rank {r}/{nranks} {backend}" in out, out[-6000:]
    print([line for line in out.splitlines() if line.startswith("[accuracy")])


@pytest.mark.parametrize("nproc", [2, 4])
def test_gloo_under_torchrun(nproc):
    run("torchrun", nproc, "gloo")


@pytest.mark.skipif(not zerort._C.with_mpi, reason="MPI is optional at build time and this build has none")
@pytest.mark.parametrize("np_", [2, 4])
def test_mpi_under_mpirun(np_):
    run("mpirun", np_, "mpi")


def test_launch_env_single_process():
    env = zerort.detect_launch_env()
    assert env["world_size"] >= 1
    comm = zerort.comm.init("inprocess")
    assert (comm.rank, comm.size, comm.backend) == (0, 1, "inprocess")


def test_timeout_bounds():
    t = torch.ones(3)
    zerort.comm.init("inprocess", timeout_s=1e9).all_reduce(t)  # huge is fine: no overflow
    assert torch.equal(t, torch.ones(3))
    for bad in (0, 1e-4, 1e10, float("inf")):
        with pytest.raises(zerort.Error, match="comm.timeout_s must be between"):
            zerort.comm.init("inprocess", timeout_s=bad)
