"""Step time of a bf16 GPT of about 350M parameters on one GPU (W = 1, NCCL): zerort stages
0-3 against plain PyTorch (bf16 autocast, FP32 weights, torch.optim.AdamW(fused=True)), all
in one run. Prints a table of median step times. scripts/gpu_check.sh runs it.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import zerort  # noqa: E402
from gpt import GPT  # noqa: E402

SHAPE = dict(layers=24, d=1024, heads=16, seq=1024, vocab=50304)


def timed_steps(step, steps, warmup):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def data(batch):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, SHAPE["vocab"], (batch, SHAPE["seq"]), device="cuda", generator=g)
    return x, torch.roll(x, -1, 1)


def loss_of(logits, y):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))


def run_torch(batch, steps, warmup):
    torch.manual_seed(0)
    model = GPT(**SHAPE).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y = data(batch)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    t = timed_steps(step, steps, warmup)
    return t, torch.cuda.max_memory_allocated()


def run_zerort(stage, batch, steps, warmup, comm):
    torch.manual_seed(0)
    model = GPT(**SHAPE).cuda()
    engine = zerort.initialize(model, {"stage": stage, "precision": "bf16", "optimizer": {"lr": 1e-4},
                                       "gradient_clipping": 1.0}, comm=comm)
    x, y = data(batch)

    def step():
        engine.backward(loss_of(engine(x), y))
        engine.step()
    t = timed_steps(step, steps, warmup)
    parts = {k: round(engine.stats.get(k, 0.0), 1) for k in ("forward_ms", "backward_ms", "reduce_ms",
                                                              "optimizer_ms", "gather_ms")}
    print(f"stage {stage}: last step's parts {parts}; {engine.skipped_steps} of {engine.global_step} steps "
          f"skipped", flush=True)
    return t, torch.cuda.max_memory_allocated()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    n_params = sum(p.numel() for p in set(GPT(**SHAPE).parameters()))
    tokens = args.batch * SHAPE["seq"]
    comm = zerort.comm.init("nccl")
    rows = []
    runtimes = [("torch (autocast bf16, fused AdamW)", lambda: run_torch(args.batch, args.steps, args.warmup))]
    runtimes += [(f"zerort stage {s}", lambda s=s: run_zerort(s, args.batch, args.steps, args.warmup, comm))
                 for s in range(4)]
    for name, fn in runtimes:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            t, peak = fn()
            rows.append((name, t, peak, None))
        except Exception as e:  # keep the row, say why
            rows.append((name, None, None, f"{type(e).__name__}: {str(e)[:200]}"))
        print(rows[-1], flush=True)
    base = rows[0][1]
    print(f"\nGPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  GPT {n_params / 1e6:.0f}M params, "
          f"micro-batch {args.batch}x{SHAPE['seq']}, W = 1, median of {args.steps} steps after {args.warmup}")
    print("| runtime | step ms | tokens/s | time vs torch | peak GPU memory GB |")
    print("|---|---|---|---|---|")
    for name, t, peak, err in rows:
        if err:
            print(f"| {name} | failed: {err} | | | |")
        else:
            ratio = f"{t / base:.2f}" if base else "-"
            print(f"| {name} | {1e3 * t:.1f} | {tokens / t:,.0f} | {ratio} | {peak / 2**30:.2f} |")


if __name__ == "__main__":
    main()
