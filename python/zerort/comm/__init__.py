"""zerort.comm: the C++ Communicator on torch tensors (CPU for mpi and gloo, CUDA for nccl).

    comm = zerort.comm.init()          # backend by launcher: mpirun -> mpi, torchrun -> gloo
    comm = zerort.comm.init("nccl")    # CUDA tensors on cuda:LOCAL_RANK
    comm.all_reduce(t)                 # in place, sum
    comm.reduce_scatter_accumulate(grads_bf16, shard_f32)

Every call blocks until done (the GIL is released) and raises zerort.CommTimeoutError when
a peer does not join within timeout_s.

Ranks on one host (comm.intra_node 'shm', the default) talk through one /dev/shm segment
under torchrun (gloo): the whole job when it runs on one host, and the node-local groups
otherwise (zerort.comm.topology.grid_parts). Under mpirun MPI stays: Open MPI already moves
the bytes between ranks of one host through its own shared-memory transport, never a socket.
"""
import datetime
import os

import torch

from zerort import _C
from zerort import lifecycle
from zerort.comm import peers
from zerort.comm import topology as topology_mod
from zerort.comm.tensor_args import buffer, dtype_name
from zerort.errors import CommError, ConfigError, DeviceError

INTRA_NODE = ("shm", "backend")  # comm.intra_node: See init


def detect_launch_env():
    """Rank and world from torchrun, Open MPI or PMI variables, in that order."""
    return _C.detect_launch_env()


def init(backend="auto", timeout_s=600.0, debug=False, staged=None, topology="flat", inter_node_dtype="fp32",
         bucket_numel=topology_mod.probe.BUCKET_NUMEL, intra_node="shm", hybrid_stage=None):
    """Creates a Communicator. debug (comm.debug): check every collective across ranks as it
    is called (one blocking round-trip each); otherwise the step's decision checks them.
    backend: 'auto', 'mpi', 'gloo', 'nccl' (CUDA tensors on cuda:LOCAL_RANK) or 'inprocess'
    (one rank). 'auto' picks by launcher: mpi under mpirun, gloo under torchrun. gloo
    initialises torch.distributed (env:// rendezvous on MASTER_ADDR/MASTER_PORT, with
    timeout_s as the process group's timeout) unless it is already initialised; a group it
    initialises it also destroys at exit (zerort.lifecycle). gloo's reduce_scatter honours
    only the process group's timeout, so when you initialise torch.distributed yourself,
    pass it the same timeout. staged: 'cuda' carries CUDA buffers (on cuda:LOCAL_RANK) through
    pinned host memory over an mpi or gloo communicator, so ranks that share one GPU train
    together (NCCL refuses them); 'cpu' pushes CPU buffers through the same staging code. The
    topology applies to the host communicator under the staging (C++ Note [staging once]), and
    staged_part stages the groups that zerort.comm.topology splits off it.
    topology ('flat', 'two_hop' or 'auto') and inter_node_dtype ('fp32', 'bf16', 'int8' or 'fp8_e4m3'): the
    gradient reduce-scatter and the all-gather in two hops, within the node and across nodes
    (zerort.comm.topology); bucket_numel: the reduce bucket that auto's prediction assumes
    (zerort.comm.probe, whose Decision the communicator keeps as topology_decision); hybrid_stage:
    the job's stage, where auto may choose node groups for it too (config shard_size "auto").
    intra_node ('shm' or 'backend'): under gloo, ranks that share one host exchange through one
    /dev/shm segment (the shm backend, C++ comm/shm/) where 'shm': every collective of a
    single-host job, and the node-local parts of two-hop and of hybrid groups; 'backend' keeps
    gloo's TCP. Under mpi it changes nothing: Open MPI already moves the bytes between ranks of
    one host through its own shared-memory transport (vader/sm), never a socket."""
    if intra_node not in INTRA_NODE:
        raise ConfigError([f"comm.intra_node: got {intra_node!r}; allowed: {', '.join(INTRA_NODE)}"])
    name = _C.resolve_backend(backend)
    if staged is not None:
        return _init_staged(name, timeout_s, debug, staged, topology, inter_node_dtype, bucket_numel, intra_node,
                            hybrid_stage)
    flat = _init_nccl(timeout_s, debug) if name == "nccl" else _init_host(name, timeout_s, debug, intra_node)
    two_hop, decision = topology_mod.two_hop(flat, name, topology, inter_node_dtype, timeout_s, debug,
                                             detect_launch_env(), bucket_numel, hybrid_stage)
    comm = flat if two_hop is None else Communicator(two_hop, flat.device)
    comm.topology_decision = decision
    comm.intra_node = getattr(flat, "intra_node", intra_node)  # topology.grid_parts reads it
    return comm


