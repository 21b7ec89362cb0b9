"""deepspeed.comm on zerort: DeepSpeed's communication functions, as torch.distributed.

    import zerort.integrations.deepspeed as deepspeed      # or, under the launcher, import deepspeed
    deepspeed.init_distributed()                             # torch.distributed's default group, for real
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    deepspeed.comm.all_reduce(t)

There is no second communication library here: every collective is torch.distributed's,
on the default group init_distributed() made (or one the program made). zerort's engine
trains over its own communicator (zerort.comm) beside it; under torchrun both use the
same gloo group. DeepSpeed's extra keyword arguments (prof, log_name, debug) are taken and
dropped. Each collective is counted (calls and bytes) for log_summary().
"""
import datetime
import os
import socket

import torch
import torch.distributed as dist

from zerort import comm as zerort_comm
from zerort import lifecycle
from zerort.errors import CommError, ConfigError
from zerort.integrations.deepspeed.names import not_provided
from zerort.integrations.deepspeed.ranks import get_local_rank, get_rank, get_world_size  # noqa: F401
from zerort.integrations.deepspeed.utils import log_dist

ReduceOp = dist.ReduceOp
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # DeepSpeed's default_pg_timeout
DS_ONLY_KWARGS = ("prof", "log_name", "debug")
_calls = {}  # collective -> [calls, bytes], for log_summary()


def is_available():
    return dist.is_available()


