"""Faults in real multi-rank jobs (2 ranks; each rank runs reliability_worker.py): models
that differ across ranks, a rank that raises or stops mid-training, non-finite gradients,
and a rank killed with SIGKILL after a checkpoint. Under mpirun, torchrun, and with no
launcher at all (the test starts both ranks with torchrun's variables and watches each).

No test asserts on speed. The bounds only tell "ended" from "hung": a job must end within
BOUND seconds (process start, a few steps, one comm timeout and a generous margin for a
loaded 2-core machine). A hang runs into HANG, far above it.
"""
import json
import os
import re

import pytest

import zerort
from zerort._testing.launch import launch as launch_ranks, launch_plain
from zerort.engine.same_model import first_difference

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "reliability_worker.py")
SHORT = 5     # comm.timeout_s where a rank must time out by itself
LONG = 120    # comm.timeout_s where the launcher must end the job long before a timeout
BOUND = 60    # s: a job that takes longer than this hung (see the module docstring)
HANG = 240
COLLECTIVE = r"(all_reduce|reduce_scatter|reduce_scatter_accumulate|all_gather|all_to_all|broadcast|barrier)\(count=\d+"

needs_mpi = pytest.mark.skipif(not zerort._C.with_mpi, reason="MPI is optional at build time and this build has none")


def launch(launcher, *args):
    """(exit status, output, seconds) of W = 2 under launcher, whatever the status."""
    p = launch_ranks(launcher, 2, WORKER, *args, timeout=HANG, check=False)
    return p.returncode, p.output, p.seconds


def mpirun(*args):
    return launch("mpirun", *args)


def torchrun(*args):
    return launch("torchrun", *args)


def no_launcher(*args):
    """Both ranks as plain processes (gloo, torchrun's variables): nobody ends a rank for
    us. Returns [(returncode, output, seconds)] per rank."""
    return [(p.returncode, p.output, p.seconds) for p in launch_plain(2, WORKER, *args, timeout=HANG)]


def launcher(name):
    return {"mpirun": mpirun, "torchrun": torchrun}[name]


LAUNCHERS = [pytest.param("mpirun", marks=needs_mpi), "torchrun"]


# ---- 2. the same model on every rank ------------------------------------------------------

EXPECTED_MISMATCH = {  # variant on rank 1 -> what the error must name
    "shape": ["'b.weight' shape (16, 16)", "'b.weight' shape (17, 16)"],
    "name": ["'b.weight'", "'d.weight'"],
    "dtype": ["'c.bias' shape (3,) float32", "'c.bias' shape (3,) float64"],
    "count": ["rank 0: no entry #6", "rank 1: parameter 'c.extra'"],
}


@pytest.mark.parametrize("how", LAUNCHERS)
def test_models_that_differ_across_ranks_are_named_at_initialize(tmp_path, how):
    rc, out, took = launcher(how)("mismatch", tmp_path / "r")
    assert rc == 0 and took < BOUND, out[-4000:]
    for rank in range(2):
        with open(tmp_path / f"r.{rank}.json") as f:
            got = json.load(f)
        assert got["same"] == "ok"
        for variant, parts in EXPECTED_MISMATCH.items():
            msg = got[variant]
            assert msg.startswith(f"zerort.initialize on rank {rank} of 2: the model differs across ranks"), msg
            assert "rank 0" in msg and "rank 1" in msg, msg
            for part in parts:
                assert part in msg, (variant, msg)


def test_first_difference_groups_the_ranks():
    a = ["parameter", "x", [2], "float32", True]
    b = ["parameter", "x", [3], "float32", True]
    assert first_difference([[a], [a], [a]]) is None
    msg = first_difference([[a, a], [b, a], [a, a]])
    assert ("entry #0" in msg and "ranks 0, 2: parameter 'x' shape (2,)" in msg
            and "rank 1: parameter 'x' shape (3,)" in msg)
    msg = first_difference([[a, a], [a]])
    assert "entry #1" in msg and "rank 1: no entry #1 (only 1 parameters" in msg


# ---- 3. a rank raises, or stops, mid-training ----------------------------------------------

# Every stage and every phase; stage 3 (hooks gather and reduce inside forward and backward)
# in all three.
FAULTS = [(0, "step"), (1, "forward"), (2, "backward"), (3, "forward"), (3, "backward"), (3, "step")]


