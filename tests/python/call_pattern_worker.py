"""One rank of test_call_patterns.py: runs every case of a JSON file in this process, each
on a communicator of its own, and saves per case what each accumulation window did.

    call_pattern_worker.py CASES.json OUT_PREFIX      (under mpirun or torchrun)

A case is a training loop written out as data: per micro-step a list of events, each
["f"] (a forward on a new batch, its loss numbered in order) or ["b", [k, ...], flags] (one
backward of the sum of those losses; flags "no_grad": called inside torch.no_grad(),
"direct": loss.backward() instead of engine.backward(loss)), then one engine.step(). A
micro-step's "skip" (None, "all" or a rank) makes those ranks run its forwards only.
"change" sets requires_grad of one parameter after initialize, before the backward or the
step of one micro-step. "moe": rank r routes its batches through expert r.

Isolation: a case that ends in an error may leave its collectives half done, so every case
gets a fresh communicator (mpi: a new MPI communicator; gloo: a new process group), and the
ranks agree after each window, on a control communicator of their own, whether to go on:
only while every rank finished the window normally, or every rank got the documented
missed-backward UsageError from the window's last step(). The model and data are defined
here; the test imports them for its reference.
"""
import datetime
import gc
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zerort  # noqa: E402
from zerort import _C  # noqa: E402

CASE_TIMEOUT_S = 20  # a case's collectives; a peer that left the case fails its next one within this


class PatternModel(nn.Module):
    """inp -> tanh -> expert -> tanh -> out. Stage 3 units: inp, each expert, out (four
    Linear units with two experts of the same shape when case["moe"])."""

    def __init__(self, case):
        super().__init__()
        torch.manual_seed(case["seed"])
        self.inp = nn.Linear(5, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2 if case.get("moe") else 1))
        self.out = nn.Linear(8, 3)
        for name in case.get("frozen", []):  # frozen at initialize
            self.get_parameter(name).requires_grad_(False)

    def forward(self, x, expert=0):
        return self.out(torch.tanh(self.experts[expert](torch.tanh(self.inp(x)))))


def make_batch(case, micro, rank, k):
    """The batch of forward k of global micro-step `micro` on `rank`."""
    g = torch.Generator().manual_seed(case["seed"] * 31 + micro * 7919 + rank * 104729 + k * 13)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def loss_of(out, y):
    return F.mse_loss(out.float(), y)


def expert_of(case, rank):
    return rank if case.get("moe") else 0


