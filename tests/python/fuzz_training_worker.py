"""One rank of the property-based training test: runs every drawn case of a JSON file in
this process and saves, per case, the trained state or the error it raised.

    fuzz_training_worker.py CASES.json OUT_PREFIX      (under mpirun, or alone for W = 1)
"""
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

import zerort  # noqa: E402
from fuzz_training_models import FuzzModel, engine_config, loss_of, make_batch  # noqa: E402


def run_case(case, comm):
    engine = zerort.initialize(FuzzModel(case), engine_config(case), comm=comm)
    losses, skipped = [], []
    for step in range(case["steps"]):
        total = 0.0
        for micro in range(case["gas"]):
            x, y = make_batch(case, step, comm.rank, micro)
            loss = loss_of(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / case["gas"]
        mean = torch.tensor([total], dtype=torch.float64)
        comm.all_reduce(mean)
        losses.append(mean.item() / comm.size)
        skipped.append(engine.stats["skipped"])
    return {"losses": losses, "skipped": skipped, "master": engine.full_state_dict(master=True),
            "params": engine.full_state_dict()}


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    comm = zerort.comm.init("auto", timeout_s=30)
    results = {}
    for case in cases:
        try:
            results[case["id"]] = run_case(case, comm)
        except Exception as e:  # noqa: BLE001 - recorded; the test decides whether it was a clean error
            results[case["id"]] = {"error": type(e).__name__, "module": type(e).__module__, "message": str(e),
                                   "traceback": traceback.format_exc()[-3000:]}
    torch.save(results, f"{sys.argv[2]}.rank{comm.rank}.pt")
    print(f"FUZZ WORKER OK rank {comm.rank}/{comm.size}", flush=True)


if __name__ == "__main__":
    main()
