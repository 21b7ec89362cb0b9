"""Real multi-process runs of the Python API: gloo under torchrun, MPI under mpirun.
Each rank runs multirank_worker.py, which checks every collective and dtype against plain
torch, the reduce_scatter_accumulate accuracy, a count mismatch and a timeout."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import zerort

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multirank_worker.py")
BIN = os.path.dirname(sys.executable)


def run(cmd, nranks, backend):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    for r in range(nranks):
        assert f"WORKER OK rank {r}/{nranks} {backend}" in out, out[-6000:]
    print([line for line in out.splitlines() if line.startswith("[accuracy")])


@pytest.mark.parametrize("nproc", [2, 4])
def test_gloo_under_torchrun(nproc):
    torchrun = os.path.join(BIN, "torchrun")
    run([torchrun, "--standalone", "--nproc_per_node", str(nproc), WORKER, "gloo"], nproc, "gloo")


@pytest.mark.skipif(not zerort._C.with_mpi, reason="MPI is optional at build time and this build has none")
@pytest.mark.parametrize("np_", [2, 4])
def test_mpi_under_mpirun(np_):
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not on PATH; make test installs openmpi-bin"
    run([mpirun, "--oversubscribe", "-np", str(np_), sys.executable, WORKER, "mpi"], np_, "mpi")


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
