"""Plan a run larger than this machine: memory, traffic and time per rank, before renting.

    python -m zerort.accounting.planner --params 70e9 --seq 4096 --gpus 1024 --gpus-per-node 8 --gpu-mem 80
    python -m zerort.accounting.planner --layers 80 --hidden 8192 --heads 64 --vocab 32000 --seq 4096 \\
        --micro-batch 1 --gpus 1024 --gpus-per-node 8 --gpu-mem 80 --stage 3 --json

Per rank and per optimizer step (one micro-batch per step), for each ZeRO stage:
- model-state memory: zerort.accounting.memory's exact estimate of our layout (the ZeRO paper's
  formula beside it);
- activation memory (GPT shape only), with and without activation checkpointing;
- bytes each collective sends per rank, within the node and across nodes;
- a lower bound on communication time, a compute time from the FLOPs at the peak rate
  given, and whether the configuration fits in GPU memory.
Then the smallest world size that fits at each stage, and the smallest stage at --gpus.

Collective algorithms (data parallelism only, W = N nodes x G GPUs per node), as zerort runs
them. A reduce-scatter is zerort's reduce_scatter_accumulate, an all-to-all on every backend:
(G-1)/W of its S bytes stay within the node and (W-G)/W cross nodes, all sent at once (one
latency step each way; tests/python/test_two_hosts.py measures the split on two hosts). With
--topology two_hop (Note [two hops], comm/two_hop_communicator.h) it goes within the node first
((G-1)/G*S, one step), then across nodes among the ranks of one local index ((N-1)/W of the
elements, in --inter-node-dtype, one step). An all-gather is a hierarchical ring, as NCCL runs
it (and zerort's two_hop, across nodes first): (G-1)/G*S within the node in G-1 steps, and
(N-1)/N*S/G across in N-1 (zerort's flat all-gather over MPI is a direct exchange, over gloo a
flat ring: the same totals, (W-1)/W*S). All G ranks of a node cross nodes at once, each at
--inter-bw (the per-GPU share of the node's network bandwidth).

Per step, with Ψ parameters and b_p, b_g bytes per parameter and gradient element on the wire
(bf16: 2 and 2), flat: stage 0 (DDP's all-reduce) 2(W-1)/W*Ψ*b_g; stages 1 and 2 (reduce-scatter,
all-gather) (W-1)/W*Ψ*(b_g + b_p); stage 3 (two all-gathers, a reduce-scatter) (W-1)/W*Ψ*(2b_p + b_g).
zerort's own stage 0 all-gathers the FP32 sum (4 bytes) after a bf16 reduce-scatter: (W-1)/W*Ψ*(2 + 4);
the table gives the DDP form.
"""
import argparse
import dataclasses
import json
import math
import sys

from zerort.config import Config
from zerort.accounting import cluster_rows
from zerort.accounting.memory import BYTES, estimate_memory, gpt_numel
from zerort.accounting.traffic import WIRE_BYTES, collectives, nodes_and_local  # noqa: F401  (tests use these)
from zerort.errors import ConfigError

GB = 1e9
BUCKET = Config().reduce_bucket_numel


@dataclasses.dataclass
class Shape:
    """A GPT-2-style model (examples/gpt.py): blocks of attention + 4h MLP, tied head."""
    layers: int
    hidden: int
    heads: int
    vocab: int

    def numel(self, seq):
        return gpt_numel(self.layers, self.hidden, self.vocab, seq)

    @property
    def block_numel(self):
        return 12 * self.hidden * self.hidden + 13 * self.hidden