def _init_host(name, timeout_s, debug, intra_node="backend"):
    """A flat mpi, gloo or in-process communicator; under gloo with intra_node 'shm' and every
    rank on one host, the shm communicator over the gloo world (which torch.distributed keeps)."""
    if name != "gloo":
        comm = Communicator(_C.make_communicator(name, timeout_s, debug))
        comm.intra_node = intra_node
        return comm
    import torch.distributed as dist

    if not dist.is_initialized():
        env = detect_launch_env()
        dist.init_process_group("gloo", init_method="env://", rank=env["rank"],
                                world_size=env["world_size"],
                                timeout=datetime.timedelta(seconds=timeout_s))
        lifecycle.created_process_group(dist.group.WORLD)
    group = dist.group.WORLD
    comm = Communicator(_C.make_gloo_communicator(group.group_name, timeout_s, debug))
    peers.watch(dist.distributed_c10d._get_default_store(), comm.rank, comm.size)
    comm.intra_node = intra_node
    if intra_node != "shm" or comm.size == 1 or topology_mod.layout(comm, detect_launch_env())[0] != (1, comm.size):
        return comm
    shm = Communicator(_C.make_shm_communicator(comm._c, timeout_s, debug))
    shm.intra_node, shm._bootstrap = intra_node, comm
    return shm


def _init_staged(name, timeout_s, debug, staged, topology, inter_node_dtype, bucket_numel, intra_node, hybrid_stage):
    """The host communicator of backend `name` (two-hop too, where topology asks) with every
    buffer staged through host memory once per collective (C++ Note [staging once] in
    comm/staged_communicator.h). Keeps the host one as .host, which staged_part reads."""
    if name not in ("mpi", "gloo", "inprocess"):
        raise ConfigError(f"comm: staged={staged!r} carries buffers over a host backend (mpi, gloo), not {name!r}")
    if staged not in ("cpu", "cuda"):
        raise ConfigError(f"comm: staged must be None, 'cuda' or 'cpu', got {staged!r}")
    device = -1
    if staged == "cuda":
        if not torch.cuda.is_available():
            raise CommError("comm: staged='cuda' needs a CUDA device, and torch sees none")
        device = detect_launch_env()["local_rank"] % torch.cuda.device_count()
        torch.cuda.set_device(device)
    # The staged communicator checks the calls under debug: the host one is made without.
    host = init(name, timeout_s, False, None, topology, inter_node_dtype, bucket_numel, intra_node, hybrid_stage)
    comm = Communicator(_C.make_staged_communicator(host._c, device, timeout_s, debug),
                        "cpu" if device < 0 else f"cuda:{device}")
    comm.host, comm.topology_decision, comm.intra_node = host, host.topology_decision, host.intra_node
    comm._staging = device, timeout_s, debug
    return comm


def staged_part(comm, part):
    """part, a C++ host communicator of some of comm's ranks made without comm.debug
    (zerort.comm.topology), moving comm's buffers: staged as comm is where comm is staged
    (Note [staging once]), else part itself."""
    if getattr(comm, "host", None) is None:
        return part
    device, timeout_s, debug = comm._staging
    return _C.make_staged_communicator(part, device, timeout_s, debug)


