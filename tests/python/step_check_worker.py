"""One rank of test_step_check.py: ranks that call different collectives, caught by the
step's decision (the default) or at the call (comm.debug: true).

    step_check_worker.py CASES.json OUT_PREFIX      (under mpirun or torchrun, W = 2)

A case trains a few steps and, in its "bad" step, makes the ranks diverge: "moe" (stage 3:
rank r routes its batch through expert r, units of one size); the stage-3 cases whose
collectives differ in size: "skip_backward" (rank 1 steps without backward), "skip_unit"
(rank 1 routes around the expert) and "one_rank_expert" (rank 1 also uses expert 1, a
parameter used on one rank only); between backward and step():
"dtype" (a user all_reduce of 4 f32 on rank 0, 4 i32 on rank 1: the same bytes); "count"
(a user all_gather of 2 f64 on rank 0, 4 f32 on rank 1: the same bytes); "kind" (rank 0
all_gathers 4 f32, rank 1 all_to_alls 4 f32 per rank: at W = 2 the same messages). With no "bad" step, it records the
collectives each step handed to the backend. Every case gets a communicator of its own, and
the ranks agree on a control communicator before the next case."""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import call_pattern_worker  # noqa: E402  (case_comm: a communicator per case)
import zerort  # noqa: E402

CASE_TIMEOUT_S = 20  # unless the case sets "timeout_s"
SIZED = ("skip_backward", "skip_unit", "one_rank_expert")  # stage-3 cases whose collectives differ in size


class Expert(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(8, hidden), nn.Linear(hidden, 8)

    def forward(self, h):
        return self.down(torch.tanh(self.up(h)))


class Experts(nn.Module):
    """uneven: two Experts of different widths (4 and 12), units of their own, so their
    collectives differ in size from each other's and from the persistent rest's."""

    def __init__(self, uneven=False):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.experts = nn.ModuleList([Expert(4), Expert(12)] if uneven else [nn.Linear(8, 8) for _ in range(2)])
        self.out = nn.Linear(8, 1)

    def forward(self, x, expert=0, also=None):
        h = torch.tanh(self.inp(x))
        for e in (expert, also):
            h = h if e is None else torch.tanh(self.experts[e](h))
        return self.out(h)


def diverge(kind, comm, rank):
    if kind == "dtype":
        comm.all_reduce(torch.ones(4) if rank == 0 else torch.ones(4, dtype=torch.int32))
    elif kind == "count":
        mine = torch.ones(2, dtype=torch.float64) if rank == 0 else torch.ones(4)
        comm.all_gather(mine, torch.empty(comm.size * mine.numel(), dtype=mine.dtype))
    elif kind == "kind":
        if rank == 0:
            comm.all_gather(torch.ones(4), torch.empty(4 * comm.size))
        else:
            comm.all_to_all(torch.ones(4 * comm.size), torch.empty(4 * comm.size))


def route(kind, bad, rank):
    """The forward's keyword arguments on this rank: in the bad step of the stage-3 cases the
    ranks take paths of different sizes through the model."""
    if not bad or kind not in ("moe",) + SIZED:
        return {}
    if kind == "moe":
        return {"expert": rank}
    if kind == "skip_unit":
        return {"expert": None if rank == 1 else 0}
    return {"expert": 0, "also": 1 if rank == 1 else None}


def run_case(case, comm):
    rank = comm.rank
    cfg = {"stage": case["stage"], "precision": "fp32", "reduce_bucket_numel": 64,
           "stage3": {"prefetch": case.get("prefetch", 1), "persistence_threshold": 0}}
    if case["kind"] in SIZED:
        cfg["stage3"]["unit_modules"] = ["Expert"]
    if case["debug"] is not None:  # None: the stage's default (stage 3 checks every call)
        cfg["comm"] = {"debug": case["debug"]}
    engine = zerort.initialize(Experts(uneven=case["kind"] in SIZED), cfg, comm=comm)
    out = {"calls": [], "error": None, "global_step": None}
    g = torch.Generator().manual_seed(1 + rank)
    phase = "setup"
    try:
        for step in range(3):
            bad = step == case.get("bad")
            x = torch.randn(4, 6, generator=g)
            phase = "forward"
            before = comm.backend_calls
            loss = engine(x, **route(case["kind"], bad, rank)).pow(2).mean()
            phase = "backward"
            if not (bad and case["kind"] == "skip_backward" and rank == 1):
                engine.backward(loss)
            if bad:
                phase = "user"
                diverge(case["kind"], comm, rank)
            phase = "step"
            engine.step()
            out["calls"].append(comm.backend_calls - before)
    except zerort.Error as e:
        out["error"] = {"phase": phase, "type": type(e).__name__, "usage": isinstance(e, zerort.UsageError),
                        "message": str(e)}
    out["global_step"] = engine.global_step
    out["buckets"] = engine._impl.num_buckets
    return out


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    control = zerort.comm.init("auto", timeout_s=120)
    results = {}
    for case in cases:
        t0 = time.perf_counter()
        comm = call_pattern_worker.case_comm(control, case.get("timeout_s", CASE_TIMEOUT_S), bool(case["debug"]))
        results[case["id"]] = run_case(case, comm)
        results[case["id"]]["seconds"] = time.perf_counter() - t0
        control.barrier()
    with open(f"{sys.argv[2]}.rank{control.rank}.json", "w") as f:
        json.dump(results, f)
    print(f"STEP CHECK WORKER OK rank {control.rank}/{control.size}", flush=True)


if __name__ == "__main__":
    main()
