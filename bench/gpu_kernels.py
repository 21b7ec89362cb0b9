"""GPU kernel benchmarks (scripts/gpu_check.sh runs this on a CUDA machine). Prints a table.

- device copy bandwidth: torch's device-to-device copy_, counting bytes read + written;
- zerort's fused AdamW: 30 bytes per element (grad 4 read; master, m, v 4 read + 4 written
  each; bf16 param 2 written), against the copy bandwidth, and against torch's
  AdamW(fused=True) followed by the bf16 cast that zerort's kernel does in the same pass;
- the reduce_scatter_accumulate local sum: W bf16 chunks read, the FP32 shard read and
  written, against torch's chunks.float().sum(0) added to the shard.
Times are CUDA-event medians over repeated launches after warm-up; every ratio comes from
the same run.
"""
import argparse
import statistics
import sys
import os

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from zerort._testing import kernels  # noqa: E402


def median_ms(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_row(n):
    """(device copy GB/s, its row): the ceiling the other rows are measured against."""
    src = torch.empty(n * 2, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = median_ms(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 4 / t / 1e6
    return copy_gbs, ("device copy_ (read+write)", f"{src.numel() * 8 / 1e9:.2f} GB", t, copy_gbs, "100% (ceiling)", "")


def adamw_rows(n, copy_gbs):
    """zerort's fused AdamW + bf16 write over n elements, and torch's fused AdamW + cast."""
    g = torch.randn(n, device="cuda") * 1e-2
    p = torch.randn(n, device="cuda")
    m = torch.zeros(n, device="cuda")
    v = torch.zeros(n, device="cuda")
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    hyper = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    steps = iter(range(1, 10**6))
    t_ours = median_ms(lambda: kernels.adamw_step(g, p, m, v, out, step=next(steps), **hyper))
    ours_gbs = 30 * n / t_ours / 1e6
    tp = torch.nn.Parameter(p.clone())
    tp.grad = g.clone()
    opt = torch.optim.AdamW([tp], fused=True, **hyper)
    t_torch = median_ms(lambda: (opt.step(), out.copy_(tp.detach())))
    return [("zerort AdamW + bf16 write (30 B/elem)", f"{n / 1e6:.0f}M elem", t_ours, ours_gbs,
             f"{100 * ours_gbs / copy_gbs:.1f}%", f"{t_torch / t_ours:.2f}x torch fused+cast"),
            ("torch AdamW(fused) + bf16 cast", f"{n / 1e6:.0f}M elem", t_torch, 34 * n / t_torch / 1e6,
             f"{100 * 34 * n / t_torch / 1e6 / copy_gbs:.1f}%", "(34 B/elem)")]


def local_sum_row(world, shard, copy_gbs):
    """reduce_scatter_accumulate's local sum of `world` bf16 chunks into an FP32 shard."""
    chunks = torch.randn(world * shard, device="cuda").to(torch.bfloat16)
    acc = torch.randn(shard, device="cuda")
    t_ours = median_ms(lambda: kernels.sum_chunks_to_f32(chunks, acc, accumulate=True))
    nbytes = world * shard * 2 + 8 * shard
    t_torch = median_ms(lambda: acc.add_(chunks.view(world, shard).float().sum(0)))
    return (f"local sum W={world} bf16 -> f32 (accumulate)", f"{shard / 1e6:.0f}M out", t_ours,
            nbytes / t_ours / 1e6, f"{100 * nbytes / t_ours / 1e6 / copy_gbs:.1f}%",
            f"{t_torch / t_ours:.2f}x torch float().sum(0)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1 << 28, help="elements per AdamW shard (default 268M)")
    args = ap.parse_args()
    n = args.numel
    copy_gbs, row = copy_row(n)
    rows = [row, *adamw_rows(n, copy_gbs)]
    rows += [local_sum_row(world, n // 4, copy_gbs) for world in (2, 4, 8)]

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("| kernel | size | median ms | GB/s | of copy bandwidth | vs torch (same run) |")
    print("|---|---|---|---|---|---|")
    for name, size, t, gbs, frac, ratio in rows:
        print(f"| {name} | {size} | {t:.3f} | {gbs:.0f} | {frac} | {ratio} |")


if __name__ == "__main__":
    main()
