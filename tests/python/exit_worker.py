"""One process of the exit stress test (test_exit_stress.py): creates, trains and drops
engines at every stage 0-3, then ends in one of several ways. Under mpirun (mpi), torchrun
(gloo) or alone (one rank, in-process).

    exit_worker.py ROUNDS ENDING

Each round builds an engine per stage in turn, runs two forward/backward/step on it and
drops it; after every drop the process must be back to the threads it had before (the
engine's comm thread joined). The last round's engines stay alive unless ENDING is drop:
- drop: every engine dropped, normal return;
- alive: the last engines left alive at exit (module globals);
- raise: engines alive, an uncaught exception at the end (exit status 1);
- sys_exit: engines alive, sys.exit(0);
- inflight (gloo only): engines alive and torch.distributed all_reduces of Python tensors
  still queued, never waited, at exit (what aborted a process before zerort.lifecycle
  closed engines and communicators at exit);
- inflight_user (gloo only): the same on a process group this script creates and destroys
  itself, with zerort's engines still holding its backend.
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402

import zerort  # noqa: E402

ENDINGS = ("drop", "alive", "raise", "sys_exit", "inflight", "inflight_user")


def threads():
    return len(os.listdir("/proc/self/task"))


def threads_settled(limit, within_s=2.0):
    """The thread count once it is at most `limit`, or after within_s. A joined thread can
    stay listed in /proc/self/task for a moment: join returns when the thread has cleared
    its id, before the kernel releases its task (seen under load); a thread that was not
    joined stays for the whole wait."""
    deadline = time.monotonic() + within_s
    n = threads()
    while n > limit and time.monotonic() < deadline:
        time.sleep(0.005)
        n = threads()
    return n


def train(stage, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2))
    engine = zerort.initialize(model, {"stage": stage, "precision": "bf16", "reduce_bucket_numel": 64,
                                       "comm": {"timeout_s": 60}})
    for step in range(2):
        g = torch.Generator().manual_seed(1000 * seed + 10 * step + engine.rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
    return engine


def main():
    rounds, ending = int(sys.argv[1]), sys.argv[2]
    assert ending in ENDINGS, ending
    if ending == "inflight_user":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    zerort.comm.init(timeout_s=60)  # MPI or the gloo process group start their own threads, once
    keep = []
    for r in range(rounds):
        last = r == rounds - 1
        for stage in range(4):
            before = threads()
            engine = train(stage, 4 * r + stage)
            if last and ending != "drop":
                keep.append(engine)
                continue
            del engine
            after = threads_settled(before)
            assert after <= before, (f"round {r} stage {stage}: {after} threads after dropping the engine, "
                                     f"{before} before: its comm thread was not joined")
    globals()["KEPT"] = keep  # alive until interpreter shutdown
    if ending.startswith("inflight"):
        import torch.distributed as dist

        for _ in range(200):
            dist.all_reduce(torch.ones(1 << 12), async_op=True)  # the tensor dies now; the work holds it
        if ending == "inflight_user":
            dist.destroy_process_group()
    print(f"exit_worker rank {keep[0].rank if keep else '-'}: {rounds} rounds done, ending {ending}", flush=True)
    if ending == "raise":
        raise RuntimeError("exit_worker: the planned exception at the end")
    if ending == "sys_exit":
        sys.exit(0)


if __name__ == "__main__":
    main()
