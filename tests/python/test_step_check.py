"""The default cross-rank check rides on the step's decision; comm.debug checks every call.

At W = 2 under mpirun and torchrun (gloo), the ranks diverge in one step between backward
and step() (step_check_worker.py): stage-3 experts chosen per rank (units of one size), a
user all_reduce of another dtype, a user all_gather of another count (the same bytes), and
another collective (all_gather against all_to_all). By default the step raises
zerort.UsageError on every rank, naming the first call that differs and each rank's
version of it, and applies nothing. Measured exception: under gloo, all_gather against
all_to_all never pairs up, so both ranks fail at the call within comm.timeout_s (3 s here),
naming it. With comm.debug: true every case is named at the call itself. Mismatches of
byte size are only checked ones: unchecked, gloo ends the process from its own thread
(gloo::EnforceNotMet, "Received data size doesn't match expected size") and MPI fails the
receiving rank (MPI_ERR_TRUNCATE) before any step.

Stage 3 checks every call by default (Note [checked calls]): ranks whose paths differ there
call gathers and reduces of different sizes. A rank that skips backward, a rank that routes
around a unit, and a parameter used on one rank only each end with a zerort error at the
first call after the paths part, on every rank, naming each rank's call and the units.

Steps without a mismatch hand the backend the data's collectives plus one, the decision
(stages 0-2: a reduce and a parameter gather per bucket); comm.debug doubles that (one probe
per call), as does stage 3's default. At W = 1 no collective reaches the backend at all.
"""
import json
import os

import pytest
import torch
import torch.nn as nn

import zerort
from zerort._testing.launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "step_check_worker.py")

W = 2

# The calls each bad case makes on rank 0 and rank 1, as the messages print them.
CALLS = {
    "moe": ("all_gather(count=48, dtype=f32, tag=0) on rank 0", "all_gather(count=48, dtype=f32, tag=1) on rank 1"),
    "dtype": ("all_reduce(count=4, dtype=f32, op=sum) on rank 0", "all_reduce(count=4, dtype=i32, op=sum) on rank 1"),
    "count": ("all_gather(count=2, dtype=f64) on rank 0", "all_gather(count=4, dtype=f32) on rank 1"),
    "kind": ("all_gather(count=4, dtype=f32) on rank 0", "all_to_all(count=4, dtype=f32) on rank 1"),
}
STAGE = {"moe": 3, "dtype": 2, "count": 1, "kind": 0}
# Stage 3, units of different sizes (two Experts of widths 4 and 12), the stage's default
# (every call checked): each rank's first call after the paths part, as the messages print it.
SIZED = {
    "skip_backward": ("all_gather(count=48, dtype=f32, tag=0) on rank 0",
                      "reduce_scatter_accumulate(count=48, dtype=f32, tag=0) on rank 1"),
    "skip_unit": ("all_gather(count=48, dtype=f32, tag=0) on rank 0",
                  "reduce_scatter_accumulate(count=48, dtype=f32, tag=2) on rank 1"),
    "one_rank_expert": ("all_gather(count=48, dtype=f32, tag=0) on rank 0",
                        "all_gather(count=112, dtype=f32, tag=1) on rank 1"),
}


def cases():
    out = []
    for kind in CALLS:
        for debug in (False, True):
            out.append({"id": f"{kind}-{debug}", "stage": STAGE[kind], "kind": kind, "bad": 1, "debug": debug,
                        "prefetch": 0 if debug else 1, "timeout_s": 3 if kind == "kind" else 20})
    for kind in SIZED:
        out.append({"id": kind, "stage": 3, "kind": kind, "bad": 1, "debug": None})
    for stage in range(4):
        for debug in (False, True):
            out.append({"id": f"good{stage}-{debug}", "stage": stage, "kind": "none", "debug": debug})
    out.append({"id": "good3-None", "stage": 3, "kind": "none", "debug": None})
    return out


@pytest.fixture(scope="module", params=["mpirun", "torchrun"])
def launched(request, tmp_path_factory):
    if request.param == "mpirun" and not zerort._C.with_mpi:
        pytest.skip("this build has no MPI; the mpirun cases need it")
    tmp = tmp_path_factory.mktemp(request.param)
    (tmp / "cases.json").write_text(json.dumps(cases()))
    prefix = str(tmp / "out")
    launch(request.param, W, WORKER, tmp / "cases.json", prefix, timeout=180)
    ranks = []
    for r in range(W):
        with open(f"{prefix}.rank{r}.json") as f:
            ranks.append(json.load(f))
    return request.param, ranks


