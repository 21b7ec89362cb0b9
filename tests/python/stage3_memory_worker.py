"""One rank of test_stage3_memory.py, under mpirun: 8 x Linear(4096, 4096, bias=False) at
stage 3 in bf16, one training step per prefetch value, what the allocator and the memory
report say about it.

    stage3_memory_worker.py OUT_PREFIX PREFETCH [PREFETCH ...]
"""
import gc
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

# E402: these imports come after the sys.path setup above, which finds this repository's zerort and engine_worker.
import torch  # noqa: E402

import zerort  # noqa: E402
from zerort.accounting import memory  # noqa: E402
from zerort.layout import units  # noqa: E402
from engine_worker import run_cases  # noqa: E402

WIDTH, LAYERS, BATCH = 4096, 8, 4


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def run(prefetch, comm):
    t0 = time.perf_counter()
    model = make_model()
    chosen = units.choose_units(model)
    gc.collect()
    gc.disable()  # no garbage of an earlier case is freed inside initialize's count
    try:
        engine = zerort.initialize(model, {"stage": 3, "precision": "bf16", "stage3": {"prefetch": prefetch},
                                           "optimizer": {"lr": 1e-4}}, comm=comm)
    finally:
        gc.enable()
    t_init = time.perf_counter() - t0
    torch.manual_seed(1 + comm.rank)
    x = torch.randn(BATCH, WIDTH)
    gc.collect()
    gc.disable()  # nothing of an earlier case is freed inside a measured phase
    try:
        out = engine(x)                        # the measured forward
        engine.backward(out.float().pow(2).mean())
        engine.step()
        # The same forward with every unit gathered and held beforehand: what it allocates is
        # what the model's own computation allocates (outputs, autograd's saved tensors,
        # matmul temporaries), without any gather or release.
        with engine.gathered_parameters():
            phases = memory.Phases("cpu")
            with phases("held forward"):
                held_out = engine.module(x.to(torch.bfloat16))
            del held_out
        report = engine.memory_report()
    finally:
        gc.enable()
    res = {"units": [type(m).__name__ for m in chosen], "unit_names": list(engine.unit_names),
           "allocator": report.to_dict()["allocator"], "held_forward": phases.result["held forward"].growth,
           "table": report.table(), "init_s": t_init, "seconds": time.perf_counter() - t0}
    del engine, model, out, report
    gc.collect()
    return res


def main():
    run_cases(run, sys.argv[1], [int(p) for p in sys.argv[2:]], "STAGE3 MEMORY WORKER")


if __name__ == "__main__":
    main()
