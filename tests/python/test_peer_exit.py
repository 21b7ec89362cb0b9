"""A peer that exited is named, at once (issue 27, item 5): rank 1 ends normally one
collective (or one training step at stage 1, 2 or 3) before rank 0, and rank 0's wait ends within seconds,
not at comm.timeout_s (60 s here), with an error that names rank 1 and says it exited.
mpirun: rank 1's goodbye message (Note [goodbye messages]); torchrun: its exit notice in
the launcher's store (zerort.comm.peers), which also turns gloo's "Connection closed by
peer ... a remote worker crashing" into the exit it was. Nothing hangs: the launch ends."""
import json
import os

import pytest

import zerort
from zerort._testing.launch import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_exit_worker.py")


@pytest.mark.parametrize("mode", ["plain", "stage1", "stage2", "stage3"])
@pytest.mark.parametrize("launcher", ["mpirun", "torchrun"])
def test_a_peer_that_exited_early_is_named_before_the_timeout(launcher, mode, tmp_path):
    if launcher == "mpirun" and not zerort._C.with_mpi:
        pytest.skip("this build has no MPI")
    prefix = str(tmp_path / "out")
    # Under mpirun rank 0 then exits without MPI_Finalize (its collective can never finish),
    # which mpirun reports as a failed job: the outcome is in the ranks' files.
    launch(launcher, 2, WORKER, mode, prefix, timeout=120, check=launcher == "torchrun")
    with open(f"{prefix}.rank1.json") as f:
        assert json.load(f)["error"] is None
    with open(f"{prefix}.rank0.json") as f:
        res = json.load(f)
    e = res["error"]
    assert e is not None, res
    assert e["type"] in ("CommTimeoutError", "CommError"), e
    assert "cannot finish: rank 1 exited while this rank waited for it" in e["message"], e
    assert "Every rank must make the same collectives before it exits" in e["message"], e
    assert res["seconds"] < 20, res  # the notice ends the wait; comm.timeout_s is 60 s