@dataclasses.dataclass
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu_mem_gb: float = 80.0
    intra_bw_gbs: float = 300.0     # per GPU, one direction (NVLink class)
    inter_bw_gbs: float = 25.0      # per GPU, one direction (200 Gb/s per GPU)
    intra_lat_us: float = 5.0
    inter_lat_us: float = 10.0
    peak_tflops: float = 312.0      # dense bf16 per GPU
    reserve_gb: float = 2.0         # CUDA context, workspaces, allocator fragmentation

    def check(self):
        problems = []
        if self.gpus < 1:
            problems.append(f"--gpus: got {self.gpus}; it must be >= 1")
        if self.gpus_per_node < 1:
            problems.append(f"--gpus-per-node: got {self.gpus_per_node}; it must be >= 1")
        elif self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            problems.append(f"--gpus: got {self.gpus}, not a multiple of --gpus-per-node {self.gpus_per_node}; "
                            "use whole nodes (or fewer GPUs than one node)")
        for name in ("gpu_mem_gb", "intra_bw_gbs", "inter_bw_gbs", "peak_tflops"):
            if not getattr(self, name) > 0:
                problems.append(f"--{_flag(name)}: got {getattr(self, name)}; it must be > 0")
        for name in ("intra_lat_us", "inter_lat_us", "reserve_gb"):
            if getattr(self, name) < 0:
                problems.append(f"--{_flag(name)}: got {getattr(self, name)}; it must be >= 0")
        if problems:
            raise ConfigError(["zerort.accounting.planner: " + p for p in problems])


def _flag(field):
    return {"gpu_mem_gb": "gpu-mem", "intra_bw_gbs": "intra-bw", "inter_bw_gbs": "inter-bw",
            "intra_lat_us": "intra-lat", "inter_lat_us": "inter-lat", "peak_tflops": "peak-tflops",
            "reserve_gb": "reserve"}[field]


def activation_bytes(shape, seq, micro_batch, checkpointing):
    """Bytes saved for backward per rank, with 2-byte activations and fused (flash)
    attention, which keeps no seq x seq tensor. Per token of a block: LayerNorm inputs and
    outputs 2h each (x2), q/k/v 6h, attention output 2h, MLP input 8h and GELU output 8h:
    32h, plus the attention's FP32 log-sum-exp (4 bytes per head) and the LayerNorms'
    mean and 1/std (8 bytes). Outside the blocks: the final LayerNorm's input and output
    (4h), the FP32 log-softmax of the logits (4V) and the int64 inputs and targets (16).
    With checkpointing (one checkpoint per block) each block keeps only its input (2h) and
    one block at a time is recomputed in backward. Gradients of activations and kernel
    workspaces are not counted."""
    h, tokens = shape.hidden, seq * micro_batch
    block = 32 * h + 4 * shape.heads + 8
    outside = 4 * h + 4 * shape.vocab + 16
    if checkpointing:
        return tokens * (shape.layers * 2 * h + block + outside)
    return tokens * (shape.layers * block + outside)


def flops_per_token(numel, shape, seq, checkpointing):
    """Training FLOPs per token: forward + backward (2x forward), plus one more forward
    with checkpointing. Forward of a GPT: 2 FLOPs per weight of every matmul (blocks 24h^2,
    head 2Vh) and 4*seq*h per block for attention (q.k and a.v, the full square counted);
    for a bare parameter count, 2 per parameter."""
    if shape is None:
        forward = 2.0 * numel
    else:
        h = shape.hidden
        forward = shape.layers * (24.0 * h * h + 4.0 * seq * h) + 2.0 * shape.vocab * h
    return forward * (4 if checkpointing else 3)


def comm_time(colls, cluster, calls):
    """(bandwidth seconds, latency seconds) per step. Bandwidth: every byte at full link
    bandwidth, no contention, collectives back to back: a lower bound for any algorithm
    that sends these bytes. Latency: one alpha per step of every call (zerort's call count;
    larger buckets mean fewer calls)."""
    bw = lat = 0.0
    for c in colls:
        bw += c["intra_bytes"] / (cluster.intra_bw_gbs * GB) + c["inter_bytes"] / (cluster.inter_bw_gbs * GB)
        lat += calls * (c["intra_steps"] * cluster.intra_lat_us + c["inter_steps"] * cluster.inter_lat_us) * 1e-6
    return bw, lat