@needs_mpi
@pytest.mark.parametrize("stage,phase", FAULTS)
def test_an_exception_on_one_rank_ends_the_mpirun_job(stage, phase):
    # comm.timeout_s is long: only rank 1 ending at once (and mpirun then ending rank 0)
    # finishes within BOUND; a rank 1 stuck in MPI_Finalize would wait for rank 0's timeout.
    rc, out, took = mpirun("fault", stage, phase, LONG)
    assert rc != 0 and took < BOUND, (took, out[-4000:])
    assert f"injected fault in {phase} on rank 1" in out, out[-4000:]
    assert "zerort: rank 1 of 2: uncaught RuntimeError" in out, out[-4000:]
    assert "WORKER FINISHED" not in out


@pytest.mark.parametrize("stage,phase", [(1, "backward"), (3, "step")])
def test_an_exception_on_one_rank_ends_the_torchrun_job(stage, phase):
    rc, out, took = torchrun("fault", stage, phase, LONG)
    assert rc != 0 and took < BOUND, (took, out[-4000:])
    assert f"injected fault in {phase} on rank 1" in out, out[-4000:]
    assert "WORKER FINISHED" not in out


@pytest.mark.parametrize("stage,phase", [(0, "forward"), (2, "backward"), (3, "step")])
def test_without_a_launcher_the_other_rank_fails_its_collective(stage, phase):
    (rc0, out0, t0), (rc1, out1, _) = no_launcher("fault", stage, phase, SHORT)
    assert rc1 != 0 and f"injected fault in {phase} on rank 1" in out1, out1[-3000:]
    assert rc0 != 0 and t0 < BOUND, (t0, out0[-3000:])
    assert re.search(COLLECTIVE + r"[^)]*\) on rank 0 of 2 \[shm\]", out0), out0[-3000:]
    assert "zerort: rank 0 of 2: uncaught" in out0 and "WORKER FINISHED" not in out0 + out1


@needs_mpi
@pytest.mark.parametrize("stage", [0, 3])
def test_a_stuck_rank_makes_the_others_time_out_naming_the_collective(stage):
    rc, out, took = mpirun("stuck", stage, SHORT)
    assert rc != 0 and took < BOUND, (took, out[-4000:])
    assert re.search(COLLECTIVE + r"[^)]*\) on rank 0 of 2 \[mpi\]:? .*(did not finish within 5000 ms)", out), \
        out[-4000:]
    assert "WORKER FINISHED" not in out


# ---- 4. non-finite gradients --------------------------------------------------------------

@pytest.fixture(scope="module")
def nonfinite_runs(tmp_path_factory):
    if not zerort._C.with_mpi:
        pytest.skip("MPI is optional at build time and this build has none")
    d = tmp_path_factory.mktemp("nonfinite")
    rc, out, _ = mpirun("nonfinite", d / "r")
    assert rc == 0, out[-4000:]
    runs = []
    for rank in range(2):
        with open(d / f"r.{rank}.json") as f:
            runs.append(json.load(f))
    return runs


POISONED = ["a.bias", "c.weight"]  # the worker gives these NaN gradients on rank 1


