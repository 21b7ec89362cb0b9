"""One rank of the Python-level multi-rank test. Launched by test_multirank.py under
torchrun (backend gloo, its own TCP path: comm.intra_node "backend"; tests/python/
test_shm_transport.py has the shm backend's) or mpirun (backend mpi). References are computed with plain torch
from every rank's inputs, which each rank regenerates from the rank's seed."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402

import zerort  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16, torch.float16]
REDUCE = {"sum": lambda xs: torch.stack(xs).sum(0), "max": lambda xs: torch.stack(xs).amax(0),
          "min": lambda xs: torch.stack(xs).amin(0)}


def ints(rank, n, salt, dtype):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)


def check(name, got, want):
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].item()
        raise AssertionError(f"{name} {got.dtype} n={want.numel()}: [{bad}] got {got[bad]} want {want[bad]}")


def conformance(comm, n):
    W, me = comm.size, comm.rank
    for salt, dt in enumerate(DTYPES):
        for op, red in REDUCE.items():
            # fp64 reference: small integers make sums exact in every dtype.
            t = ints(me, n, salt, dt)
            comm.all_reduce(t, op)
            check(f"all_reduce {op}", t, red([ints(r, n, salt, dt).double() for r in range(W)]).to(dt))
            inp, out = ints(me, n * W, salt + 50, dt), torch.empty(n, dtype=dt)
            comm.reduce_scatter(inp, out, op)
            want = red([ints(r, n * W, salt + 50, dt).double()[me * n:(me + 1) * n] for r in range(W)])
            check(f"reduce_scatter {op}", out, want.to(dt))
        out = torch.empty(n * W, dtype=dt)
        comm.all_gather(ints(me, n, salt + 100, dt), out)
        check("all_gather", out, torch.cat([ints(r, n, salt + 100, dt) for r in range(W)]))
        out = torch.empty(n * W, dtype=dt)
        comm.all_to_all(ints(me, n * W, salt + 200, dt), out)
        check("all_to_all", out, torch.cat([ints(r, n * W, salt + 200, dt)[me * n:(me + 1) * n]
                                            for r in range(W)]))
        root = n % W
        t = ints(me, n, salt + 300, dt)
        comm.broadcast(t, root)
        check("broadcast", t, ints(root, n, salt + 300, dt))
        if dt in (torch.bfloat16, torch.float16):
            out = torch.full((n,), 0.5)
            comm.reduce_scatter_accumulate(ints(me, n * W, salt + 400, dt), out, accumulate=True)
            want = 0.5 + sum(ints(r, n * W, salt + 400, dt).double()[me * n:(me + 1) * n] for r in range(W))
            check("reduce_scatter_accumulate", out, want.float())
    comm.barrier()


def accuracy(comm, n=4099):
    W, me = comm.size, comm.rank

    def grads(r):
        return torch.randn(n * W, generator=torch.Generator().manual_seed(77 + r)).bfloat16()

    ref = sum(grads(r).double()[me * n:(me + 1) * n] for r in range(W))
    rsa = torch.empty(n)
    comm.reduce_scatter_accumulate(grads(me), rsa)
    plain = torch.empty(n, dtype=torch.bfloat16)
    comm.reduce_scatter(grads(me), plain)
    assert torch.equal(rsa, ref.float()), "reduce_scatter_accumulate != fp64 sum rounded once"
    e_rsa = (rsa.double() - ref).abs().max().item()
    e_bf16 = (plain.double() - ref).abs().max().item()
    assert e_bf16 > e_rsa
    if me == 0:
        print(f"[accuracy W={W} {comm.backend}] reduce_scatter_accumulate max|err| {e_rsa:.3e}; "
              f"plain bf16 reduce_scatter max|err| {e_bf16:.3e}", flush=True)


def bad_input(backend, comm):
    me = comm.rank
    # comm.debug: checked at the call
    checked = zerort.comm.init(backend, timeout_s=60, debug=True, intra_node="backend")
    try:
        checked.all_reduce(torch.ones(5 if me == 1 else 4))
        raise AssertionError("count mismatch not detected")
    except zerort.Error as e:
        assert "count differs across ranks" in str(e), str(e)
    try:
        comm.all_reduce(torch.ones(3, dtype=torch.uint8))
        raise AssertionError("uint8 accepted")
    except TypeError as e:
        assert "not supported" in str(e)
    # Timeout: rank 0 waits 0.3 s; the others join after 1 s (waiting up to 10 s) and
    # still complete. Timeouts are per-rank settings.
    late = zerort.comm.init(backend, timeout_s=0.3 if me == 0 else 10, debug=False, intra_node="backend")
    x = torch.ones(1)
    if me == 0:
        t0 = time.time()
        try:
            late.all_reduce(x)
            raise AssertionError("no timeout")
        except zerort.CommTimeoutError as e:
            assert "all_reduce(count=1, dtype=f32, op=sum) on rank 0" in str(e), str(e)
        assert time.time() - t0 < 2
    else:
        time.sleep(1.0)
        late.all_reduce(x)
    comm.barrier()


def main():
    backend = sys.argv[1]
    comm = zerort.comm.init(backend, timeout_s=60, intra_node="backend")  # gloo's own path, not shm
    assert comm.backend == backend, comm.backend
    for n in (0, 1, 7, 1000):
        conformance(comm, n)
    accuracy(comm)
    bad_input(backend, comm)
    print(f"WORKER OK rank {comm.rank}/{comm.size} {comm.backend}", flush=True)


if __name__ == "__main__":
    main()