def calls_per_collective(numel, stage, shape, bucket_numel):
    """How many calls each collective takes in zerort: one per reduce bucket (stages 0-2)
    or per unit (stage 3: one per block of a GPT shape, else numel/32 per unit)."""
    if stage < 3:
        return math.ceil(numel / bucket_numel)
    unit = shape.block_numel if shape is not None else max(1, numel // 32)
    return math.ceil(numel / unit)


@dataclasses.dataclass
class Groups:
    """How the ranks share the state: hybrid sharding's groups (shard_size; None: the world,
    flat), the sum across them on a wire of replica_bytes per element, and stage 3's hpZ
    groups (secondary; None: off). See zerort.accounting.traffic."""
    shard_size: int = None
    replica_bytes: float = 4
    secondary: int = None

    def hybrid(self, stage, world_size):
        """The groups' size where they shard less than the world (stages 1-3), else None."""
        return self.shard_size if stage > 0 and self.shard_size and self.shard_size < world_size else None

    def hpz(self, stage):
        """hpZ's groups' size at stage 3, else None."""
        return self.secondary if stage == 3 and self.secondary else None


def model_states(numel, world_size, stage, precision, shape, bucket_numel, groups=Groups()):
    unit = shape.block_numel if shape is not None else None
    return estimate_memory(numel, world_size, stage, precision, reduce_bucket_numel=bucket_numel, unit_numel=unit,
                           shard_size=groups.hybrid(stage, world_size), secondary=groups.hpz(stage) or 1)


def plan_stage(numel, shape, seq, micro_batch, cluster, stage, precision="bf16", world_size=None,
               bucket_numel=BUCKET, inter_bytes=None, groups=Groups()):
    """Everything for one stage at world_size (default cluster.gpus), per rank, in bytes,
    FLOPs and seconds."""
    w = world_size or cluster.gpus
    b = BYTES[precision]
    est = model_states(numel, w, stage, precision, shape, bucket_numel, groups)
    hybrid = groups.hybrid(stage, w)
    colls = collectives(numel, w, cluster.gpus_per_node, stage, b, b, None if hybrid else inter_bytes, hybrid,
                        groups.replica_bytes, groups.hpz(stage))
    calls = calls_per_collective(numel, stage, shape, bucket_numel)
    tokens = seq * micro_batch
    budget = (cluster.gpu_mem_gb - cluster.reserve_gb) * GB
    states = est["exact"]["total"]
    act = {ck: activation_bytes(shape, seq, micro_batch, ck) if shape is not None else None for ck in (False, True)}
    fits = {ck: states + (act[ck] or 0) <= budget for ck in (False, True)}
    compute = {ck: tokens * flops_per_token(numel, shape, seq, ck) / (cluster.peak_tflops * 1e12)
               for ck in (False, True)}
    t_bw, t_lat = comm_time(colls, cluster, calls)
    return {"stage": stage, "world_size": w, "nodes": nodes_and_local(w, cluster.gpus_per_node)[0],
            "model_states": states, "model_states_paper": est["paper"]["total"],
            "activations": act[False], "activations_ckpt": act[True], "budget": budget,
            "fits": fits[False], "fits_ckpt": fits[True], "collectives": colls, "calls_per_collective": calls,
            "wire_bytes": sum(c["intra_bytes"] + c["inter_bytes"] for c in colls),
            "comm_bw_s": t_bw, "latency_s": t_lat, "compute_s": compute[False], "compute_ckpt_s": compute[True],
            "tokens_per_rank": tokens}


def smallest_world(numel, shape, seq, micro_batch, cluster, stage, precision, checkpointing, bucket_numel=BUCKET,
                   limit=1 << 20):
    """The smallest W (1..G, then whole nodes) at which this stage fits, or None. Assumes
    memory does not grow with W (it does not, except for padding of a few elements)."""
    g = cluster.gpus_per_node
    key = "fits_ckpt" if checkpointing else "fits"

    def fits(w):
        return plan_stage(numel, shape, seq, micro_batch, cluster, stage, precision, w, bucket_numel)[key]

    for w in sorted({w for w in (1, 2, 4) if w < g} | {g}):
        if fits(w):
            return w
    lo, hi = 1, limit // g  # in nodes: fits(hi * g) or none
    if not fits(hi * g):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid * g) else (mid, hi)
    return hi * g