def check_skips(steps, schedule):
    """Every 'nan' step skipped, named the poisoned params and left the master unchanged;
    every clean step updated; skipped_steps counts the skips."""
    skips = 0
    for s, what in zip(steps, schedule):
        assert s["skipped"] == (what != "ok"), (s, what)
        skips += what != "ok"
        assert s["skipped_steps"] == skips
        assert s["unchanged"] == (what != "ok")
        if what == "nan":
            assert s["names"] == POISONED


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_max_consecutive_skips_stops_training_naming_params_and_scale(nonfinite_runs, precision, stage):
    # Two clean steps, then NaN gradients; max_consecutive_skips = 3: the 3rd skip raises.
    # fp16 (initial scale 2^8, hysteresis 1): each skip halves, so the 3rd carries 2^8/4.
    scale = 1 if precision == "bf16" else 2 ** 8 / 4
    for rank, runs in enumerate(nonfinite_runs):
        r = runs[f"limit:{precision}:{stage}"]
        check_skips(r["steps"], ["ok", "ok", "nan", "nan"])
        err = r["error"]
        assert err["step"] == 4 and err["params"] == POISONED and err["loss_scale"] == scale
        assert "3 optimizer steps in a row were skipped" in err["message"]
        assert "max_consecutive_skips = 3" in err["message"]
        assert "'a.bias', 'c.weight'" in err["message"] and f"loss scale {scale:g} " in err["message"]
        assert f"rank {rank} of 2" in err["message"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_overflow_at_the_minimum_scale_names_params_and_scale(nonfinite_runs, stage):
    # initial scale 4, minimum 1, hysteresis 1: skips at 4 and 2, then the overflow at 1 raises.
    for runs in nonfinite_runs:
        r = runs[f"minscale:{stage}"]
        check_skips(r["steps"], ["ok", "nan", "nan"])
        assert [s["scale"] for s in r["steps"]] == [4, 4, 2]
        err = r["error"]
        assert err["step"] == 3 and err["params"] == POISONED and err["loss_scale"] == 1
        assert "already at its minimum 1 (loss_scale.min_scale)" in err["message"]
        assert "'a.bias', 'c.weight'" in err["message"] and "loss scale 1 " in err["message"]


def test_a_clean_step_resets_the_consecutive_count(nonfinite_runs):
    for runs in nonfinite_runs:
        r = runs["reset"]
        check_skips(r["steps"], ["nan", "nan", "ok", "nan", "nan", "ok", "nan", "nan"])
        assert r["error"]["step"] == 8 and r["error"]["params"] == POISONED


def test_a_nan_loss_on_one_rank_skips_the_step(nonfinite_runs):
    # Stage 0; rank 0's loss is NaN at step 1: every gradient is NaN, the first four named.
    for runs in nonfinite_runs:
        r = runs["nanloss"]
        assert "error" not in r
        assert [s["skipped"] for s in r["steps"]] == [False, True, False]
        assert [s["skipped_steps"] for s in r["steps"]] == [0, 1, 1]
        assert r["steps"][1]["unchanged"] and not r["steps"][2]["unchanged"]
        assert r["steps"][1]["names"] == ["a.weight", "a.bias", "b.weight", "b.bias"]


def test_max_consecutive_skips_is_validated():
    assert zerort.config.parse({}).max_consecutive_skips == 100
    assert zerort.config.parse({"max_consecutive_skips": 7}).max_consecutive_skips == 7
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(zerort.config.ConfigError, match="max_consecutive_skips: got"):
            zerort.config.parse({"max_consecutive_skips": bad})


# ---- 5. a rank killed with SIGKILL ----------------------------------------------------------

def check_checkpoint_survived(directory, stage):
    with open(directory / "ckpt" / "latest") as f:
        assert f.read().strip() == "step4"  # saves at steps 2 and 4; the kill right after step 4's
    if zerort._C.with_mpi:
        rc, out, _ = mpirun("verify", stage, directory)
    else:
        rc, out, _ = torchrun("verify", stage, directory)
    assert rc == 0 and "VERIFIED rank 0 tag step4" in out and "VERIFIED rank 1 tag step4" in out, out[-4000:]


@pytest.mark.parametrize("how,stage", [pytest.param("mpirun", 2, marks=needs_mpi), ("torchrun", 3)])
def test_sigkill_after_a_checkpoint_ends_the_job_and_the_checkpoint_loads(tmp_path, how, stage):
    rc, out, took = launcher(how)("kill", stage, tmp_path, LONG)
    assert "rank 1 kills itself" in out, out[-4000:]
    assert rc != 0 and took < BOUND, (took, out[-4000:])
    assert "WORKER FINISHED" not in out
    check_checkpoint_survived(tmp_path, stage)


def test_sigkill_without_a_launcher_the_survivor_fails_within_the_timeout(tmp_path):
    (rc0, out0, t0), (rc1, out1, _) = no_launcher("kill", 1, tmp_path, SHORT)
    assert rc1 == -9 and "rank 1 kills itself" in out1, out1[-3000:]
    assert rc0 != 0 and t0 < BOUND, (t0, out0[-3000:])
    assert re.search(COLLECTIVE + r"[^)]*\) on rank 0 of 2 \[shm\]", out0), out0[-3000:]
    check_checkpoint_survived(tmp_path, 1)
