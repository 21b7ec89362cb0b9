"""Bitwise parity under injected delays (Note [delayed calls] in comm/communicator.h).

The tiny HuggingFace GPT2 of engine_models.py trains STEPS steps at stages 2 and 3 on W = 2
ranks under mpirun: once as it is, once with rank 1 sleeping DELAY_US before each of its
gathers, once before each of its reduces. A delay moves when that rank's comm thread issues
its collectives, against the backward pass that feeds them and against the other rank.
zerort promises the same bits whatever the timing, so every delayed run must equal the
undelayed one exactly: the losses, the FP32 master and the working parameters, on each rank.

Run by pytest. Run as a script it is one rank of the launch:
    test_delay_parity.py OUT_PREFIX CASE [CASE ...]    CASE = stage:kind (kind: none, gathers, reduces)
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import pytest  # noqa: E402
import torch  # noqa: E402

import zerort  # noqa: E402
from zerort._testing.launch import launch as launch_ranks  # noqa: E402
from zerort.errors import ConfigError  # noqa: E402

STEPS = 4
DELAY_US = 2000  # longer than a tiny block's forward or backward: the order of events shifts
KINDS = ("gathers", "reduces")
CASES = [f"{stage}:{kind}" for stage in (2, 3) for kind in ("none", *KINDS)]


def run_delayed(case, comm):
    """One case on this rank (engine_worker.run_case trains it): rank 1 delays `kind`."""
    from engine_worker import run_case

    stage, kind = case.split(":")
    delayed = kind != "none" and comm.rank == 1
    if delayed:
        comm.delay_calls(kind, DELAY_US)
    try:
        return run_case(f"gpt2:{stage}:bf16:1:{STEPS}", comm)
    finally:
        if delayed:
            comm.delay_calls(kind, 0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not zerort._C.with_mpi:
        pytest.skip("MPI is optional at build time and this build has none; these cases run under mpirun")
    pytest.importorskip("transformers")
    prefix = str(tmp_path_factory.mktemp("delay") / "run")
    launch_ranks("mpirun", 2, os.path.abspath(__file__), prefix, *CASES, timeout=600)
    return [torch.load(f"{prefix}.rank{r}.pt") for r in range(2)]


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage", [2, 3])
def test_delayed_run_equals_undelayed_bitwise(ranks, stage, kind):
    for rank, results in enumerate(ranks):
        base, delayed = results[f"{stage}:none"], results[f"{stage}:{kind}"]
        assert delayed["losses"] == base["losses"], (rank, delayed["losses"], base["losses"])
        for part in ("master", "params"):
            assert delayed[part].keys() == base[part].keys()
            for name in base[part]:
                assert torch.equal(bits(delayed[part][name]), bits(base[part][name])), (rank, part, name)


def test_delay_calls_is_a_checked_test_knob():
    comm = zerort.comm.init("inprocess")
    with pytest.raises(ConfigError, match="'gathers' or 'reduces'"):
        comm.delay_calls("gather", 10)
    with pytest.raises(ConfigError, match=">= 0"):
        comm.delay_calls("reduces", -1)
    t = torch.ones(3)
    comm.delay_calls("reduces", 50_000)
    t0 = time.monotonic()
    comm.all_reduce(t)  # one rank: no transfer, but the funnel still sleeps
    assert time.monotonic() - t0 >= 0.05
    comm.delay_calls("reduces", 0)


if __name__ == "__main__":
    from engine_worker import run_cases

    run_cases(run_delayed, sys.argv[1], sys.argv[2:], "DELAY WORKER")