def plan(numel, shape, seq, micro_batch, cluster, stages=(0, 1, 2, 3), precision="bf16", bucket_numel=BUCKET,
         inter_bytes=None, groups=Groups()):
    cluster.check()
    rows = [plan_stage(numel, shape, seq, micro_batch, cluster, s, precision, None, bucket_numel, inter_bytes, groups)
            for s in stages]
    smallest = {s: {ck: smallest_world(numel, shape, seq, micro_batch, cluster, s, precision, ck == "ckpt",
                                       bucket_numel) for ck in ("no_ckpt", "ckpt")} for s in stages}
    first = next(((r["stage"], r["fits"]) for r in rows if r["fits"] or r["fits_ckpt"]), None)
    return {"numel": int(numel), "shape": dataclasses.asdict(shape) if shape else None, "seq": seq,
            "micro_batch": micro_batch, "precision": precision, "reduce_bucket_numel": bucket_numel,
            "topology": "two_hop" if inter_bytes else "flat", "inter_bytes": inter_bytes,
            "groups": dataclasses.asdict(groups),
            "cluster": dataclasses.asdict(cluster),
            "stages": rows, "smallest_world": smallest,
            "smallest_stage": None if first is None else {"stage": first[0], "checkpointing": not first[1]}}


def _gb(x):
    return "n/a" if x is None else f"{x / GB:.2f}"


