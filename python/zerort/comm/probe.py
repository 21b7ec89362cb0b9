"""comm.topology "auto" decided by measurement. Where the ranks form N > 1 nodes of G > 1 ranks,
zerort.comm.topology builds the two parts of the flat communicator (within the node, across
nodes among the ranks of one local index) and the two-hop communicator over them, and this
module times them, every rank at once, as training runs them:

- a small round (an all_to_all of one float per peer): the latency of each part;
- an all_to_all of about 1 MiB per rank within the node, and across nodes of 2 MiB / G per rank,
  so the node's link carries 1 to 2 MiB each way per round whatever G is: the bytes one rank
  sends per second while its node's G ranks send together;
- a 1 MiB bf16 bucket's reduce-scatter and all-gather on the flat and on the two-hop
  communicator: what each pattern costs beyond what its bytes and steps predict at those rates
  (its hops one after another, the sums and casts between them, the transport's own ways), and
  the CPU seconds the process spent in it (every thread's: the transport's, the hops' workers).

Each is the fastest of a few rounds (SMALL_REPS, PROBE_REPS, PATTERN_REPS), the slowest rank's
(an all-reduce of the maxima over the flat communicator). In all a rank sends under 10 MiB; at
100 Mbit/s between two nodes the probe takes under a second. zerort.accounting.traffic.
predict_seconds then predicts, from the rates, the seconds of the gradient reduce-scatter and
parameter all-gather per PAYLOAD_BYTES of gradients in reduce_bucket_numel buckets, for the flat
pattern and for two-hop at comm.inter_node_dtype, and adds each pattern's measured cost beyond
its prediction at the 1 MiB bucket, per byte, and its CPU seconds, per byte: the host backends
(the only ones with two patterns) train on the same cores, whose compute keeps them busy, so a
pattern's CPU second is a second of compute lost. The probe runs on idle cores and cannot see
that contention otherwise: without this term it took two-hop at stage 3 where flat ran 6%
faster (docs/BENCHMARKS.md, issue 44). Two-hop is taken only where its prediction is below
flat's by MARGIN: on two hosts of 2 ranks at 1 Gbit/s, 300 Mbit/s and 100 Mbit/s the
probe predicted two-hop up to 17% faster while flat trained 6-25% faster at fp32 between the
hops (two-hop's scratch, its sums between the hops and its workers share the cores with
backward, which a probe on idle cores does not see). The margin is that model error, measured;
where two-hop pays, with many ranks a node, its prediction is below flat's by far more (2 nodes
of 8: a quarter of flat's bytes across for the reduce-scatter). Rank 0 decides and broadcasts
its choice over the flat communicator, so every rank makes the same one, and its banner says
what was measured (Decision.line).

auto chooses between the flat and the two-hop patterns. Hybrid sharding changes what each rank
holds (the state sharded within a node, replicated across nodes: more memory per rank), which a
job sized for the state sharded over the world may not have, so auto considers it only where the
config allows it with shard_size "auto" (hybrid_stage: the job's stage). Then the whole step's
collectives are predicted at the measured rates (traffic.step_seconds: stage 3 gathers the
parameters twice) for the state sharded over the world in the chosen pattern and for node groups
(over the flat pattern, the shards summed across the nodes at inter_node_dtype), and node groups
are taken where the first exceeds their prediction by MARGIN. On two hosts of 2 ranks at
1 Gbit/s with bf16 across (docs/BENCHMARKS.md, issue 44) node groups ran stage 3 at 1.48x the
state sharded over the world, and stage 2 at the same speed (CPU-bound there; their prediction
was 1.4x). A pinned comm.topology (flat or two_hop) runs no probe.
"""
import dataclasses
import time

import torch

from zerort.accounting import traffic

PROBE_REPS = 2             # rounds of the large all_to_all on each part
SMALL_REPS = 5             # rounds of the small one
PATTERN_REPS = 2           # rounds of a bucket's reduce-scatter and all-gather, flat and two-hop
PATTERN_BYTES = 1 << 20    # that bucket's bf16 gradients
INTRA_BYTES = 1 << 20      # per rank, each round within the node
LINK_BYTES = 2 << 20       # across nodes: per round, all G ranks' all_to_all inputs together
MIN_INTER_BYTES = 64 << 10
PAYLOAD_BYTES = 1 << 30    # the prediction is per GiB of low-precision gradients
BUCKET_NUMEL = 1 << 24     # the bucket predicted when comm.init is given none (config reduce_bucket_numel's default)
PATTERNS = ("flat", "two_hop")
MARGIN = 1.25              # two-hop or node groups: only where the default's prediction exceeds theirs by this


