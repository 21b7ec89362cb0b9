"""Optimizer benchmark: one AdamW step over one shard, ours vs torch, in one run.

    .venv/bin/python bench/optimizer.py           (make bench runs it)

Rows, per shard size (16M and 64M elements), median of 5 after 1 warm-up, all cores:
  zerort fused AdamW: FP32 grad, master, m, v in; master, m, v and the bf16 weight out
                      (30 bytes per element moved);
  torch AdamW foreach=True  (FP32 only: no bf16 copy);
  torch AdamW fused=True + the separate bf16 cast torch needs to refresh the working copy.
Bandwidth: our bytes/s at 30 B/element, against this machine's copy bandwidth measured here
(torch copy_ of a 1 GiB FP32 tensor into another, counting read + write).
"""
import statistics
import time

import torch

import zerort
from zerort._testing.kernels import adamw_step

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def median_time(fn, reps=5):
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def copy_bandwidth():
    # STREAM-style copy of 1 GiB (far beyond the L3), all threads, read + write counted.
    src = torch.randn(256 << 20)
    dst = torch.zeros_like(src)
    t = median_time(lambda: dst.copy_(src), reps=5)
    return 2 * src.numel() * 4 / t


def torch_adamw(n, **flags):
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], **HYPER, **flags)
    opt.step()  # creates the states
    return p, opt


def time_ours(n):
    """Median seconds of zerort's fused AdamW step over n elements (its buffers freed on return)."""
    grad, master = torch.randn(n), torch.randn(n)
    m, v, lp = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
    step = [0]

    def ours():
        step[0] += 1
        adamw_step(grad, master, m, v, lp, step=step[0], **HYPER)

    return median_time(ours)


def time_torch(n, fused=False, foreach=False):
    """Median seconds of torch's AdamW step over n elements; fused: with the bf16 cast of the
    weights that zerort's kernel does in the same pass."""
    p, opt = torch_adamw(n, fused=fused, foreach=foreach)
    if not fused:
        return median_time(opt.step)
    lp = torch.empty(n, dtype=torch.bfloat16)

    def fused_and_cast():
        opt.step()
        lp.copy_(p.detach())

    return median_time(fused_and_cast)


def main():
    threads = torch.get_num_threads()
    bw = copy_bandwidth()
    print(f"\nAdamW step, {threads} threads (torch) / {zerort._C.__version__} zerort, torch {torch.__version__}; "
          f"measured copy bandwidth {bw / 1e9:.2f} GB/s")
    print("| shard elements | zerort fused+bf16 ms | torch foreach ms | torch fused + bf16 cast ms "
          "| foreach / ours | fused+cast / ours | our GB/s (30 B/elem) | % of copy bw |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in (16 << 20, 64 << 20):
        t_ours, t_foreach, t_fused = time_ours(n), time_torch(n, foreach=True), time_torch(n, fused=True)
        ours_bw = 30 * n / t_ours
        print(f"| {n} | {t_ours * 1e3:.1f} | {t_foreach * 1e3:.1f} | {t_fused * 1e3:.1f} | "
              f"{t_foreach / t_ours:.2f} | {t_fused / t_ours:.2f} | {ours_bw / 1e9:.2f} | {100 * ours_bw / bw:.0f}% |")


if __name__ == "__main__":
    main()
