"""What building an Engine decides before it allocates, as steps of Engine.__init__: whether a
live engine already trains the model, the model's one device, the communicator, the FP32
master values, a meta-device model's materializer, rank 0's frozen parameters and buffers,
and the lr schedule the engine steps."""
from dataclasses import replace

import torch

from zerort import comm as comm_mod
from zerort.comm import topology
from zerort import lifecycle
from zerort.engine import lr_schedules, meta_init, streams
from zerort.errors import ConfigError, DeviceError, UsageError


def engine_of(params):
    """The live engine that trains any of params, or None."""
    ids = {id(p) for p in params}
    for engine in lifecycle.engines():  # one whose __init__ failed early has no C++ Engine
        if engine.runtime is not None and ids & set(engine.param_index.names):
            return engine
    return None


def refuse_wrapped(model):
    """A model that a live engine trains cannot be wrapped again."""
    owner = engine_of(model.parameters())
    if owner is not None:
        raise UsageError("zerort.initialize: this model is already wrapped by a live zerort engine, whose "
                         f"initialize made its parameters {owner.dtype} views of that engine's buffers (in "
                         "place); wrap a model once and train through the engine initialize returned, or call "
                         "that engine's destroy() first (every parameter gets its FP32 master value back)")


def connect(c, device, comm):
    """The communicator: the one given, or one of config c's backend, moving buffers on the
    model's device."""
    cuda = device.type == "cuda"
    backend = "nccl" if cuda and c.comm.backend == "auto" else c.comm.backend
    if comm is None and backend == "nccl" and not cuda:
        raise ConfigError([f"comm.backend: got 'nccl' but the model is on {device}; nccl moves CUDA "
                           "buffers: move the model (model.cuda()), or use 'auto', 'mpi' or 'gloo'"])
    # A CUDA model over mpi or gloo: its buffers travel through pinned host memory (ranks
    # that share one GPU, where NCCL refuses them).
    staged = "cuda" if cuda and backend != "nccl" else None
    if comm is None:
        comm = comm_mod.init(backend, c.comm.timeout_s, bool(c.comm.debug), staged, c.comm.topology,
                             c.comm.inter_node_dtype, c.reduce_bucket_numel, intra_node=c.comm.intra_node,
                             hybrid_stage=c.stage if c.shard_size == "auto" else None)
    if comm.device != device:
        raise ConfigError([f"comm.backend: the model is on {device} but the '{comm.backend}' "
                           f"communicator moves {comm.device} buffers; use 'nccl' (or 'auto') for CUDA "
                           "models, or zerort.comm.init(..., staged='cuda'), and 'mpi' or 'gloo' for CPU "
                           "models"])
    if c.stage == 3 and c.comm.debug is None:
        comm.check_each_call()  # Note [checked calls]: ranks that diverge at stage 3 differ in size
    streams.follow_current_stream(None, device)  # the Engine's constructor follows the caller's stream
    return comm


def chosen_shard_size(c, comm):
    """Config c with shard_size "auto" made what comm.topology auto's probe chose (zerort.comm.probe):
    "node" for node groups, else None (the state sharded over the world, as where nothing was
    measured: one node, one rank a node, nccl, or a communicator given without a probe)."""
    if c.shard_size != "auto":
        return c
    decision = comm.topology_decision
    return replace(c, shard_size="node" if decision is not None and decision.node_groups else None)


def shard_groups(c, comm):
    """Config c's groups (zerort.comm.topology): this rank's (group, replicas, secondary)
    communicators; None for each that is not there. Hybrid sharding (shard_size) makes the
    first two, stage 3's secondary shards (stage3.secondary_shard_size, hpZ) the third."""
    backend = comm.backend.split("+")[0]  # a two-hop or staged communicator's flat backend
    env = comm_mod.detect_launch_env()
    timeout_s, debug = c.comm.timeout_s, bool(c.comm.debug)
    host = comm.host or comm  # staged (a CUDA model over mpi/gloo): the parts are split off the host one
    part_debug = debug and comm.host is None  # a staged part checks its calls itself (comm.staged_part)
    shard, replicas = topology.shard_groups(host, backend, c.shard_size, timeout_s, part_debug, env)
    secondary = topology.node_part(host, backend, c.stage3.secondary_shard_size, timeout_s, part_debug, env)
    # C++ Note [staging once]: the group and hpZ's part move the engine's buffers, staged as the
    # world is; the replicas sum on host scratch (runtime/shard_groups.h), so they stay host ones.
    made = [(shard, comm.device, True), (replicas, host.device, False), (secondary, comm.device, True)]
    groups = tuple(None if p is None else comm_mod.Communicator(comm_mod.staged_part(comm, p) if staged else p, device)
                   for p, device, staged in made)
    if groups[1] is not None and comm.host is not None and debug:
        groups[1].check_each_call()  # every rank makes it here, at the same point
    return groups


