"""The two-hop reduce-scatter's 8-bit wires, int8 and fp8_e4m3 (C++ Note [int8 blocks]), on real
gradients, by block size.

    .venv/bin/python bench/int8_wire.py                  # the 50M GPT, 2 nodes, blocks 64..4096

The gradients are examples/gpt.py's GPT's (the 50M model of bench/e2e.py, FP32, one micro-batch
of 2 x 128 tokens per rank from gpt.batch): each "node" k's partial is the sum of its G ranks'
gradients, as hop 1 leaves it. Hop 2 sends each partial on the wire and the receiver sums them
in node order in FP64, rounded once to FP32. Against the exact (FP64) sum of every rank's
gradient, per wire: the largest error relative to the largest |sum| (max rel), the RMS error
relative to the RMS sum (rms rel), the share of elements whose error exceeds 2^-8 of their own
magnitude (bf16's rounding step), and the bytes per element on the wire. Prints one table.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import GPT, batch, stdlib_bytes  # noqa: E402

from zerort import _C  # noqa: E402
from zerort._testing.kernels import int8_blocks  # noqa: E402

MODELS = {"50m": dict(layers=10, d=640, heads=10, seq=128), "demo": dict(layers=6, d=256, heads=8, seq=128)}


def rank_gradient(model, data, rank, micro, seq):
    """One rank's flat FP32 gradient of one micro-batch."""
    model.zero_grad(set_to_none=True)
    x, y = batch(data, 0, rank, 0, micro, seq)
    logits = model(x)
    F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1)).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def wire(partial, name, block):
    """What the receiver takes for one partial (FP32) on the wire."""
    if name == "fp32":
        return partial
    if name == "bf16":
        return partial.to(torch.bfloat16).float()
    return int8_blocks(partial.contiguous(), block, name)[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="50m")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 256, 1024, 4096])
    a = ap.parse_args()
    torch.manual_seed(0)
    kw = MODELS[a.model]
    model = GPT(**kw)
    data = stdlib_bytes()
    grads = [rank_gradient(model, data, r, a.micro, kw["seq"]) for r in range(a.nodes * a.per_node)]
    exact = torch.stack(grads).double().sum(0)
    partials = [torch.stack(grads[k * a.per_node:(k + 1) * a.per_node]).double().sum(0).float()
                for k in range(a.nodes)]
    n = exact.numel()
    print(f"{a.model} GPT, {n / 1e6:.2f}M gradient elements, {a.nodes} nodes x {a.per_node} ranks, "
          f"{a.micro} x {kw['seq']} tokens per rank; the sum's largest |value| {exact.abs().max():.3e}")
    print("| wire | block | bytes/element | max rel | rms rel | elements off by > 2^-8 of themselves |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = [("fp32", None), ("bf16", None)] + [(code, b) for code in ("int8", "fp8_e4m3") for b in a.blocks]
    for name, block in rows:
        got = torch.stack([wire(p, name, block) for p in partials]).double().sum(0).float().double()
        err = (got - exact).abs()
        max_rel = (err.max() / exact.abs().max()).item()
        rms_rel = (err.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
        off = (err > exact.abs() * 2.0 ** -8).double().mean().item()
        size = {"fp32": 4, "bf16": 2}.get(name) or _C.int8_wire_bytes(n, block) / n
        print(f"| {name} | {block or '-'} | {size:.4f} | {max_rel:.2e} | {rms_rel:.2e} | {100 * off:.2f}% |")


if __name__ == "__main__":
    main()
