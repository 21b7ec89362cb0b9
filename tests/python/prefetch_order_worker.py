"""One rank of test_prefetch_order.py, under mpirun: a model whose layers are registered
[c, a, b] but called a, b, c, trained at stage 0 and at stage 3 (prefetch 1) on the same
data; what each run's parameters end as, and at stage 3 the recorded unit order and every
unit the Engine was asked to prefetch, per forward and backward.

    prefetch_order_worker.py OUT_PREFIX
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import zerort  # noqa: E402
from zerort import _C  # noqa: E402
from engine_worker import run_cases  # noqa: E402

WIDTH, STEPS = 16, 3


class Reordered(nn.Module):
    """layers[0] is c, layers[1] a, layers[2] b: registered c, a, b; called a, b, c."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(3)])

    def forward(self, x):
        c, a, b = self.layers
        return c(torch.relu(b(torch.relu(a(x)))))


def run(stage, comm):
    engine = zerort.initialize(Reordered(), {"stage": stage, "precision": "bf16", "optimizer": {"lr": 1e-2},
                                             "stage3": {"prefetch": 1}}, comm=comm)
    asked, phase = [], ["forward"]
    prefetch = _C.Engine.prefetch

    def logged(impl, u):
        asked.append((phase[0], u))
        return prefetch(impl, u)

    _C.Engine.prefetch = logged
    try:
        torch.manual_seed(1 + comm.rank)
        steps = []
        for _ in range(STEPS):
            x = torch.randn(4, WIDTH)
            phase[0] = "forward"
            loss = engine(x).float().pow(2).mean()
            phase[0] = "backward"
            engine.backward(loss)
            engine.step()
            steps.append(list(asked))
            asked.clear()
    finally:
        _C.Engine.prefetch = prefetch
    out = {"params": engine.full_state_dict(master=True), "order": engine.unit_order, "asked": steps,
           "units": len(engine.unit_names)}
    engine.destroy()
    return out


if __name__ == "__main__":
    run_cases(lambda case, comm: run(int(case), comm), sys.argv[1], ["0", "3"], "PREFETCH ORDER WORKER")
