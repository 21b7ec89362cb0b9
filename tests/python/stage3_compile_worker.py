"""One rank of test_stage3_compile.py: a small transformer (embedding, 3 blocks of LayerNorm,
attention and MLP, head) trained 3 steps under each requested case, eager or under
torch.compile, at stages 2 and 3. Run under mpirun (W = 2) or alone (W = 1).

    stage3_compile_worker.py OUT_PREFIX BACKEND CASE [CASE ...]
    CASE = stage:how[:prefetch[:ckpt]]   how = eager | model (torch.compile(model) before
           zerort.initialize) | units (block.compile() on every block, then initialize)
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import zerort  # noqa: E402
from engine_worker import run_cases  # noqa: E402

D, LAYERS, STEPS = 64, 3, 3
CALLS = [0]  # runs of compiled graphs, forward and backward


def counted(backend):
    """backend, counting every run of the code it compiles (proof that compiled code ran,
    whether this case compiled it or found it in dynamo's cache)."""
    from torch._dynamo import lookup_backend
    from torch._dynamo.backends.common import aot_autograd

    inner = lookup_backend(backend)
    if backend == "aot_eager":  # count the forward and backward graphs that AOTAutograd makes
        from functorch.compile import make_boxed_func

        def run_counted(gm, example_inputs):
            def run(*args):
                CALLS[0] += 1
                return gm(*args)
            return make_boxed_func(run)
        return aot_autograd(fw_compiler=run_counted, bw_compiler=run_counted)

    def compile_fn(gm, example_inputs):
        fn = inner(gm, example_inputs)

        def run(*args):
            CALLS[0] += 1
            return fn(*args)
        return run
    return compile_fn


class Block(torch.nn.Module):
    def __init__(self, ckpt):
        super().__init__()
        self.ckpt = ckpt
        self.ln = torch.nn.LayerNorm(D)
        self.attn = torch.nn.MultiheadAttention(D, 4, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.GELU(), torch.nn.Linear(4 * D, D))

    def body(self, x):
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)

    def forward(self, x):
        if self.ckpt:
            return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


class Net(torch.nn.Module):
    def __init__(self, ckpt=False):
        super().__init__()
        self.emb = torch.nn.Linear(16, D)
        self.blocks = torch.nn.ModuleList(Block(ckpt) for _ in range(LAYERS))
        self.head = torch.nn.Linear(D, 16)

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def run(case, backend, comm):
    calls = CALLS[0]
    parts = case.split(":")
    stage, how = int(parts[0]), parts[1]
    prefetch = int(parts[2]) if len(parts) > 2 else 1
    ckpt = len(parts) > 3 and parts[3] == "ckpt"
    torch.manual_seed(0)
    model = Net(ckpt)
    if how == "model":
        model = torch.compile(model, backend=backend)
    elif how == "units":
        for b in model.blocks:
            b.compile(backend=backend)
    counters.clear()
    t0 = time.perf_counter()
    engine = zerort.initialize(model, {"stage": stage, "precision": "bf16", "optimizer": {"lr": 1e-3},
                                       "stage3": {"prefetch": prefetch}}, comm=comm)
    losses = []
    for step in range(STEPS):
        torch.manual_seed(10 + step + 100 * comm.rank)
        loss = engine(torch.randn(4, 8, 16)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    phases = engine.memory_report().to_dict()["allocator"]["phases"]
    master = {k.replace("_orig_mod.", ""): v for k, v in engine.full_state_dict(master=True).items()}
    return {"losses": losses, "master": master, "seconds": time.perf_counter() - t0,
            "forward_growth": phases["forward"]["growth"], "forward_estimate": phases["forward"]["estimate"],
            "graphs": counters["stats"].get("unique_graphs", 0), "graph_breaks": sum(counters["graph_break"].values()),
            "compiled_calls": CALLS[0] - calls}


def main():
    backend = counted(sys.argv[2])
    run_cases(lambda case, comm: run(case, backend, comm), sys.argv[1], sys.argv[3:], "STAGE3 COMPILE WORKER",
              timeout_s=300)


if __name__ == "__main__":
    main()