def render(p):
    c = Cluster(**p["cluster"])
    n, g = nodes_and_local(c.gpus, c.gpus_per_node)
    s = p["shape"]
    what = (f"GPT {s['layers']} layers, h={s['hidden']}, {s['heads']} heads, V={s['vocab']}" if s else "bare count")
    lines = [f"plan: {p['numel']:,} parameters ({p['numel'] / 1e9:.2f}B; {what}), seq {p['seq']} x micro-batch "
             f"{p['micro_batch']} per rank, {p['precision']}",
             f"      W={c.gpus} ({n} nodes x {g} GPUs), {c.gpu_mem_gb:g} GB per GPU ({c.reserve_gb:g} GB reserved), "
             f"intra {c.intra_bw_gbs:g} GB/s {c.intra_lat_us:g} us, inter {c.inter_bw_gbs:g} GB/s per GPU "
             f"{c.inter_lat_us:g} us, peak {c.peak_tflops:g} TFLOP/s, reduce buckets of "
             f"{p['reduce_bucket_numel']:,} elements",
             "", "memory per rank (GB = 1e9 bytes; states = our exact layout, paper = the ZeRO paper's formula)",
             f"{'stage':>5s} {'states':>9s} {'paper':>9s} {'activ.':>9s} {'act.ckpt':>9s} {'total':>9s} "
             f"{'tot.ckpt':>9s}  fits in {(c.gpu_mem_gb - c.reserve_gb):g} GB"]
    for r in p["stages"]:
        tot = None if r["activations"] is None else r["model_states"] + r["activations"]
        tot_ck = None if r["activations"] is None else r["model_states"] + r["activations_ckpt"]
        verdict = ("yes" if r["fits"] else "with checkpointing" if r["fits_ckpt"] else "no")
        if r["activations"] is None:
            verdict += " (model states only: give a GPT shape for activations)"
        lines.append(f"{r['stage']:5d} {_gb(r['model_states']):>9s} {_gb(r['model_states_paper']):>9s} "
                     f"{_gb(r['activations']):>9s} {_gb(r['activations_ckpt']):>9s} {_gb(tot):>9s} {_gb(tot_ck):>9s}"
                     f"  {verdict}")
    rs = f"two hops, partial sums of {p['inter_bytes']} bytes" if p.get("inter_bytes") else "zerort's all-to-all"
    gr = p["groups"]
    if gr["shard_size"] and gr["shard_size"] < c.gpus:
        rs += (f"; hybrid: groups of {gr['shard_size']}, shards summed across groups at {gr['replica_bytes']:g} "
               "bytes per element")
    if gr["secondary"]:
        rs += f"; stage 3's backward all-gather within hpZ groups of {gr['secondary']}"
    lines += ["", f"bytes sent per rank per step (GB; reduce-scatter: {rs};",
              "all-gather and all-reduce: hierarchical rings, within the node, then across nodes)",
              f"{'stage':>5s}  {'collective':<15s} {'moves':<22s} {'intra':>8s} {'inter':>8s} {'calls':>6s}"]
    for r in p["stages"]:
        for col in r["collectives"]:
            lines.append(f"{r['stage']:5d}  {col['collective']:<15s} {col['moves']:<22s} "
                         f"{col['intra_bytes'] / GB:8.2f} {col['inter_bytes'] / GB:8.2f} "
                         f"{r['calls_per_collective']:6d}")
    lines += ["", "time per step per rank (ms): compute at 100% of peak; comm = bytes at full bandwidth (a lower",
              "bound); latency = calls x steps x latency (stages 0-2: one call per reduce bucket)",
              f"{'stage':>5s} {'compute':>9s} {'comp.ckpt':>9s} {'comm':>9s} {'latency':>9s} "
              f"{'step >= (overlap)':>18s} {'step (serial)':>14s}"]
    for r in p["stages"]:
        comp = r["compute_ckpt_s"] if not r["fits"] and r["fits_ckpt"] else r["compute_s"]
        lines.append(f"{r['stage']:5d} {1e3 * r['compute_s']:9.1f} {1e3 * r['compute_ckpt_s']:9.1f} "
                     f"{1e3 * r['comm_bw_s']:9.1f} {1e3 * r['latency_s']:9.1f} {1e3 * max(comp, r['comm_bw_s']):18.1f} "
                     f"{1e3 * (comp + r['comm_bw_s'] + r['latency_s']):14.1f}")
    lines += ["", "(the step columns use the checkpointed compute where the stage fits only with checkpointing)",
              "", "smallest world size that fits (1, 2, 4 or G GPUs, else whole nodes)"]
    for stage, m in p["smallest_world"].items():
        fmt = lambda w: "none" if w is None else f"W={w}"
        lines.append(f"  stage {stage}: {fmt(m['no_ckpt'])} without checkpointing, {fmt(m['ckpt'])} with")
    ss = p["smallest_stage"]
    lines.append(f"smallest stage that fits at W={c.gpus}: " +
                 ("none of the stages listed" if ss is None else
                  f"stage {ss['stage']}" + (" with activation checkpointing" if ss["checkpointing"] else "")))
    return "\n".join(lines)