@pytest.mark.parametrize("kind", list(CALLS))
def test_a_different_call_is_named_at_the_step_on_every_rank(launched, kind):
    launcher, ranks = launched
    for r in range(W):
        res = ranks[r][f"{kind}-False"]
        e = res["error"]
        assert e is not None, f"rank {r}: no error for {kind}"
        assert res["global_step"] == 1, "the bad step applied an update"
        if launcher == "torchrun" and kind == "kind":  # gloo never pairs these up: bounded at the call
            assert e["phase"] == "user" and "did not finish within 3000 ms" in e["message"], e
            assert CALLS[kind][r] in e["message"] and "comm.debug: true" in e["message"], e
            assert res["seconds"] < 15, res["seconds"]
            continue
        assert e["phase"] == "step" and e["usage"], e
        assert "ranks called different collectives since the previous step" in e["message"], e
        assert "since the previous step is the first that differs" in e["message"], e
        for q in range(W):
            assert f"rank {q}: {CALLS[kind][q]}" in e["message"], e["message"]
        if kind == "moe":  # the tags are named as units
            assert "'experts.0 (Linear)'" in e["message"] and "'experts.1 (Linear)'" in e["message"], e


@pytest.mark.parametrize("kind", list(CALLS))
def test_comm_debug_names_it_at_the_call(launched, kind):
    _, ranks = launched
    for r in range(W):
        res = ranks[r][f"{kind}-True"]
        e = res["error"]
        assert e is not None and res["global_step"] == 1, res
        assert e["phase"] == ("forward" if kind == "moe" else "user"), e
        assert "differs across ranks" in e["message"] or "different collectives at the same point" in e["message"], e
        for q in range(W):
            assert f"rank {q}: {CALLS[kind][q]}" in e["message"], e["message"]


@pytest.mark.parametrize("kind", list(SIZED))
def test_stage3_paths_of_different_sizes_end_with_a_zerort_error_on_every_rank(launched, kind):
    """Without the checks (comm.debug: false) these abort the process inside the backend
    (MPI: an NBC error, then ORTE; gloo: gloo::EnforceNotMet). Checked, every rank raises
    at its first call after the paths part, names both ranks' calls and the units, and the
    worker goes on to the next case (the launch ends normally)."""
    _, ranks = launched
    for r in range(W):
        res = ranks[r][kind]
        e = res["error"]
        assert e is not None and res["global_step"] == 1, res
        assert res["seconds"] < 15, res  # at the call, not after the case's 20 s timeout
        for q in range(W):
            assert f"rank {q}: {SIZED[kind][q]}" in e["message"], e["message"]
        assert "(stage-3 units: tag 0 = 'experts.0 (Expert)'" in e["message"], e
        if kind == "skip_backward" and r == 1:  # the rank that skipped knows it did
            assert e["phase"] == "step" and e["type"] == "UsageError", e
            assert "rank 1 called step() without a backward pass" in e["message"], e
        else:
            assert e["type"] == "CollectiveMismatchError", e


def test_one_collective_per_step_beyond_the_data(launched):
    _, ranks = launched
    for r in range(W):
        for stage in range(4):
            default, debug = ranks[r][f"good{stage}-False"], ranks[r][f"good{stage}-True"]
            assert default["error"] is None and debug["error"] is None, (default, debug)
            assert default["global_step"] == 3
            if stage < 3:  # a reduce and a parameter gather per bucket, and the decision
                assert default["calls"] == [2 * default["buckets"] + 1] * 3, default
            assert debug["calls"] == [2 * c for c in default["calls"]], (default, debug)
    for r in range(W):  # stage 3 checks every call unless comm.debug says false
        assert ranks[r]["good3-None"]["calls"] == ranks[r]["good3-True"]["calls"], ranks[r]


def test_no_collective_at_world_one():
    """One process, no launcher: every stage steps with nothing handed to the backend."""
    for stage in range(4):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        engine = zerort.initialize(model, {"stage": stage, "precision": "bf16", "reduce_bucket_numel": 32,
                                           "stage3": {"persistence_threshold": 0}})
        before = engine.comm.backend_calls
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 6)).pow(2).mean())
            engine.step()
        assert engine.global_step == 3
        assert engine.comm.backend_calls - before == 0, f"stage {stage}"
        assert engine.comm.backend_calls == 0, f"stage {stage}: initialize handed the backend a collective"