@dataclasses.dataclass(frozen=True)
class Decision:
    """What auto measured and chose; the same on every rank."""
    topology: str            # "flat" or "two_hop"
    rates: traffic.LinkRates
    predicted_s: dict        # pattern -> predicted seconds per PAYLOAD_BYTES of gradients
    cpu_s: dict              # pattern -> the slowest rank's CPU seconds per PAYLOAD_BYTES (in predicted_s)
    probe_s: float           # this rank's seconds in the probe, the final all-reduce and broadcast included
    probe_bytes: int         # bytes this rank's all_to_all calls sent to other ranks
    node_groups: bool = False  # shard_size auto: the state sharded within each node (shard_size "node")
    layout_s: dict = None    # shard_size auto: "world", "node" -> a step's collectives' seconds per GiB of gradients

    def line(self):
        """The banner's line (rank 0, zerort.monitoring.progress.announce)."""
        r, other = self.rates, PATTERNS[1 - PATTERNS.index(self.topology)]
        why = " for node groups" if self.node_groups else ""  # they run over flat whatever the patterns' predictions
        text = (f"comm.topology auto -> {self.topology}{why} (within nodes {_rate(r.intra_bytes_per_s)}, "
                f"{r.intra_latency_s * 1e6:.0f} us; across {_rate(r.inter_bytes_per_s)}, "
                f"{r.inter_latency_s * 1e6:.0f} us; predicted {self.predicted_s[self.topology]:.2f} s vs {other} "
                f"{self.predicted_s[other]:.2f} s per GiB of gradients, CPU {self.cpu_s[self.topology]:.2f} s vs "
                f"{self.cpu_s[other]:.2f} s of it; probe {self.probe_s:.2f} s)")
        if self.layout_s is None:
            return text
        chosen, other = ("node", "world") if self.node_groups else ("world", "node")
        return (f"{text}; shard_size auto -> {'node' if self.node_groups else 'the world'} (a step's collectives "
                f"predicted {self.layout_s[chosen]:.2f} s vs {self.layout_s[other]:.2f} s per GiB of gradients)")