def is_initialized():
    return dist.is_initialized()


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500, verbose=True,
                     timeout=DEFAULT_TIMEOUT, init_method=None, dist_init_required=None, config=None, rank=-1,
                     world_size=-1):
    """DeepSpeed's init_distributed: makes torch.distributed's default process group from
    the launcher's environment (torchrun's, or Open MPI's / PMI's, whose rank 0 address
    and port travel over zerort's MPI communicator when MASTER_ADDR is not set), unless a
    group exists already. dist_backend: None picks nccl for a process that sees a GPU,
    gloo otherwise. A single process without a launcher is rank 0 of 1. distributed_port
    and auto_mpi_discovery are accepted and unused: under mpirun the system picks rank 0's
    port (_store)."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        return
    env = zerort_comm.detect_launch_env()
    rank = env["rank"] if rank is None or rank < 0 else rank
    world_size = env["world_size"] if world_size is None or world_size < 0 else world_size
    backend = _backend(dist_backend)
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if backend == "nccl":
        torch.cuda.set_device(env["local_rank"] % torch.cuda.device_count())
    meet = {"init_method": init_method} if init_method is not None or _has_master() else \
        {"store": _store(env, rank, world_size, timeout)}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **meet)
    lifecycle.created_process_group(dist.group.WORLD)  # destroyed at exit while gloo's threads can end
    if verbose and rank == 0:
        log_dist(f"zerort: torch.distributed initialized ({backend}, W={world_size}, {env['launcher']})",
                 ranks=[0])


def _backend(name):
    """None: nccl for a process that sees a GPU, else gloo. torch's per-device form
    ("cpu:gloo,cuda:nccl") is taken as torch takes it where there is a GPU, and as its
    CPU entry where there is none (a CPU build of torch has no NCCL)."""
    if name is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if ":" in name and not torch.cuda.is_available():
        entries = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        name = entries.get("cpu", name)
    if name not in ("gloo", "nccl", "mpi") and ":" not in name:  # "dev:backend,...": torch checks it itself
        raise ConfigError([f"deepspeed.init_distributed(dist_backend={name!r}): zerort's torch has gloo, nccl and "
                           "mpi process groups (or torch's \"cpu:gloo,cuda:nccl\" form); pass one of them or None"])
    return name


def _has_master():
    return "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ


def _store(env, rank, world_size, timeout):
    """The rendezvous store when no MASTER_ADDR / MASTER_PORT is set: an in-memory one for a
    job of one process; under mpirun (or PMI) rank 0's TCPStore on a port the system picks,
    its address and port sent to every rank over zerort's MPI communicator (no port is
    chosen first and bound later, so none can be taken in between)."""
    if world_size == 1:
        return dist.HashStore()
    if env["launcher"] not in ("openmpi", "pmi"):
        raise CommError(f"deepspeed.init_distributed: rank {rank} of {world_size} has no MASTER_ADDR and "
                        "MASTER_PORT and was not started by mpirun; launch with torchrun, mpirun or "
                        "python -m zerort.integrations.deepspeed.launcher")
    comm = zerort_comm.init("mpi", timeout.total_seconds())
    row = torch.zeros(66, dtype=torch.int64)
    store = None
    if comm.rank == 0:
        addr = "127.0.0.1" if env["local_world_size"] == env["world_size"] else _my_address()
        store = dist.TCPStore(addr, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        row[0], row[1] = store.port, len(addr)
        row[2:2 + len(addr)] = torch.tensor(list(addr.encode()), dtype=torch.int64)
    comm.broadcast(row, 0)
    if store is None:
        addr = bytes(row[2:2 + int(row[1])].tolist()).decode()
        store = dist.TCPStore(addr, int(row[0]), world_size, is_master=False, timeout=timeout)
    return store


def _my_address():
    return socket.gethostbyname(socket.gethostname())


def _group_or_fail(name):
    if not dist.is_initialized():
        raise CommError(f"deepspeed.comm.{name}: torch.distributed has no process group yet; call "
                        "deepspeed.init_distributed() first (or deepspeed.initialize(), which makes one)")


def get_global_rank(group=None, group_rank=0):
    _group_or_fail("get_global_rank")
    return dist.get_global_rank(group or dist.group.WORLD, group_rank)


def get_world_group():
    _group_or_fail("get_world_group")
    return dist.group.WORLD


def get_backend(group=None):
    _group_or_fail("get_backend")
    return dist.get_backend(group)


def _nbytes(args):
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def _collective(fn, name=None):
    """DeepSpeed's wrapper of a torch.distributed call (named `name`, default fn's name):
    checks a group exists, drops DeepSpeed's own keyword arguments, counts the call for
    log_summary()."""
    name = name or fn.__name__

    def call(*args, **kwargs):
        _group_or_fail(name)
        for key in DS_ONLY_KWARGS:
            kwargs.pop(key, None)
        row = _calls.setdefault(name, [0, 0])
        row[0] += 1
        row[1] += _nbytes(args) + _nbytes(kwargs.values())
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"deepspeed.comm.{name}: torch.distributed's {fn.__name__}, counted for log_summary()."
    return call


barrier = _collective(dist.barrier)
monitored_barrier = _collective(dist.monitored_barrier)
all_reduce = _collective(dist.all_reduce)
reduce = _collective(dist.reduce)
broadcast = _collective(dist.broadcast)
all_gather = _collective(dist.all_gather)
# torch 2.13 renamed these two (the old names warn); DeepSpeed's names stay.
all_gather_into_tensor = _collective(getattr(dist, "all_gather_single", dist.all_gather_into_tensor),
                                     "all_gather_into_tensor")
reduce_scatter = _collective(dist.reduce_scatter)
reduce_scatter_tensor = _collective(getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor),
                                    "reduce_scatter_tensor")
all_to_all_single = _collective(dist.all_to_all_single)
gather = _collective(dist.gather)
scatter = _collective(dist.scatter)
send = _collective(dist.send)
recv = _collective(dist.recv)
isend = _collective(dist.isend)
irecv = _collective(dist.irecv)
new_group = _collective(dist.new_group)


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    """DeepSpeed's inference all-reduce: a plain all_reduce here."""
    return all_reduce(tensor, op=op, group=group)


def destroy_process_group(group=None):
    if dist.is_initialized():
        dist.destroy_process_group(group)


def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None):
    """DeepSpeed's comms-logger switch: every call is counted here already; accepted."""


def log_summary(show_straggler=False):
    """Rank 0 prints each deepspeed.comm collective this process called: calls and bytes."""
    if get_rank() != 0:
        return
    lines = [f"{'collective':<24}{'calls':>8}{'MB':>12}"]
    lines += [f"{name:<24}{c:>8}{b / 1e6:>12.3f}" for name, (c, b) in sorted(_calls.items())]
    print("deepspeed.comm summary (zerort; this rank's calls through deepspeed.comm)\n" + "\n".join(lines),
          flush=True)


__getattr__ = not_provided(__name__)
