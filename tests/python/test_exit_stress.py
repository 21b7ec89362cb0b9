"""Processes that create, train and drop engines at every stage 0-3, then exit: 104 process
exits in a row, none may abort (issue 13, item 4). Each process is exit_worker.py: three
rounds of four engines (one per stage, two forward/backward/step each), every engine
dropped and its comm thread seen joined, then one of the endings below. One more process
trains and drops 100 engines before it exits.

| launcher | endings | launches | process exits |
|---|---|---|---|
| torchrun (gloo) | all six | 2 each | 24 |
| no launcher: two processes with torchrun's variables (gloo) | all six | 3 each | 36 |
| mpirun (mpi) | drop, alive, raise, sys_exit | 4 each | 32 |
| alone (one rank, in-process) | drop, alive, raise, sys_exit | 3 each, and one of 25 rounds | 13 |

Endings (exit_worker.py): engines dropped; left alive at exit; an uncaught exception at the
end (exit status 1); sys.exit(0) with engines alive; and, under gloo, torch.distributed
all_reduces still queued at exit on zerort's process group or on one the script created
and destroyed itself. The last two aborted with "terminate called without an active
exception" before zerort.lifecycle closed engines and communicators at exit (measured: 4 of
6 such launches).

A launch passes when it exits with the status its ending expects (0, or 1 after the
exception), every rank printed that it finished, and its output has none of the marks of an
abort. Nothing is retried. Two launches run at a time. Measured on the 2-core machine: 127 s
(195 CPU-seconds) with little else running, 314 s while other test jobs shared it.
"""
import concurrent.futures
import os

import pytest

import zerort
from zerort._testing.launch import LaunchError, launch, launch_plain

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "exit_worker.py")
ROUNDS = 3
STATUS = {"drop": 0, "alive": 0, "raise": 1, "sys_exit": 0, "inflight": 0, "inflight_user": 0}
ANY = list(STATUS)
NO_GLOO = ["drop", "alive", "raise", "sys_exit"]
ABORT_MARKS = ("terminate called", "Aborted", "core dumped", "SIGABRT", "Signal 6", "Fatal Python error",
               "exception not rethrown", "Segmentation fault", "SIGSEGV")
HANG_S = 180  # a launch takes 2-5 s; this only tells "ended" from "hung"


def _launch(launcher, ending, rounds=ROUNDS):
    """Runs one launch; returns [(returncode, output)] per process whose status is known
    (torchrun and mpirun: the launch's own)."""
    if launcher == "none":
        return [(p.returncode, p.output) for p in launch_plain(2, WORKER, rounds, ending, timeout=HANG_S)]
    p = launch(launcher, _exits(launcher), WORKER, rounds, ending, timeout=HANG_S, check=False)
    return [(p.returncode, p.output)]


def _problems(launcher, ending, rounds, results):
    ranks = 1 if launcher == "alone" else 2
    text = "\n".join(out for _, out in results)
    bad = []
    for rc, _ in results:
        if rc != STATUS[ending]:
            bad.append(f"exit status {rc}, expected {STATUS[ending]}")
    marks = [m for m in ABORT_MARKS if m in text]
    if marks:
        bad.append(f"abort marks {marks}")
    done = text.count(f"{rounds} rounds done, ending {ending}")
    if done != ranks:
        bad.append(f"{done} of {ranks} ranks finished")
    if bad:
        tail = "\n".join(text.splitlines()[-25:])
        return [f"{launcher} {ending} (rounds {rounds}): {'; '.join(bad)}\n{tail}"]
    return []


def _plan():
    plan = [("torchrun", e) for e in ANY for _ in range(2)]
    plan += [("none", e) for e in ANY for _ in range(3)]
    if zerort._C.with_mpi:
        plan += [("mpirun", e) for e in NO_GLOO for _ in range(4)]
    plan += [("alone", e) for e in NO_GLOO for _ in range(3)]
    return [(launcher, ending, ROUNDS) for launcher, ending in plan] + [("alone", "alive", 25)]


def _exits(launcher):
    return 1 if launcher == "alone" else 2


def test_plan_reaches_100_process_exits():
    if not zerort._C.with_mpi:
        pytest.skip("MPI is optional at build time and this build has none: the plan has no mpirun launches")
    assert sum(_exits(launcher) for launcher, _, _ in _plan()) >= 100


def test_engines_created_used_dropped_and_exiting_never_abort():
    plan = _plan()
    failures = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {pool.submit(_launch, launcher, ending, rounds): (launcher, ending, rounds)
                   for launcher, ending, rounds in plan}
        for f in concurrent.futures.as_completed(futures):
            launcher, ending, rounds = futures[f]
            try:
                failures += _problems(launcher, ending, rounds, f.result())
            except LaunchError as e:  # it hung
                failures.append(f"{launcher} {ending} (rounds {rounds}): {e}")
    exits = sum(_exits(launcher) for launcher, _, _ in plan)
    engines = sum(_exits(launcher) * 4 * rounds for launcher, _, rounds in plan)
    print(f"[exit stress] {len(plan)} launches, {exits} process exits, {engines} engines, "
          f"{len(failures)} failed")
    assert not failures, f"{len(failures)} of {len(plan)} launches failed:\n\n" + "\n\n".join(failures)
