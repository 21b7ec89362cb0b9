"""zerort.comm: the C++ Communicator on torch CPU tensors.

    comm = zerort.comm.init()          # backend by launcher: mpirun -> mpi, torchrun -> gloo
    comm.all_reduce(t)                 # in place, sum
    comm.reduce_scatter_accumulate(grads_bf16, shard_f32)

Every call blocks until done (the GIL is released) and raises zerort.CommTimeoutError when
a peer does not join within timeout_s.
"""
import datetime

import torch

from . import _C
from ._tensor_args import buffer, dtype_name


def detect_launch_env():
    """Rank and world from torchrun, Open MPI or PMI variables, in that order."""
    return _C.detect_launch_env()


def init(backend="auto", timeout_s=600.0, check_consistency=True):
    """Creates a Communicator. backend: 'auto', 'mpi', 'gloo' or 'inprocess' (one rank).
    gloo initialises torch.distributed (env:// rendezvous on MASTER_ADDR/MASTER_PORT, with
    timeout_s as the process group's timeout) unless it is already initialised. gloo's
    reduce_scatter honours only the process group's timeout, so when you initialise
    torch.distributed yourself, pass it the same timeout."""
    name = _C.resolve_backend(backend)
    if name != "gloo":
        return Communicator(_C.make_communicator(name, timeout_s, check_consistency))
    import torch.distributed as dist

    if not dist.is_initialized():
        env = detect_launch_env()
        dist.init_process_group("gloo", init_method="env://", rank=env["rank"],
                                world_size=env["world_size"],
                                timeout=datetime.timedelta(seconds=timeout_s))
    group = dist.group.WORLD
    return Communicator(_C.make_gloo_communicator(group.group_name, timeout_s, check_consistency))


class Communicator:
    def __init__(self, impl):
        self._c = impl

    @property
    def rank(self):
        return self._c.rank

    @property
    def size(self):
        return self._c.size

    @property
    def backend(self):
        return self._c.backend

    def all_reduce(self, t, op="sum"):
        self._c.all_reduce(buffer(t, "t"), t.numel(), dtype_name(t, "t"), op)
        return t

    def reduce_scatter(self, inp, out, op="sum"):
        n = out.numel()
        self._c.reduce_scatter(buffer(inp, "inp", n * self.size, out.dtype), buffer(out, "out"), n,
                               dtype_name(out, "out"), op)
        return out

    def reduce_scatter_accumulate(self, inp, out, accumulate=False):
        """inp: bf16/f16 with size*out.numel() elements; out: float32 shard."""
        n = out.numel()
        self._c.reduce_scatter_accumulate(buffer(inp, "inp", n * self.size), dtype_name(inp, "inp"),
                                          buffer(out, "out", dtype=torch.float32), n, accumulate)
        return out

    def all_gather(self, inp, out):
        n = inp.numel()
        self._c.all_gather(buffer(inp, "inp"), buffer(out, "out", n * self.size, inp.dtype), n,
                           dtype_name(inp, "inp"))
        return out

    def all_gather_async(self, inp, out):
        """Starts an all_gather; returns a handle whose .wait() finishes it. Keep inp and out
        alive until then (the handle holds references)."""
        n = inp.numel()
        work = self._c.all_gather_async(buffer(inp, "inp"), buffer(out, "out", n * self.size, inp.dtype), n,
                                        dtype_name(inp, "inp"))
        return _Pending(work, (inp, out))

    def all_to_all(self, inp, out):
        if inp.numel() % self.size:
            raise ValueError(f"all_to_all: inp has {inp.numel()} elements, not a multiple of the "
                             f"world size {self.size}")
        n = inp.numel() // self.size
        self._c.all_to_all(buffer(inp, "inp"), buffer(out, "out", inp.numel(), inp.dtype), n,
                           dtype_name(inp, "inp"))
        return out

    def broadcast(self, t, root=0):
        self._c.broadcast(buffer(t, "t"), t.numel(), dtype_name(t, "t"), root)
        return t

    def barrier(self):
        self._c.barrier()


class _Pending:
    """An async collective in flight, holding its tensors until wait()."""

    def __init__(self, work, tensors):
        self._work = work
        self._tensors = tensors

    def wait(self):
        if self._work is not None:
            self._work.wait()
            self._work, self._tensors = None, None