def decide(comm, backend, parts, nodes, per_node, inter_dtype, bucket_numel, hybrid_stage=None):
    """A collective over the flat Python Communicator comm and parts: its C++ (intra, inter) parts
    (zerort.comm.topology.grid_parts) and the two-hop communicator over them. hybrid_stage: the
    job's stage where shard_size is "auto" (node groups allowed), else None. The Decision every
    rank gets."""
    t0 = time.perf_counter()
    intra, inter, hops = parts
    inter_bytes = max(MIN_INTER_BYTES, LINK_BYTES // per_node)
    rounds = [_fastest(intra, intra.size, SMALL_REPS), _fastest(intra, INTRA_BYTES // 4, PROBE_REPS),
              _fastest(inter, inter.size, SMALL_REPS), _fastest(inter, inter_bytes // 4, PROBE_REPS),
              _pattern(comm._c, comm.size, "flat", per_node, inter_dtype),
              _pattern(hops, comm.size, "two_hop", per_node, inter_dtype)]
    times = torch.tensor([r[0] for r in rounds] + [r[2] for r in rounds[4:]], dtype=torch.float64)
    comm.all_reduce(times, "max")  # the slowest rank bounds every collective
    lat_intra, t_intra, lat_inter, t_inter, t_flat, t_hops, cpu_flat, cpu_hops = times.tolist()
    per_round = lambda part, nbytes: (part.size - 1) * (nbytes // 4 // part.size) * 4  # bytes a rank sends
    rates = traffic.LinkRates(per_round(intra, INTRA_BYTES) / t_intra, lat_intra,
                              per_round(inter, inter_bytes) / t_inter, lat_inter)
    shape = dict(world_size=nodes * per_node, gpus_per_node=per_node, rates=rates, inter_dtype=inter_dtype,
                 gather="direct" if backend == "mpi" else "ring")
    predicted, cpu = {}, {}
    for p, measured, cpu_one in zip(PATTERNS, (t_flat, t_hops), (cpu_flat, cpu_hops)):
        beyond = max(0.0, measured - traffic.predict_seconds(p, PATTERN_BYTES, PATTERN_BYTES, **shape))
        cpu[p] = cpu_one * PAYLOAD_BYTES / PATTERN_BYTES
        predicted[p] = (traffic.predict_seconds(p, PAYLOAD_BYTES, 2 * bucket_numel, **shape)  # bf16/fp16 grads
                        + beyond * PAYLOAD_BYTES / PATTERN_BYTES + cpu[p])
    topology = choose(predicted)
    layout_s = None if hybrid_stage is None else layouts(hybrid_stage, topology, bucket_numel, nodes * per_node,
                                                         per_node, rates, inter_dtype)
    node_groups = layout_s is not None and choose_node_groups(layout_s)
    choice = torch.tensor([PATTERNS.index("flat" if node_groups else topology), node_groups], dtype=torch.int64)
    comm.broadcast(choice, 0)  # rank 0's choice is every rank's
    return Decision(PATTERNS[int(choice[0])], rates, predicted, cpu, time.perf_counter() - t0,
                    sum(r[1] for r in rounds), bool(choice[1]), layout_s)


def layouts(stage, topology, bucket_numel, world_size, gpus_per_node, rates, inter_dtype):
    """shard_size auto's two candidates, a step's collectives at rates per PAYLOAD_BYTES of bf16
    gradients (traffic.step_seconds): "world", the state sharded over the world in the topology
    auto chose, and "node", node groups over the flat pattern with the shards summed across the
    nodes at inter_dtype. The all-gathers are counted as hierarchical rings and at the compute
    dtype (traffic.collectives): gloo's flat ring sends more across and stage3.gather_dtype int8
    less, so the world's prediction is low under gloo (erring toward it, the layout of less
    memory) and high with int8 gathers."""
    numel, wire = PAYLOAD_BYTES // 2, traffic.WIRE_BYTES[inter_dtype]
    shape = dict(numel=numel, stage=stage, world_size=world_size, gpus_per_node=gpus_per_node, rates=rates,
                 calls=numel / bucket_numel)
    return {"world": traffic.step_seconds(**shape, inter_bytes=wire if topology == "two_hop" else None),
            "node": traffic.step_seconds(**shape, shard_size=gpus_per_node, replica_bytes=wire)}


def choose(predicted):
    """The pattern auto takes from the predicted seconds of each: two-hop only where flat's
    exceed its own by MARGIN (the module's text says why)."""
    return "two_hop" if predicted["flat"] > MARGIN * predicted["two_hop"] else "flat"


def choose_node_groups(layout_s):
    """Whether shard_size auto takes node groups, from layouts()'s predictions: only where the
    state sharded over the world is predicted slower by MARGIN (they cost memory: the module's text)."""
    return layout_s["world"] > MARGIN * layout_s["node"]


def _fastest(part, numel, reps):
    """(fastest seconds of reps all_to_all rounds of about numel float32 per rank on the C++
    communicator part, the bytes this rank sent in them)."""
    n = max(1, numel // part.size)
    inp = torch.zeros(n * part.size, dtype=torch.float32)
    out = torch.empty_like(inp)
    best = float("inf")
    for _ in range(reps):
        part.barrier()
        t = time.perf_counter()
        part.all_to_all(inp.data_ptr(), out.data_ptr(), n, "f32")
        best = min(best, time.perf_counter() - t)
    return best, reps * (part.size - 1) * n * 4


def _pattern(c, world, pattern, per_node, inter_dtype):
    """(fastest seconds of PATTERN_REPS rounds of a PATTERN_BYTES bf16 gradient bucket's
    reduce-scatter and all-gather on the C++ communicator c, flat or two-hop as pattern says,
    the bytes this rank sent in them, as zerort.accounting.traffic counts them, the process's
    CPU seconds in the round of fewest)."""
    n = PATTERN_BYTES // 2 // world
    grads, shard = torch.zeros(n * world, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.float32)
    params, full = torch.zeros(n, dtype=torch.bfloat16), torch.empty(n * world, dtype=torch.bfloat16)
    best = cpu = float("inf")
    for _ in range(PATTERN_REPS):
        c.barrier()
        t, p = time.perf_counter(), time.process_time()
        c.reduce_scatter_accumulate(grads.data_ptr(), "bf16", shard.data_ptr(), n, False)
        c.all_gather(params.data_ptr(), full.data_ptr(), n, "bf16")
        best, cpu = min(best, time.perf_counter() - t), min(cpu, time.process_time() - p)
    phases = traffic.bucket_phases(pattern, PATTERN_BYTES, world, per_node, inter_dtype)
    return best, PATTERN_REPS * int(sum(intra + inter for intra, inter, _, _ in phases)), cpu


def _rate(bytes_per_s):
    return f"{bytes_per_s / 1e9:.1f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.0f} MB/s"
