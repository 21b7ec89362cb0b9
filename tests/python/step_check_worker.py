"""One rank of test_step_check.py: ranks that call different collectives, caught by the
step's decision (the default) or at the call (comm.debug: true).

    step_check_worker.py CASES.json OUT_PREFIX      (under mpirun or torchrun, W = 2)

A case trains a few steps and, in its "bad" step, makes the ranks diverge between backward
and step(): "moe" (stage 3: rank r routes its batch through expert r, units of one size);
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


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.out = nn.Linear(8, 1)

    def forward(self, x, expert=0):
        return self.out(torch.tanh(self.experts[expert](torch.tanh(self.inp(x)))))


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


def run_case(case, comm):
    rank = comm.rank
    cfg = {"stage": case["stage"], "precision": "fp32", "reduce_bucket_numel": 64,
           "stage3": {"prefetch": case.get("prefetch", 1), "persistence_threshold": 0}}
    engine = zerort.initialize(Experts(), cfg, comm=comm)
    out = {"calls": [], "error": None, "global_step": None}
    g = torch.Generator().manual_seed(1 + rank)
    phase = "setup"
    try:
        for step in range(3):
            bad = step == case.get("bad")
            x = torch.randn(4, 6, generator=g)
            phase = "forward"
            before = comm.backend_calls
            loss = engine(x, expert=rank if bad and case["kind"] == "moe" else 0).pow(2).mean()
            phase = "backward"
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
        comm = call_pattern_worker.case_comm(control, case.get("timeout_s", CASE_TIMEOUT_S), case["debug"])
        results[case["id"]] = run_case(case, comm)
        results[case["id"]]["seconds"] = time.perf_counter() - t0
        control.barrier()
    with open(f"{sys.argv[2]}.rank{control.rank}.json", "w") as f:
        json.dump(results, f)
    print(f"STEP CHECK WORKER OK rank {control.rank}/{control.size}", flush=True)


if __name__ == "__main__":
    main()