def _init_nccl(timeout_s, debug):
    """NCCL on cuda:LOCAL_RANK (modulo the visible devices). Under mpirun the C++ side
    exchanges the unique id with MPI_Bcast; under torchrun it goes through c10d's TCPStore
    at MASTER_ADDR:MASTER_PORT (the torchrun agent's store, or one rank 0 hosts)."""
    if not _C.with_nccl:
        raise CommError("comm.backend 'nccl' is not in this build of zerort (nvcc was not found at build "
                        "time); rebuild on a machine with the CUDA toolkit, or use 'mpi' or 'gloo'")
    if not torch.cuda.is_available():
        raise CommError("comm.backend 'nccl' needs a CUDA device, and torch sees none; use 'mpi' or "
                        "'gloo' for CPU training")
    env = detect_launch_env()
    device = env["local_rank"] % torch.cuda.device_count()
    torch.cuda.set_device(device)
    if env["launcher"] != "torchrun":
        return Communicator(_C.make_communicator("nccl", timeout_s, debug), f"cuda:{device}")
    import torch.distributed as dist

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env["master_addr"], env["master_port"], env["world_size"],
                          is_master=env["rank"] == 0 and not agent_store,
                          timeout=datetime.timedelta(seconds=timeout_s))
    key = f"zerort/nccl_unique_id/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if env["rank"] == 0:
        store.set(key, _C.nccl_unique_id())
    unique_id = store.get(key)  # waits up to timeout_s for rank 0
    impl = _C.make_nccl_communicator(env["rank"], env["world_size"], device, unique_id, timeout_s,
                                     debug)
    comm = Communicator(impl, f"cuda:{device}")
    comm._store = store  # a store rank 0 hosts must live as long as the job
    return comm