def engine_config(case):
    cfg = {"stage": case["stage"], "precision": case["precision"], "gradient_accumulation_steps": case["gas"],
           "reduce_bucket_numel": case.get("bucket", 64), "gradient_clipping": case.get("clip", 1.0),
           "optimizer": {"lr": case.get("lr", 3e-3), "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}
    if "prefetch" in case:
        cfg["stage3"] = {"prefetch": case["prefetch"]}
    return cfg


def runs_backward(micro, rank):
    return micro.get("skip") is None or (micro["skip"] != "all" and micro["skip"] != rank)


def case_comm(launcher_comm, timeout_s=CASE_TIMEOUT_S, debug=True):
    """A communicator of this case's own, on every rank (a collective): mpi, a new MPI
    communicator; gloo, a new process group. These cases run with comm.debug by default."""
    if launcher_comm.backend in ("gloo", "shm"):  # torchrun: shm is the flat gloo world's on one host
        import torch.distributed as dist

        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        impl = _C.make_gloo_communicator(group.group_name, timeout_s, debug)
    else:
        impl = _C.make_communicator(launcher_comm.backend, timeout_s, debug)
    return zerort.comm.Communicator(impl)


def describe(e, phase):
    return {"error": type(e).__name__, "module": type(e).__module__, "zerort_error": isinstance(e, zerort.Error),
            "usage_error": isinstance(e, zerort.UsageError), "message": str(e), "phase": phase,
            "traceback": traceback.format_exc()[-3000:]}


def run_micro(case, engine, micro, index, rank):
    """The events of one micro-step, then step(). Returns the phase an exception came from
    by raising it with .phase set."""
    change = case.get("change")
    losses, phase = [], "forward"
    try:
        for event in micro["events"]:
            if event[0] == "f":
                phase = "forward"
                x, y = make_batch(case, index, rank, len(losses))
                losses.append(loss_of(engine(x, expert=expert_of(case, rank)), y))
            elif runs_backward(micro, rank):
                if change and change["micro"] == index and change["at"] == "backward":
                    engine.module.get_parameter(change["param"]).requires_grad_(change["to"])
                phase = "backward"
                loss = sum(losses[k] for k in event[1])
                flags = event[2] if len(event) > 2 else {}
                with torch.no_grad() if flags.get("no_grad") else torch.enable_grad():
                    if flags.get("direct"):
                        loss.backward()
                    else:
                        engine.backward(loss)
        if change and change["micro"] == index and change["at"] == "step":
            engine.module.get_parameter(change["param"]).requires_grad_(change["to"])
        phase = "step"
        engine.step()
    except Exception as e:
        e.phase = phase
        raise


def run_case(case, comm, control, parked):
    """Per window: {"status": 0 (finished), 1 (the missed-backward UsageError from its last
    step) or 2 (another error), "error", "global_step", "master" (while the case goes on)}.
    An engine whose case ended in an error is parked (kept alive) until every case has run:
    dropping an engine while its comm thread still has buckets queued (an error inside a
    window) can leave one rank waiting comm.timeout_s in a reduce its peer dropped, so the
    parked engines are dropped together at the end, when every queue has long run dry.
    (Measured at stage 2: engine.backward(loss), then `del engine` without step(), holds one
    rank of two for comm.timeout_s in about half the runs, and that process then ends
    without MPI_Finalize.)"""
    rank, gas = comm.rank, case["gas"]
    windows = []
    engine = None
    try:
        engine = zerort.initialize(PatternModel(case), engine_config(case), comm=comm)
    except Exception as e:  # noqa: BLE001 - recorded for the test
        windows.append({"status": 2, "error": describe(e, "initialize")})
    for w in range(len(case["micro"]) // gas if engine is not None else 0):
        status, error = 0, None
        try:
            for m in range(gas):
                index = w * gas + m
                try:
                    run_micro(case, engine, case["micro"][index], index, rank)
                except zerort.UsageError as e:
                    if e.phase == "step" and m == gas - 1 and "of this accumulation window had none" in str(e):
                        status, error = 1, describe(e, "step")
                        break
                    raise
        except Exception as e:  # noqa: BLE001 - recorded for the test
            status, error = 2, describe(e, getattr(e, "phase", "?"))
        votes = torch.zeros(3, dtype=torch.int64)
        votes[status] = 1
        control.all_reduce(votes)
        windows.append({"status": status, "error": error, "global_step": engine.global_step, "micro_index": w})
        if votes[0] != comm.size and votes[1] != comm.size:
            parked.append(engine)
            break  # not every rank can go on
        windows[-1]["master"] = engine.full_state_dict(master=True)
    return {"windows": windows}


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    control = zerort.comm.init("auto", timeout_s=120)  # the worker's own agreements, never an engine's
    results, parked = {}, []
    for case in cases:
        t0 = time.perf_counter()
        comm = case_comm(control)
        results[case["id"]] = run_case(case, comm, control, parked)
        del comm
        control.barrier()
        results[case["id"]]["seconds"] = time.perf_counter() - t0
    torch.save(results, f"{sys.argv[2]}.rank{control.rank}.pt")
    t0 = time.perf_counter()
    del parked[:]
    gc.collect()
    control.barrier()
    print(f"dropped the parked engines in {time.perf_counter() - t0:.2f} s", flush=True)
    print(f"CALL PATTERN WORKER OK rank {control.rank}/{control.size}", flush=True)


if __name__ == "__main__":
    main()
