"""comm.topology: the gradient reduce-scatter and the parameter all-gather in two hops, within
the node and across nodes (Note [two hops], comm/two_hop_communicator.h), over a flat
communicator and the two parts of it this module makes with the backend's own means: an MPI
split (MPI_Comm_split), a torch.distributed group per part for gloo, or an ncclCommSplit for
nccl (C++ Note [nccl parts]; the hops then run on the GPU: Note [two hops on the device]).

    "flat"     one all-to-all over every rank (zerort's data path before issue 30)
    "two_hop"  within the node, then across nodes; an error where the ranks do not form nodes
    "auto"     where the ranks span more than one node with more than one rank on each, the
               pattern a bounded probe of the two parts and the traffic model predict faster
               (zerort.comm.probe; with shard_size "auto" it also chooses node groups); else flat
               (said once on rank 0's log when the nodes do not line up)

The nodes come from the launcher: torchrun's and Open MPI's local rank and local world size.
All ranks agree on them once, here (one all-gather): every node has the same number of ranks
G, rank r is local rank r % G of node r // G, and the ranks of one node share a host name.

shard_groups makes the same split for hybrid sharding (shard_size), with groups of shard_size
consecutive ranks in place of nodes.
"""
import logging
import socket
import zlib

import torch

from zerort import _C
from zerort.comm import probe
from zerort.errors import ConfigError

TOPOLOGIES = ("auto", "flat", "two_hop")
GROUP_BACKENDS = ("mpi", "gloo", "nccl")  # the backends whose communicators grid_parts splits
INTER_DTYPES = ("fp32", "bf16", "int8", "fp8_e4m3")
log = logging.getLogger("zerort.comm")


