"""One rank of tests/python/test_shm_transport.py (the shared-memory transport, C++ comm/shm/).

    shm_transport_worker.py parity OUT_PREFIX INTRA CASE [CASE ...]   (torchrun; CASE as engine_worker.py's)
    shm_transport_worker.py kill OUT_PREFIX     (plain processes: rank 1 SIGKILLs itself mid-run)
    shm_transport_worker.py silent OUT_PREFIX   (torchrun, W = 2: rank 1 never calls; comm.timeout_s 3)

parity trains the cases with comm.intra_node INTRA ('shm' or 'backend') and saves what
engine_worker.run_case returns; kill and silent write each rank's error (type, text), the
seconds its failing call took and its pid, as OUT_PREFIX.rankR.json.
"""
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

import zerort  # noqa: E402
from engine_worker import run_case  # noqa: E402


def parity(prefix, intra, cases):
    comm = zerort.comm.init("auto", timeout_s=120, intra_node=intra)
    results = {case: run_case(case, comm) for case in cases}
    results["backend"] = comm.backend
    torch.save(results, f"{prefix}.rank{comm.rank}.pt")


def failing(prefix, mode):
    comm = zerort.comm.init("auto", timeout_s=3 if mode == "silent" else 600)
    out = {"pid": os.getpid(), "backend": comm.backend, "error": None, "seconds": None}
    t = torch.ones(1 << 18)
    if mode == "silent" and comm.rank == 1:
        time.sleep(8)  # never calls: rank 0 times out first
    else:
        for i in range(1000):
            if mode == "kill" and comm.rank == 1 and i == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.perf_counter()
            try:
                comm.all_reduce(t)
            except zerort.Error as e:
                out.update(error={"type": type(e).__name__, "message": str(e)}, seconds=time.perf_counter() - t0)
                break
    with open(f"{prefix}.rank{comm.rank}.json", "w") as f:
        json.dump(out, f)


def main():
    mode, prefix = sys.argv[1], sys.argv[2]
    if mode == "parity":
        parity(prefix, sys.argv[3], sys.argv[4:])
    else:
        failing(prefix, mode)


if __name__ == "__main__":
    main()