def _group(ap, flag, value, gpus, gpus_per_node):
    """A group size flag's ranks: 'node' or a positive divisor of --gpus."""
    n = gpus_per_node if value == "node" else int(value) if str(value).isdigit() else 0
    if n < 1 or gpus % n:
        ap.error(f"{flag}: got {value!r}; give 'node' or a number of ranks that divides --gpus {gpus}")
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m zerort.accounting.planner", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, help="parameter count, e.g. 70e9 (no activations without a shape)")
    ap.add_argument("--layers", type=int, help="GPT shape: number of blocks")
    ap.add_argument("--hidden", type=int, help="GPT shape: hidden size h")
    ap.add_argument("--heads", type=int, help="GPT shape: attention heads (default h/128)")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=2048, help="sequence length")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--gpus", type=int, required=True, help="world size W")
    ap.add_argument("--gpus-per-node", type=int, help="default 8, or --cluster's")
    ap.add_argument("--gpu-mem", type=float, default=80.0, help="GB per GPU")
    ap.add_argument("--reserve", type=float, default=2.0, help="GB per GPU not available to the run")
    ap.add_argument("--intra-bw", type=float, help="GB/s per GPU within a node, one direction (default 300)")
    ap.add_argument("--inter-bw", type=float, help="GB/s per GPU across nodes, one direction (default 25)")
    ap.add_argument("--cluster", choices=list(cluster_rows.PRESETS), help="a GPU cluster's links and node size, "
                    "and the multi-node rows (zerort.accounting.cluster_rows)")
    ap.add_argument("--multi-node-rows", action="store_true", help="stage 3 with each multi-node feature")
    ap.add_argument("--intra-lat", type=float, default=5.0, help="us per ring step within a node")
    ap.add_argument("--inter-lat", type=float, default=10.0, help="us per ring step across nodes")
    ap.add_argument("--peak-tflops", type=float, default=312.0, help="dense TFLOP/s per GPU in the compute dtype")
    ap.add_argument("--reduce-bucket-numel", type=int, default=BUCKET, dest="bucket", help="elements per bucket")
    ap.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="one stage (default: all)")
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--topology", choices=["flat", "two_hop"], default="flat", help="the reduce-scatter's pattern")
    ap.add_argument("--inter-node-dtype", choices=list(WIRE_BYTES), default="fp32",
                    help="two_hop's partial sums' wire, and hybrid sharding's sum across groups")
    ap.add_argument("--shard-size", help="hybrid sharding: the state sharded within groups of this many ranks "
                    "(or 'node': --gpus-per-node), replicated across them (stages 1-3, flat within the group)")
    ap.add_argument("--secondary-shard-size", help="stage 3's hpZ groups (a number, or 'node')")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cluster_rows.apply_preset(a)
    shape = None
    if a.layers or a.hidden:
        if not (a.layers and a.hidden):
            ap.error("a GPT shape needs both --layers and --hidden (and optionally --heads, --vocab)")
        heads = a.heads or max(1, a.hidden // 128)
        if a.hidden % heads:
            ap.error(f"--heads: got {heads}; it must divide --hidden {a.hidden}")
        shape = Shape(a.layers, a.hidden, heads, a.vocab)
        numel = shape.numel(a.seq)
        if a.params:
            ap.error("give --params or a GPT shape (--layers, --hidden), not both")
    elif a.params:
        numel = int(a.params)
    else:
        ap.error("give --params N, or a GPT shape with --layers L --hidden H")
    for flag, v in (("--seq", a.seq), ("--micro-batch", a.micro_batch), ("--reduce-bucket-numel", a.bucket)):
        if v < 1:
            ap.error(f"{flag}: got {v}; it must be >= 1")
    cluster = Cluster(a.gpus, a.gpus_per_node, a.gpu_mem, a.intra_bw, a.inter_bw, a.intra_lat, a.inter_lat,
                      a.peak_tflops, a.reserve)
    size = lambda flag, v: None if v is None else _group(ap, flag, v, a.gpus, a.gpus_per_node)
    groups = Groups(size("--shard-size", a.shard_size), WIRE_BYTES[a.inter_node_dtype],
                    size("--secondary-shard-size", a.secondary_shard_size))
    if groups.shard_size and a.topology == "two_hop":
        ap.error("--shard-size runs flat within the group: drop --topology two_hop")
    try:
        p = plan(numel, shape, a.seq, a.micro_batch, cluster, (0, 1, 2, 3) if a.stage is None else (a.stage,),
                 a.precision, a.bucket,
                 WIRE_BYTES[a.inter_node_dtype] if a.topology == "two_hop" else None, groups)
    except ValueError as e:
        ap.error(str(e))
    if a.cluster or a.multi_node_rows:
        p["multi_node_rows"] = cluster_rows.rows(numel, cluster, a.precision)
    extra = cluster_rows.render(p["multi_node_rows"], cluster) if "multi_node_rows" in p else ""
    print(json.dumps(p, indent=2) if a.json else render(p) + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
