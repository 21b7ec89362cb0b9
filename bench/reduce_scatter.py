"""Reduce-scatter benchmark: one table per world size, all methods measured in one run.

    scripts/mpirun.sh -np 2 .venv/bin/python bench/reduce_scatter.py
    (make bench runs W = 2 and 4)

Methods, each reducing the same N-element gradient (S = 4N bytes, the FP32 size):
  (a) zerort reduce_scatter_accumulate over its MPI backend: bf16 on the wire (2N bytes in),
      FP32 sum in rank order into an FP32 shard;
  (b) MPI_Reduce_scatter_block in FP32 (blocking, via mpi4py, same Open MPI);
  (c) torch.distributed.reduce_scatter_tensor over gloo in FP32.
Time = the slowest rank's time for one call; the table shows the median over repeats,
algbw = S / time, and the ratios (a)/(b) and (a)/(c) of the medians (below 1: (a) faster).
"""
import argparse
import datetime
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from mpi4py import MPI

import zerort

SIZES_MB = [1, 16, 64, 256]
# torch 2.13 marks reduce_scatter_tensor deprecated; it is still the API the comparison names.
warnings.filterwarnings("ignore", category=FutureWarning)


def timed(fn, world, reps, warmup=2):
    """Median over reps of the max over ranks of one call's wall time."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        world.Barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(samples)


def time_size(comm, world, mb):
    """(mb, elements, reps, zerort s, MPI s, gloo s) for an S = mb MiB FP32 gradient; its buffers
    are freed on return, before the next size allocates its own."""
    rank, W = world.Get_rank(), world.Get_size()
    n = (mb * 2**20 // 4) // W * W
    reps = 20 if mb <= 16 else 7 if mb <= 64 else 5
    g32 = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    g16 = g32.bfloat16()
    shard32 = torch.empty(n // W)
    t_a = timed(lambda: comm.reduce_scatter_accumulate(g16, shard32), world, reps)
    t_b = timed(lambda: world.Reduce_scatter_block(g32.numpy(), shard32.numpy(), op=MPI.SUM), world, reps)
    t_c = timed(lambda: dist.reduce_scatter_tensor(shard32, g32), world, reps)
    return mb, n, reps, t_a, t_b, t_c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=int, nargs="*", default=SIZES_MB)
    ap.add_argument("--port", type=int, default=29541)
    args = ap.parse_args()

    world = MPI.COMM_WORLD
    rank, W = world.Get_rank(), world.Get_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=W, timeout=datetime.timedelta(minutes=10))
    comm = zerort.comm.init("mpi", timeout_s=600)

    rows = [time_size(comm, world, mb) for mb in args.sizes_mb]

    if rank == 0:
        print(f"\nreduce-scatter, W = {W} ranks, {os.cpu_count()} cores, torch {torch.__version__}, "
              f"{MPI.Get_library_version().splitlines()[0]}")
        print("| S (MB) | elements | reps | (a) zerort RSA bf16->fp32 ms | GB/s "
              "| (b) MPI fp32 ms | GB/s | (c) gloo fp32 ms | GB/s | (a)/(b) | (a)/(c) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for mb, n, reps, a, b, c in rows:
            s = 4 * n / 1e9
            print(f"| {mb} | {n} | {reps} | {a * 1e3:.2f} | {s / a:.2f} | {b * 1e3:.2f} | {s / b:.2f} "
                  f"| {c * 1e3:.2f} | {s / c:.2f} | {a / b:.2f} | {a / c:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
