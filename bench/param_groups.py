"""Param groups' cost in the optimizer step: one group against the usual two (no weight
decay on biases and norms), zerort's engine and torch.optim.AdamW, in one run.

    .venv/bin/python bench/param_groups.py [--layers 8 --d-model 512 --steps 24]

The GPT of examples/gpt.py at W = 1 (stage 1, fp32, in-process communicator). With two
groups the fused AdamW runs once per stretch of the shard that shares a group (a GPT
alternates weights and biases, so about 8 stretches per layer); the table shows what that
costs. Times: the optimizer part of step() as the engine measures it (stats
"optimizer_ms": the fused unscale/check pass, the decision and AdamW) and torch's
opt.step(), median and p90 over the steps after 4 warm-up steps.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import zerort  # noqa: E402
from gpt import GPT  # noqa: E402

WARMUP = 4


def groups(model, two):
    if not two:
        return [{"params": list(model.parameters())}]
    return [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def p90(xs):
    return sorted(xs)[max(0, int(round(0.9 * len(xs))) - 1)]


def run_zerort(args, two):
    torch.manual_seed(0)
    model = GPT(layers=args.layers, d=args.d_model, seq=64)
    e = zerort.initialize(model, {"stage": 1, "precision": "fp32", "comm": {"backend": "inprocess"}},
                          param_groups=groups(model, two))
    x = torch.randint(0, 256, (2, 64))
    times = []
    for step in range(args.steps + WARMUP):
        logits = e(x)
        e.backward(F.cross_entropy(logits.float().view(-1, 256), x.view(-1)))
        times.append(e.step()["optimizer_ms"])
    regions = len(e.optimizer._regions) if two else 1
    return times[WARMUP:], regions


def run_torch(args, two):
    torch.manual_seed(0)
    model = GPT(layers=args.layers, d=args.d_model, seq=64)
    opt = torch.optim.AdamW(groups(model, two), lr=1e-3)
    x = torch.randint(0, 256, (2, 64))
    times = []
    for step in range(args.steps + WARMUP):
        logits = model(x)
        F.cross_entropy(logits.view(-1, 256), x.view(-1)).backward()
        t0 = time.perf_counter()
        opt.step()
        times.append(1e3 * (time.perf_counter() - t0))
        opt.zero_grad()
    return times[WARMUP:]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    n = sum(p.numel() for p in set(GPT(layers=args.layers, d=args.d_model, seq=64).parameters()))
    print(f"GPT {args.layers} layers, d={args.d_model}: {n / 1e6:.1f}M parameters, {args.steps} steps, "
          f"{torch.get_num_threads()} threads")
    print(f"{'optimizer':<24} {'groups':>6} {'stretches':>9} {'median ms':>10} {'p90 ms':>8}")
    rows = {}
    for two in (False, True):
        times, regions = run_zerort(args, two)
        rows[("zerort", two)] = statistics.median(times)
        print(f"{'zerort fused AdamW':<24} {1 + two:>6} {regions:>9} {statistics.median(times):>10.2f} "
              f"{p90(times):>8.2f}")
        times = run_torch(args, two)
        rows[("torch", two)] = statistics.median(times)
        print(f"{'torch AdamW (foreach)':<24} {1 + two:>6} {'-':>9} {statistics.median(times):>10.2f} "
              f"{p90(times):>8.2f}")
    print(f"two groups / one group: zerort {rows[('zerort', True)] / rows[('zerort', False)]:.2f}x, torch "
          f"{rows[('torch', True)] / rows[('torch', False)]:.2f}x; zerort / torch with two groups "
          f"{rows[('zerort', True)] / rows[('torch', True)]:.2f}x")


if __name__ == "__main__":
    main()
