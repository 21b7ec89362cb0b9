"""The shared-memory transport against gloo's TCP on one host (issue 44, part 1): the time of
one all_to_all, all_gather and all_reduce of a fixed size over the shm backend
(comm.intra_node 'shm') and over gloo ('backend'), medians of --reps calls with p90, after
--warmup calls. Prints one table (rank 0).

    .venv/bin/python bench/shm_transport.py --ranks 2 --mb 25 --reps 16

It launches itself under torchrun; each rank runs the calls back to back.
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))


def p90(xs):
    return sorted(xs)[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def rank_main(a):
    import torch
    import zerort

    rows = []
    for intra in ("shm", "backend"):
        comm = zerort.comm.init("auto", timeout_s=300, intra_node=intra)
        n = a.mb * (1 << 20) // 4 // comm.size * comm.size  # f32 elements, W equal chunks
        x, y = torch.ones(n), torch.empty(n)
        calls = {"all_to_all": lambda: comm.all_to_all(x, y),
                 "all_gather": lambda: comm.all_gather(x[: n // comm.size], y),
                 "all_reduce": lambda: comm.all_reduce(x)}
        for name, call in calls.items():
            times = []
            for i in range(a.warmup + a.reps):
                comm.barrier()
                t0 = time.perf_counter()
                call()
                if i >= a.warmup:
                    times.append(time.perf_counter() - t0)
            rows.append((name, comm.backend, statistics.median(times) * 1e3, p90(times) * 1e3))
        if intra == "shm":
            comm._close()
    if int(os.environ["RANK"]) == 0:
        print(f"W={os.environ['WORLD_SIZE']}, {a.mb} MB f32 per call, median of {a.reps} (p90)")
        print(f"{'call':<12}{'backend':<10}{'median ms':>11}{'p90 ms':>9}")
        for name, backend, med, p in sorted(rows):
            print(f"{name:<12}{backend:<10}{med:>11.2f}{p:>9.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mb", type=int, default=25)
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_main:
        return rank_main(a)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    os.execv(torchrun, [torchrun, "--standalone", "--nproc_per_node", str(a.ranks), os.path.abspath(__file__),
                        "--rank-main", "--mb", str(a.mb), "--reps", str(a.reps), "--warmup", str(a.warmup)])


if __name__ == "__main__":
    main()