def masters_to_fp32(model, names):
    """bf16/fp16 parameters (a model loaded in half precision): their values, exactly, in the
    FP32 master, as DeepSpeed takes them; any other dtype is an error."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype in (torch.bfloat16, torch.float16):
                p.data = p.data.float()
    wrong = [p for p in model.parameters() if p.dtype != torch.float32]
    if wrong:
        raise DeviceError(f"zerort: parameter {names[id(wrong[0])]!r} is {wrong[0].dtype}; zerort trains "
                          "float32, bfloat16 and float16 parameters (it keeps an FP32 master and casts itself): "
                          "convert the model (model.float()), or keep such a tensor as a buffer "
                          "(register_buffer) instead of a parameter")


def materializer(model, device, weights):
    """A model built on the meta device: the meta_init.Materializer that makes it real bucket
    by bucket inside the C++ Engine; else None."""
    if weights is not None and not meta_init.is_meta_model(model):
        raise ConfigError("zerort.initialize: weights= is for a model built on the meta device (with "
                          "torch.device('meta'): ...); this model's parameters already hold values")
    if not meta_init.is_meta_model(model):
        return None
    meta_init.check_buffers(model)
    return meta_init.Materializer(model, device, weights)


def share_rank0_values(comm, model, frozen, plan, dtype):
    """Frozen parameters take part in compute only: rank 0's values, in the working precision
    dtype. Float buffers: rank 0's, cast only where zerort.layout.precision says. Returns the
    frozen parameters' FP32 values by id, kept for full_state_dict(master=True)."""
    fp32 = {}
    with torch.no_grad():
        for p in frozen:
            comm.broadcast(p.data, 0)
            fp32[id(p)] = p.data.clone()
            if id(p) not in plan.fp32_ids:
                p.data = p.data.to(dtype)
        for m in model.modules():
            for name, b in m.named_buffers(recurse=False):
                if b is not None and b.is_floating_point():
                    comm.broadcast(b, 0)
                    if (id(m), name) in plan.cast_buffers:
                        setattr(m, name, b.to(dtype))
    return fp32


def model_device(model):
    """The one device of every parameter and buffer (CPU for a model with none)."""
    device = None
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:  # built on the meta device: made real on the model's device (zerort.engine.meta_init)
            continue
        if device is None:
            device = t.device
        elif t.device != device:
            raise DeviceError(f"zerort: {name!r} is on {t.device} but the model's first tensor is on {device}; "
                            "move the whole model to one device (model.to(device)) first")
    if device is not None and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device or torch.device("cpu")


def scheduler(config, optimizer, given):
    """The engine's lr schedule: the config's scheduler section, or the one given (a
    schedule, or a function optimizer -> schedule), or None."""
    if given is not None and (config.optimizer.scheduler is not None or config.optimizer.lr_schedule is not None):
        key = "scheduler" if config.optimizer.scheduler is not None else "lr_schedule"
        raise ConfigError([f"{key}: the config has one and initialize() was given lr_scheduler= too; keep one of "
                           "them"])
    if given is None:
        return lr_schedules.build(config.optimizer.scheduler, optimizer)
    schedule = given(optimizer) if callable(given) and not hasattr(given, "step") else given
    moved = getattr(schedule, "optimizer", optimizer)
    if moved is not optimizer and [id(g) for g in moved.param_groups] != [id(g) for g in optimizer.param_groups]:
        raise ConfigError([f"lr_scheduler: the {type(schedule).__name__} given moves a {type(moved).__name__} whose "
                           "param groups are not the ones zerort's update reads, so its lr would never reach "
                           "the training; build it on engine.optimizer after initialize, or pass that optimizer "
                           "(its groups become zerort's: Note [shared param groups], zerort.engine.optimizer) "
                           "as optimizer= together with the schedule"])
    return schedule
