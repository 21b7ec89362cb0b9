"""bf16 optimizer states against FP32 ones: one AdamW step's time and memory, in one run.

    .venv/bin/python bench/optimizer_states.py      (make bench runs it)

Per shard size: zerort's fused AdamW with Adam's m and v in FP32 (30 bytes per element
moved: FP32 grad, master, m, v in; master, m, v and the bf16 weight out) and in bf16 (22
bytes: m and v are 2 bytes each way), interleaved step by step, median and p90 over 20
steps after a warm-up, all cores. The states' bytes per element of the shard: 8 and 4.
"""
import statistics
import time

import torch

from zerort._testing.kernels import adamw_step

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
STEPS = 20


def p90(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def main():
    print(f"\nAdamW step, FP32 vs bf16 optimizer states, {torch.get_num_threads()} threads, median and p90 of "
          f"{STEPS} steps (interleaved)")
    print("| shard elements | fp32 states ms (p90) | bf16 states ms (p90) | fp32 / bf16 | state bytes fp32 | "
          "state bytes bf16 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (16 << 20, 64 << 20):
        grad, lp = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
        runs = {}
        for dtype in (torch.float32, torch.bfloat16):
            runs[dtype] = (torch.randn(n), torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype), [])
        for step in range(STEPS + 1):
            for dtype, (master, m, v, times) in runs.items():
                t0 = time.perf_counter()
                adamw_step(grad, master, m, v, lp, step=step + 1, **HYPER)
                if step:  # the first is the warm-up
                    times.append(1e3 * (time.perf_counter() - t0))
        f, b = runs[torch.float32][3], runs[torch.bfloat16][3]
        print(f"| {n} | {statistics.median(f):.1f} ({p90(f):.1f}) | {statistics.median(b):.1f} ({p90(b):.1f}) | "
              f"{statistics.median(f) / statistics.median(b):.2f} | {8 * n:,} | {4 * n:,} |")
        del runs, grad, lp


if __name__ == "__main__":
    main()
