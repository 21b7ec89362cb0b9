"""One rank of test_peer_exit.py: rank 1 stops one collective (or one step) before rank 0
and exits normally; rank 0 records the error it gets and how long it waited.

    peer_exit_worker.py MODE OUT_PREFIX     (MODE: plain | stage1 | stage2 | stage3; mpirun or torchrun, W = 2)
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import zerort  # noqa: E402

TIMEOUT_S = 60  # the error must come long before this


def main():
    mode, prefix = sys.argv[1], sys.argv[2]
    comm = zerort.comm.init("auto", timeout_s=TIMEOUT_S)
    calls = 3 - comm.rank  # rank 1 makes one fewer
    if mode.startswith("stage"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        cfg = {"stage": int(mode[-1]), "precision": "bf16", "stage3": {"persistence_threshold": 0}}
        engine = zerort.initialize(model, cfg, comm=comm)

        def call():
            engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
            engine.step()
    else:
        def call():
            comm.all_reduce(torch.ones(4))
    out = {"error": None}
    t0 = time.perf_counter()
    try:
        for _ in range(calls):
            call()
    except zerort.Error as e:
        out["error"] = {"type": type(e).__name__, "message": str(e)}
    out["seconds"] = time.perf_counter() - t0
    with open(f"{prefix}.rank{comm.rank}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
