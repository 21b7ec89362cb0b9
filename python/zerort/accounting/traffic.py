"""The bytes each collective of one step sends per rank, within the node and across nodes, as
zerort runs them (python -m zerort.accounting.planner prints them; its docstring gives the
algorithms and tests/python/test_two_hosts.py measures them on two hosts). W = N nodes x G
ranks per node.

Hybrid sharding (shard_size S, C++ Note [hybrid sharding]): the reduce-scatter and the
all-gathers run over the group of S consecutive ranks as over a world of S; once per step each
rank's FP32 gradient shard (Psi / S elements) is summed across the R = W / S groups: an
all-to-all of R pieces on the inter-node wire (zerort's sum_over_wire), then an all-gather of the
sums on the same wire (gather_over_wire), each a direct exchange with the R - 1 other groups'
ranks of this index (those on this rank's node, when S < G, send within it). Stage 3's
secondary shards (hpZ, groups of G' ranks, C++ Note [secondary shards]): the backward's
all-gather is a ring over the G' ranks.

predict_seconds turns the bytes into seconds at measured rates (LinkRates) for the flat and the
two-hop patterns: comm.topology auto's choice (zerort.comm.probe); step_seconds does the same for a
whole step's collectives in a layout: shard_size auto's choice between the state sharded over the
world and node groups.
"""
import dataclasses

from zerort import _C
from zerort.errors import ConfigError

BLOCKS_8BIT = 1 + 4 / _C.INT8_BLOCK  # an 8-bit code per element and a float32 scale per block: Note [int8 blocks]
WIRE_BYTES = {"fp32": 4, "bf16": 2, "int8": BLOCKS_8BIT, "fp8_e4m3": BLOCKS_8BIT}  # partial sums' bytes per element


def nodes_and_local(world_size, gpus_per_node):
    """(N nodes, G ranks per node) of a world: a partial node counts as one node of W."""
    g = min(gpus_per_node, world_size)
    return world_size // g, g


def ring_phases(nbytes, world_size, gpus_per_node):
    """One pass of a hierarchical ring over nbytes (an all-gather; DDP's all-reduce is two):
    (intra bytes, inter bytes, intra steps, inter steps) sent per rank."""
    n, g = nodes_and_local(world_size, gpus_per_node)
    return (g - 1) / g * nbytes, (n - 1) / n * nbytes / g, g - 1, n - 1


def all_to_all_split(nbytes, world_size, gpus_per_node):
    """zerort's reduce-scatter of nbytes, an all-to-all: (intra bytes, inter bytes, intra
    steps, inter steps) sent per rank. Every send goes out at once: one step each way."""
    n, g = nodes_and_local(world_size, gpus_per_node)
    return (g - 1) / (n * g) * nbytes, (n * g - g) / (n * g) * nbytes, int(g > 1), int(n > 1)


def two_hop_split(nbytes, world_size, gpus_per_node, element_bytes, inter_bytes):
    """zerort's two-hop reduce-scatter of nbytes: (intra bytes, inter bytes, intra steps, inter steps) per rank."""
    n, g = nodes_and_local(world_size, gpus_per_node)
    return (g - 1) / g * nbytes, (n - 1) / (n * g) * nbytes / element_bytes * inter_bytes, int(g > 1), int(n > 1)


def collectives(numel, world_size, gpus_per_node, stage, param_bytes=2, grad_bytes=2, inter_bytes=None,
                shard_size=None, replica_bytes=4, secondary=None, gather_bytes=None):
    """The collectives of one step per rank: a list of dicts with the collective's name,
    what it moves, the bytes sent per rank within the node and across nodes, and latency
    steps (summed over both phases, for one call). Stage 0 is DDP's ring all-reduce. inter_bytes:
    the two-hop reduce-scatter with partial sums of that size (None: flat). shard_size: hybrid
    sharding's groups, whose sum across groups sends replica_bytes per element (the module's
    text); secondary: stage 3's hpZ groups; gather_bytes: stage 3's all-gathers at that many bytes
    per element (stage3.gather_dtype int8: BLOCKS_8BIT), but hpZ's re-gather, which moves the
    decoded pieces the secondary shards keep (param_bytes)."""
    if shard_size and shard_size < world_size:
        if stage == 0 or inter_bytes:
            raise ConfigError(["shard_size: hybrid sharding applies to stages 1-3 over a flat group"])
        return (collectives(numel, shard_size, gpus_per_node, stage, param_bytes, grad_bytes, secondary=secondary,
                            gather_bytes=gather_bytes)
                + replica_sum(numel, world_size, gpus_per_node, shard_size, replica_bytes))
    psi = float(numel)
    if stage == 0:
        plan = [("all-reduce", "gradients", grad_bytes, 2)]
    elif stage in (1, 2):
        plan = [("reduce-scatter", "gradients", grad_bytes, 1), ("all-gather", "parameters", param_bytes, 1)]
    elif stage == 3:
        gathered = gather_bytes or param_bytes
        plan = [("all-gather", "parameters (forward)", gathered, 1),
                ("all-gather", "parameters (backward)", gathered, 1),
                ("reduce-scatter", "gradients", grad_bytes, 1)]
        if secondary:  # the backward's re-gather from the secondary shards, within their group
            plan[1] = ("all-gather", "parameters (bwd, hpZ)", param_bytes, 1)
    else:
        raise ConfigError(f"stage: got {stage!r}; allowed: 0, 1, 2, 3")
    out = []
    for name, what, b, passes in plan:  # an all-reduce (DDP's) is two ring passes
        if name == "reduce-scatter" and inter_bytes:
            intra, inter, s_intra, s_inter = two_hop_split(psi * b, world_size, gpus_per_node, b, inter_bytes)
        elif "hpZ" in what:
            intra, inter, s_intra, s_inter = ring_phases(psi * b, secondary, gpus_per_node)
        else:
            split = all_to_all_split if name == "reduce-scatter" else ring_phases
            intra, inter, s_intra, s_inter = split(psi * b, world_size, gpus_per_node)
        out.append({"collective": name, "moves": what, "intra_bytes": passes * intra, "inter_bytes": passes * inter,
                    "intra_steps": passes * s_intra, "inter_steps": passes * s_inter})
    return out