class Communicator:
    def __init__(self, impl, device="cpu"):
        self._c = impl
        self.device = torch.device(device)  # where this backend's buffers live
        self.topology_decision = None  # comm.topology auto's zerort.comm.probe.Decision, where it measured
        self.host = None  # staged: the host communicator under the staging (zerort.comm.init(staged=...))
        lifecycle.track_comm(self)  # closed at exit if still alive

    def _close(self):
        """Drops the C++ communicator now (zerort.lifecycle, at exit, after every engine that
        used it): for gloo, its reference to c10d's backend goes while the interpreter is
        whole. Unusable afterwards."""
        self._c = None

    @property
    def rank(self):
        return self._c.rank

    @property
    def size(self):
        return self._c.size

    @property
    def backend(self):
        return self._c.backend

    @property
    def backend_calls(self):
        """Collectives handed to the backend so far (none at W = 1: each call is the local
        copy it amounts to)."""
        return self._c.backend_calls

    @property
    def checks_each_call(self):
        """Every call is checked across ranks before it reaches the backend (comm.debug, or a
        stage-3 engine: Note [checked calls] in comm/communicator.h)."""
        return self._c.checks_each_call

    def check_each_call(self):
        """Checks every call from now on. Collective in effect: every rank must switch at the
        same point of its calls."""
        self._c.check_each_call()

    def delay_calls(self, kind, microseconds):
        """A test knob, not for training (Note [delayed calls] in comm/communicator.h): from now
        on this rank sleeps `microseconds` before each of its gathers (kind 'gathers':
        all_gather) or reduces ('reduces': all_reduce, reduce_scatter,
        reduce_scatter_accumulate), on the thread that makes the call (an engine's comm
        thread for its gathers and reduces). 0 turns it off. Parity tests use it to shake out
        ordering races: the results must stay bitwise the same."""
        if kind not in ("gathers", "reduces"):
            raise ConfigError(f"comm.delay_calls: kind must be 'gathers' or 'reduces', got {kind!r}")
        if isinstance(microseconds, bool) or not isinstance(microseconds, int) or microseconds < 0:
            raise ConfigError(f"comm.delay_calls: microseconds must be an int >= 0, got {microseconds!r}")
        self._c.delay_calls(kind, microseconds)

    def _staged(self, call, *tensors):
        """Small CPU control tensors (flags, digests, counters) given to a CUDA communicator
        travel through device copies; the results are copied back. Returns the last tensor."""
        on_device = [t.to(self.device) if isinstance(t, torch.Tensor) else t for t in tensors]
        call(*on_device)
        for t, d in zip(tensors, on_device):
            if d is not t:
                t.copy_(d)
        return tensors[-1]

    def _needs_staging(self, *tensors):
        return self.device.type == "cuda" and any(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                                  for t in tensors)

    def all_reduce(self, t, op="sum"):
        if self._needs_staging(t):
            return self._staged(lambda d: self.all_reduce(d, op), t)
        self._c.all_reduce(self._ptr(t, "t"), t.numel(), dtype_name(t, "t"), op)
        return t

    def reduce_scatter(self, inp, out, op="sum"):
        if self._needs_staging(inp, out):
            return self._staged(lambda i, o: self.reduce_scatter(i, o, op), inp, out)
        n = out.numel()
        self._c.reduce_scatter(self._ptr(inp, "inp", n * self.size, out.dtype), self._ptr(out, "out"), n,
                               dtype_name(out, "out"), op)
        return out

    # tag (reduce_scatter_accumulate, all_gather): what the call serves, a bucket or unit
    # index; the cross-rank check requires every rank to pass the same one (-1: none).
    def reduce_scatter_accumulate(self, inp, out, accumulate=False, tag=-1):
        """inp: bf16/f16 with size*out.numel() elements; out: float32 shard."""
        n = out.numel()
        self._c.reduce_scatter_accumulate(self._ptr(inp, "inp", n * self.size), dtype_name(inp, "inp"),
                                          self._ptr(out, "out", dtype=torch.float32), n, accumulate, tag)
        return out

    def all_gather(self, inp, out, tag=-1):
        if self._needs_staging(inp, out):
            return self._staged(lambda i, o: self.all_gather(i, o, tag), inp, out)
        n = inp.numel()
        self._c.all_gather(self._ptr(inp, "inp"), self._ptr(out, "out", n * self.size, inp.dtype), n,
                           dtype_name(inp, "inp"), tag)
        return out

    def all_gather_async(self, inp, out, tag=-1):
        """Starts an all_gather; returns a handle whose .wait() finishes it. Keep inp and out
        alive until then (the handle holds references). On CUDA it runs on the
        communicator's own stream, so it overlaps compute."""
        n = inp.numel()
        work = self._c.all_gather_async(self._ptr(inp, "inp"), self._ptr(out, "out", n * self.size, inp.dtype), n,
                                        dtype_name(inp, "inp"), tag)
        return _Pending(work, (inp, out))

    def all_to_all(self, inp, out):
        if inp.numel() % self.size:
            raise DeviceError(f"all_to_all: inp has {inp.numel()} elements, not a multiple of the "
                             f"world size {self.size}")
        n = inp.numel() // self.size
        self._c.all_to_all(self._ptr(inp, "inp"), self._ptr(out, "out", inp.numel(), inp.dtype), n,
                           dtype_name(inp, "inp"))
        return out

    def broadcast(self, t, root=0):
        if self._needs_staging(t):
            return self._staged(lambda d: self.broadcast(d, root), t)
        self._c.broadcast(self._ptr(t, "t"), t.numel(), dtype_name(t, "t"), root)
        return t

    def barrier(self):
        self._c.barrier()

    def _ptr(self, t, arg, numel=None, dtype=None):
        return buffer(t, arg, numel, dtype, self.device)


class _Pending:
    """An async collective in flight, holding its tensors until wait()."""

    def __init__(self, work, tensors):
        self._work = work
        self._tensors = tensors

    def wait(self):
        if self._work is not None:
            self._work.wait()
            self._work, self._tensors = None, None

    def __del__(self):
        # Dropped unwaited (an exception between start and wait): the transfer may still
        # write the tensors, so finish it first; if it cannot finish, keep them forever.
        if self._work is not None:
            try:
                self._work.wait()
            except Exception:
                _PARKED.append(self._tensors)


_PARKED = []  # tensors of transfers that failed unwaited: never freed under a live transfer
