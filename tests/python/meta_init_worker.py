"""One rank of test_meta_init: builds a model on the meta device, initializes zerort and
saves what the test checks.

    meta_init_worker.py memory OUT     8 x Linear(4096) at stage 3, bf16: allocator figures
    meta_init_worker.py values OUT     a small model at stages 2 and 3: the initial master
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402

import zerort  # noqa: E402
from zerort.accounting import phases  # noqa: E402


def small():
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 7),
                                   torch.nn.Linear(7, 3))


def main():
    mode, out = sys.argv[1], sys.argv[2]
    comm = zerort.comm.init("auto", timeout_s=60)
    torch.manual_seed(1234)
    result = {}
    if mode == "memory":  # from before the model is built, on the meta device and for comparison on the CPU
        phases.install_counting_allocator()
        for device in ("meta", "cpu"):
            window = phases.Phases("cpu")  # its peak survives the engine's own phase windows
            window.begin("init")
            with torch.device(device):
                model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(8)])
            built = zerort._C.allocator_stats()["current"]
            engine = zerort.initialize(model, {"stage": 3, "precision": "bf16"}, comm=comm)
            del model
            window.end("init")
            m = window.result["init"]
            r = {"before": m.start, "built": built, "peak": m.peak, "after": m.end, "units": engine.unit_names,
                 "unit_fp32_bytes": 4096 * 4096 * 4, "master_bytes": engine._impl.master(0).numel() * 4}
            x = torch.randn(4, 4096)
            engine.backward(engine(x).float().pow(2).mean())  # it trains
            r["step"] = engine.step()["grad_norm"]
            result[device] = r
            del engine
    else:
        for stage in (2, 3):
            torch.manual_seed(1234)
            engine = zerort.initialize(small(), {"stage": stage, "precision": "bf16"}, comm=comm)
            result[stage] = engine.full_state_dict(master=True)
    torch.save(result, f"{out}.rank{comm.rank}.pt")


if __name__ == "__main__":
    main()