def layout(comm, env):
    """(nodes, ranks per node) that every rank agrees on, or (None, why) when the launch does
    not form equal nodes numbered node by node (a collective)."""
    host = zlib.crc32(socket.gethostname().encode())
    row = torch.tensor([env["local_rank"], env["local_world_size"], host], dtype=torch.int64)
    rows = comm.all_gather(row, torch.empty(comm.size * 3, dtype=torch.int64)).view(comm.size, 3).tolist()
    per_node = rows[0][1]
    if any(r[1] != per_node for r in rows) or per_node < 1 or comm.size % per_node:
        return None, f"unequal nodes (ranks per node {sorted({r[1] for r in rows})} over {comm.size} ranks)"
    for rank, (local, _, name) in enumerate(rows):
        if local != rank % per_node or name != rows[rank - local][2]:
            return None, (f"rank {rank} is local rank {local} of a node of {per_node}, not node {rank // per_node}'s "
                          f"local rank {rank % per_node} on that node's host")
    return (comm.size // per_node, per_node), None


def two_hop(comm, backend, topology, inter_dtype, timeout_s, debug, env, bucket_numel=probe.BUCKET_NUMEL,
            hybrid_stage=None):
    """(the C++ two-hop communicator over the flat communicator comm, or None where the topology
    stays flat; auto's probe.Decision, or None where nothing was measured). See the module's
    text; bucket_numel: the gradient elements per reduce bucket that auto's prediction assumes;
    hybrid_stage: the job's stage where shard_size "auto" lets auto choose node groups."""
    if topology not in TOPOLOGIES:
        raise ConfigError([f"comm.topology: got {topology!r}; allowed: {', '.join(TOPOLOGIES)}"])
    if inter_dtype not in INTER_DTYPES:
        raise ConfigError([f"comm.inter_node_dtype: got {inter_dtype!r}; allowed: {', '.join(INTER_DTYPES)}"])
    if topology == "flat" or comm.size == 1:
        return None, None
    if backend not in GROUP_BACKENDS:
        if topology == "two_hop":
            raise ConfigError([f"comm.topology: 'two_hop' is built for the {', '.join(GROUP_BACKENDS)} backends, "
                               f"not {backend!r}: set comm.topology to 'flat' or 'auto'"])
        return None, None
    if backend == "nccl" and topology == "auto":  # the probe times host buffers (zerort.comm.probe)
        if comm.rank == 0:
            log.info("zerort: comm.topology 'auto' stays flat under nccl (its probe times host buffers); "
                     "set 'two_hop' to run the two hops on NCCL parts")
        return None, None
    shape, why = layout(comm, env)
    if shape is None:
        if topology == "two_hop":
            raise ConfigError([f"comm.topology: 'two_hop' needs equal nodes numbered node by node; here {why}: "
                               "launch the same number of ranks on every host, or set comm.topology to 'flat'"])
        if comm.rank == 0:
            log.warning("zerort: comm.topology 'auto' stays flat: %s", why)
        return None, None
    nodes, per_node = shape
    if topology == "auto" and (nodes == 1 or per_node == 1):
        return None, None
    intra, inter = grid_parts(comm, backend, per_node, timeout_s, debug)
    device = comm.device.index if backend == "nccl" else -1  # nccl parts: the hops work on that GPU
    hops = _C.make_two_hop_communicator(comm._c, intra, inter, inter_dtype, timeout_s, debug, device)
    if topology == "two_hop":
        return hops, None
    decision = probe.decide(comm, backend, (intra, inter, hops), nodes, per_node, inter_dtype, bucket_numel,
                            hybrid_stage)
    return (None if decision.topology == "flat" else hops), decision


def shard_groups(comm, backend, shard_size, timeout_s, debug, env):
    """Hybrid sharding (shard_size; C++ Note [hybrid sharding] in runtime/shard_groups.h): this
    rank's (group, replicas) C++ communicators, or (None, None) where the groups are the whole
    world. shard_size: None, an int that divides the world size, or "node". A collective."""
    size = _group_size(comm, "shard_size", shard_size, env)
    if size is None or size == comm.size:
        return None, None
    _host_backend(backend, "shard_size")
    return grid_parts(comm, backend, size, timeout_s, debug)


def node_part(comm, backend, size, timeout_s, debug, env):
    """Stage 3's secondary shards (stage3.secondary_shard_size; C++ Note [secondary shards]):
    the C++ communicator of this rank's group of `size` consecutive ranks ("node": the
    launcher's), or None without one (a group of 1 is none: hpZ off). A collective."""
    key = "stage3.secondary_shard_size"
    size = _group_size(comm, key, size, env)
    if size is None or size == 1:
        return None
    _host_backend(backend, key)
    return grid_parts(comm, backend, size, timeout_s, debug)[0]


def _group_size(comm, key, size, env):
    """The ranks per group that config key `key` asks for (None, an int or "node": the nodes
    that layout() agrees on), checked against the world."""
    if size is None:
        return None
    if size == "node":
        shape, why = layout(comm, env)
        if shape is None:
            raise ConfigError([f"{key}: 'node' needs equal nodes numbered node by node; here {why}: launch "
                               f"the same number of ranks on every host, or give {key} as a number"])
        size = shape[1]
    if comm.size % size:
        raise ConfigError([f"{key}: got {size}, which does not divide the world size {comm.size}: use "
                           f"a divisor of it (groups of consecutive ranks)"])
    return size


def _host_backend(backend, key):
    """Groups of ranks are split off mpi, gloo and nccl communicators; a ConfigError naming key otherwise."""
    if backend not in GROUP_BACKENDS + ("shm",):  # shm: a single-host job's gloo world (grid_parts)
        raise ConfigError([f"{key}: groups of ranks are built for the {', '.join(GROUP_BACKENDS)} backends, not "
                           f"{backend!r}; drop {key}, or use one of those"])


def grid_parts(comm, backend, per_row, timeout_s, debug):
    """The ranks as rows of per_row consecutive ranks: this rank's (row, column) C++
    communicators, from an MPI split, a torch.distributed group per part (gloo, or shm: a
    single-host job's gloo world) or an ncclCommSplit (nccl_parts). Rank r is index r % per_row
    of row r // per_row; its column holds the rows' ranks of that index. Under gloo a row whose
    ranks share one host talks through shared memory (the shm backend over the row's gloo group)
    where comm.intra_node is 'shm' (zerort.comm.init): two-hop's first hop, hybrid groups and
    hpZ's node part."""
    row, index = divmod(comm.rank, per_row)
    if backend == "nccl":
        return nccl_parts(comm, per_row, timeout_s, debug)
    if backend == "mpi":
        return _C.make_mpi_part(row, index, timeout_s, debug), _C.make_mpi_part(index, row, timeout_s, debug)
    import torch.distributed as dist

    rows = comm.size // per_row  # every rank makes every group, in the same order, as new_group requires
    groups = {("row", k): dist.new_group([k * per_row + j for j in range(per_row)]) for k in range(rows)}
    groups.update({("column", j): dist.new_group([k * per_row + j for k in range(rows)]) for j in range(per_row)})
    make = lambda g: _C.make_gloo_communicator(g.group_name, timeout_s, debug)
    row_comm, column_comm = make(groups["row", row]), make(groups["column", index])
    if getattr(comm, "intra_node", "backend") == "shm" and per_row > 1 and _row_on_one_host(comm, per_row):
        row_comm = _C.make_shm_communicator(row_comm, timeout_s, debug)  # collective over the row
    return row_comm, column_comm


def _row_on_one_host(comm, per_row):
    """Whether this rank's row of per_row consecutive ranks shares one host (a collective:
    every rank learns every rank's host, so the ranks of a row agree)."""
    host = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64)
    hosts = comm.all_gather(host, torch.empty(comm.size, dtype=torch.int64)).tolist()
    first = comm.rank // per_row * per_row
    return len(set(hosts[first:first + per_row])) == 1


def nccl_parts(comm, per_row, timeout_s, debug):
    """grid_parts under nccl: this rank's (row, column) parts of the flat nccl communicator (a
    two-hop one's flat one), each by ncclCommSplit (C++ Note [nccl parts]): the row by color
    row and key index, the column by color index and key row; every rank splits the rows first,
    then the columns. A failed or timed-out split names its group, as "row 1 of 2 (ranks 2,3)"."""
    row, index = divmod(comm.rank, per_row)
    rows = comm.size // per_row
    row_name = group_name("row", row, rows, [row * per_row + j for j in range(per_row)])
    column_name = group_name("column", index, per_row, [k * per_row + index for k in range(rows)])
    return (_C.make_nccl_part(comm._c, row, index, row_name, timeout_s, debug),
            _C.make_nccl_part(comm._c, index, row, column_name, timeout_s, debug))


def group_name(kind, number, count, ranks):
    """How errors name a part: 'row 1 of 2 (ranks 2,3)'."""
    return f"{kind} {number} of {count} (ranks {','.join(str(r) for r in ranks)})"
