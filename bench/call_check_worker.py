"""One rank of bench/stage3_call_checks.py's second table: what stage 3's checked calls add
per step, counted and timed rather than inferred from two noisy step times.

    torchrun --standalone --nproc_per_node 2 bench/call_check_worker.py OUT.json
    mpirun -np 2 python bench/call_check_worker.py OUT.json

Trains examples/gpt.py's 50M GPT at stage 3 (bf16) for --steps steps, counting the
collectives each step hands the backend (checked: the data's and one probe before each),
then times --probes round trips of the probe itself (a 12-value int64 all-reduce) on a
communicator of its own. Rank 0 writes OUT.json: calls per step, the step times and the
probe times.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import torch  # noqa: E402

import zerort  # noqa: E402
from e2e_worker import CLIP, MODELS, OPT, loss_fn  # noqa: E402
from gpt import GPT, batch, stdlib_bytes  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="50m", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--probes", type=int, default=400)
    a = ap.parse_args()
    kwargs, per_rank = MODELS[a.model]
    torch.manual_seed(0)
    engine = zerort.initialize(GPT(**kwargs), {
        "stage": 3, "precision": "bf16", "gradient_clipping": CLIP,
        "optimizer": {"lr": OPT["lr"], "betas": list(OPT["betas"]), "eps": OPT["eps"],
                      "weight_decay": OPT["weight_decay"]}})
    comm, data = engine.comm, stdlib_bytes()
    calls, step_s = [], []
    for step in range(a.steps):
        x, y = batch(data, step, comm.rank, 0, per_rank, kwargs["seq"])
        before, t0 = comm.backend_calls, time.perf_counter()
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        step_s.append(time.perf_counter() - t0)
        calls.append(comm.backend_calls - before)
    plain = zerort.comm.init("auto")  # unchecked: each all_reduce is one round trip
    probe = torch.zeros(12, dtype=torch.int64)
    rtt = []
    for _ in range(a.probes):
        t0 = time.perf_counter()
        plain.all_reduce(probe, op="max")
        rtt.append(time.perf_counter() - t0)
    if comm.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"backend": comm.backend, "checked": comm.checks_each_call, "calls": calls, "step_s": step_s,
                       "probe_s": rtt}, f)


if __name__ == "__main__":
    main()