def replica_sum(numel, world_size, gpus_per_node, shard_size, wire_bytes):
    """Hybrid sharding's sum of the FP32 gradient shards across the groups: its two collectives
    (the module's text)."""
    groups, piece = world_size // shard_size, float(numel) / world_size  # elements per piece of a shard
    near = max(0, min(gpus_per_node, world_size) // shard_size - 1) if shard_size < gpus_per_node else 0
    far = groups - 1 - near  # the other groups' ranks of this index on other nodes
    return [{"collective": name, "moves": what, "intra_bytes": near * piece * b, "inter_bytes": far * piece * b,
             "intra_steps": int(near > 0), "inter_steps": int(far > 0)}
            for name, what, b in (("all-to-all", "shards across groups", wire_bytes),
                                  ("all-gather", "summed shards", wire_bytes))]


def flat_ring_split(nbytes, world_size, gpus_per_node):
    """A ring all-gather of nbytes over every rank in rank order (gloo's flat all-gather): per
    rank on average (intra bytes, inter bytes, intra steps, inter steps). Each of the W - 1
    steps waits for its slowest hop, one across nodes when there are several."""
    n, g = nodes_and_local(world_size, gpus_per_node)
    w = n * g
    sent = (w - 1) / w * nbytes
    return (g - 1) / g * sent, sent / g if n > 1 else 0.0, 0 if n > 1 else w - 1, w - 1 if n > 1 else 0


@dataclasses.dataclass(frozen=True)
class LinkRates:
    """What one rank moves per second within its node and across nodes while every rank of the
    job sends at once, and one small round's seconds on each (zerort.comm.probe measures them)."""
    intra_bytes_per_s: float
    intra_latency_s: float
    inter_bytes_per_s: float
    inter_latency_s: float


def predict_seconds(pattern, payload_bytes, bucket_bytes, world_size, gpus_per_node, rates, inter_dtype="fp32",
                    element_bytes=2, gather="ring"):
    """Seconds of the collectives that carry payload_bytes of low-precision gradients (elements
    of element_bytes) in buckets of bucket_bytes: per bucket its reduce-scatter and its
    parameters' all-gather, each intra bytes / intra rate + inter bytes / inter rate + steps x
    latency, the phases one after another. pattern: "flat" (an all-to-all, then gather's
    all-gather: "ring", gloo's, or "direct", MPI's exchange) or "two_hop" (Note [two hops]: the
    partial sums between the hops in inter_dtype, and the all-gather across nodes, then within)."""
    r = rates
    phases = bucket_phases(pattern, bucket_bytes, world_size, gpus_per_node, inter_dtype, element_bytes, gather)
    per_bucket = sum(intra / r.intra_bytes_per_s + inter / r.inter_bytes_per_s + s_intra * r.intra_latency_s
                     + s_inter * r.inter_latency_s for intra, inter, s_intra, s_inter in phases)
    return payload_bytes / bucket_bytes * per_bucket


def bucket_phases(pattern, bucket_bytes, world_size, gpus_per_node, inter_dtype="fp32", element_bytes=2,
                  gather="ring"):
    """One bucket's reduce-scatter and all-gather in pattern (See predict_seconds): their
    (intra bytes, inter bytes, intra steps, inter steps) per rank."""
    if pattern == "flat":
        gather_split = {"ring": flat_ring_split, "direct": all_to_all_split}[gather]
        return [all_to_all_split(bucket_bytes, world_size, gpus_per_node),
                gather_split(bucket_bytes, world_size, gpus_per_node)]
    if pattern == "two_hop":
        return [two_hop_split(bucket_bytes, world_size, gpus_per_node, element_bytes, WIRE_BYTES[inter_dtype]),
                ring_phases(bucket_bytes, world_size, gpus_per_node)]
    raise ConfigError(f"comm.topology: no prediction for {pattern!r}; allowed: 'flat', 'two_hop'")


def step_seconds(numel, stage, world_size, gpus_per_node, rates, calls=1, **layout):
    """Seconds of one step's collectives over numel elements at rates, as collectives() counts
    them (layout: its keyword arguments, e.g. shard_size and replica_bytes): each collective's
    intra bytes / intra rate + inter bytes / inter rate, one after another, and its latency
    steps `calls` times (the buckets of a step; hybrid sharding's sum across groups runs per
    bucket too, C++ Note [hybrid sharding])."""
    r = rates
    return sum(c["intra_bytes"] / r.intra_bytes_per_s + c["inter_bytes"] / r.inter_bytes_per_s
               + calls * (c["intra_steps"] * r.intra_latency_s + c["inter_steps"] * r.inter_latency_s)
               for c in collectives(numel, world_size, gpus_per_node, stage, **layout))
