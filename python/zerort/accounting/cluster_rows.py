"""The planner's multi-node rows (python -m zerort.accounting.planner --cluster PRESET, or
--multi-node-rows): stage 3 in bf16 with each multi-node feature of zerort, per rank and per step,
the bytes sent across nodes and within, and the network time at the cluster's links, beside
ZeRO++'s published reduction.

    python -m zerort.accounting.planner --params 70e9 --gpus 1024 --cluster gpu-400g

Presets (--cluster; a flag given explicitly wins over the preset's value):
    gpu-400g       8 GPUs per node, a 400 Gbit/s network port per GPU (50 GB/s each way, as
                   in nodes with one NIC per GPU), NVLink at 900 GB/s per GPU (NVIDIA's figure,
                   both directions together: 450 GB/s each way)
    gpu-400g-node  the same nodes with 400 Gbit/s for the whole node (6.25 GB/s per GPU each way)

Rows (W = N nodes x G GPUs, Psi parameters, 2-byte bf16 elements, zerort.accounting.traffic):
    ZeRO-3 rings   the baseline ZeRO++ counts against: the forward and backward all-gathers and
                   the reduce-scatter each a hierarchical ring, (N-1)/N * 2 Psi / G across nodes
    flat           zerort's flat stage 3: the rings' all-gathers, and the reduce-scatter as the
                   all-to-all zerort runs, (W-G)/W * 2 Psi across nodes
    two_hop bf16   comm.topology two_hop, bf16 partial sums between the hops: (N-1)/W * 2 Psi
    hybrid int8    shard_size "node": everything within the node but the sum across the N groups,
                   2 (N-1) pieces of Psi / W elements on the int8 wire (1 + 4/256 bytes each)
    hpZ            stage3.secondary_shard_size "node" with two_hop bf16: the backward's re-gather
                   stays within the node
    ZeRO++'s three stage3.gather_dtype int8 (qwZ), hpZ, two_hop int8 gradients (qgZ; int8 here,
                   int4 in ZeRO++)

ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", arXiv:2306.10209, 2023) reports that its three techniques together cut ZeRO-3's
cross-node communication 4x, from 3M to 0.75M per step (M: the model's bf16/fp16 bytes; qwZ
halves the forward all-gather to 0.5M, hpZ removes the backward all-gather's cross-node 1M, qgZ
sends the gradients in int4: 0.25M), and up to 2.16x throughput at 384 GPUs. Each row's
"x fewer" is the ZeRO-3 rings' cross-node bytes over the row's, the measure that 4x is.
"""
from zerort.accounting.memory import BYTES, estimate_memory
from zerort.accounting.traffic import BLOCKS_8BIT, WIRE_BYTES, collectives, nodes_and_local, ring_phases

GB = 1e9
PRESETS = {
    "gpu-400g": {"gpus_per_node": 8, "intra_bw": 450.0, "inter_bw": 400 / 8},
    "gpu-400g-node": {"gpus_per_node": 8, "intra_bw": 450.0, "inter_bw": 400 / 8 / 8},
}
DEFAULTS = {"gpus_per_node": 8, "intra_bw": 300.0, "inter_bw": 25.0}  # the planner's own, without a preset
ZERO_PP = {"reduction": 4.0, "zero3_m": 3.0, "zeropp_m": 0.75, "throughput": 2.16, "gpus": 384,
           "source": "Wang et al., ZeRO++, arXiv:2306.10209 (2023)"}
# The published x fewer of the rows with a ZeRO++ counterpart, in its counting: hpZ alone takes the
# backward all-gather's M off the 3M (3M / 2M), the three together 3M / 0.75M.
PUBLISHED = {"ZeRO-3 rings": 1.0, "hpZ": 1.5, "ZeRO++'s three": 4.0}
# name: (what it sets, traffic.collectives keyword arguments besides the world and stage)
ROWS = {
    "flat": ("comm.topology flat", {}),
    "two_hop bf16": ("comm.topology two_hop, inter_node_dtype bf16", {"inter_bytes": WIRE_BYTES["bf16"]}),
    "hybrid int8": ("shard_size node, inter_node_dtype int8", {"shard_size": "node",
                                                               "replica_bytes": WIRE_BYTES["int8"]}),
    "hpZ": ("secondary_shard_size node, two_hop bf16", {"secondary": "node", "inter_bytes": WIRE_BYTES["bf16"]}),
    "ZeRO++'s three": ("gather_dtype int8, hpZ node, two_hop int8",
                       {"gather_bytes": BLOCKS_8BIT, "secondary": "node", "inter_bytes": WIRE_BYTES["int8"]}),
}


def apply_preset(args):
    """Fills the link flags left out (None) from --cluster's preset, else the planner's defaults."""
    preset = PRESETS.get(args.cluster, {})
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))


def baseline(numel, world_size, gpus_per_node, elem_bytes):
    """ZeRO-3 as ZeRO++ counts it: three hierarchical rings of Psi elements each."""
    intra, inter, _, _ = ring_phases(numel * elem_bytes, world_size, gpus_per_node)
    return [{"collective": name, "moves": what, "intra_bytes": intra, "inter_bytes": inter}
            for name, what in (("all-gather", "parameters (forward)"), ("all-gather", "parameters (backward)"),
                               ("reduce-scatter", "gradients (ring)"))]


def rows(numel, cluster, precision="bf16"):
    """Each row: name, what it sets, bytes per rank across nodes and within, the network time (each
    byte at full link rate: intra / intra rate + inter / inter rate), the cross-node part of it,
    x fewer cross-node bytes than the ZeRO-3 rings, and the model states per rank
    (zerort.estimate_memory: hybrid groups of a node hold 16 Psi / G, hpZ adds 2 Psi / G)."""
    w, g = cluster.gpus, cluster.gpus_per_node
    b = BYTES[precision]
    node = nodes_and_local(w, g)[1]
    out = []
    for name, (sets, extra) in [("ZeRO-3 rings", ("ZeRO++'s baseline", None))] + list(ROWS.items()):
        if extra is None:
            colls = baseline(numel, w, g, b)
        else:
            kw = {k: node if v == "node" else v for k, v in extra.items()}
            if kw.get("shard_size") == w:
                kw.pop("shard_size")
            colls = collectives(numel, w, g, 3, b, b, **kw)
        inter = sum(c["inter_bytes"] for c in colls)
        intra = sum(c["intra_bytes"] for c in colls)
        t_inter = inter / (cluster.inter_bw_gbs * GB)
        groups = {} if extra is None else {"shard_size": kw.get("shard_size"), "secondary": kw.get("secondary") or 1}
        states = estimate_memory(numel, w, 3, precision, **groups)["exact"]["total"]
        out.append({"row": name, "sets": sets, "inter_bytes": inter, "intra_bytes": intra, "model_states": states,
                    "network_s": intra / (cluster.intra_bw_gbs * GB) + t_inter, "inter_s": t_inter,
                    "collectives": colls})
    base = out[0]["inter_bytes"]
    for r in out:
        r["x_fewer_than_zero3"] = base / r["inter_bytes"] if r["inter_bytes"] else None
        r["zero_pp_published"] = PUBLISHED.get(r["row"])
    return out


def render(table, cluster):
    n, g = nodes_and_local(cluster.gpus, cluster.gpus_per_node)
    lines = ["", "", f"multi-node rows: stage 3, per rank per step, W={cluster.gpus} ({n} nodes x {g} GPUs), "
             f"inter {cluster.inter_bw_gbs:g} GB/s per GPU, intra {cluster.intra_bw_gbs:g} GB/s (each way)",
             f"{'row':<15s} {'sets':<45s} {'across GB':>9s} {'within GB':>9s} {'network s':>9s} {'across s':>8s} "
             f"{'x fewer':>7s} {'ZeRO++':>6s} {'states GB':>9s}"]
    for r in table:
        x = "n/a" if r["x_fewer_than_zero3"] is None else f"{r['x_fewer_than_zero3']:.2f}"
        pub = "" if r["zero_pp_published"] is None else f"{r['zero_pp_published']:.2f}"
        lines.append(f"{r['row']:<15s} {r['sets']:<45s} {r['inter_bytes'] / GB:9.2f} {r['intra_bytes'] / GB:9.2f} "
                     f"{r['network_s']:9.2f} {r['inter_s']:8.2f} {x:>7s} {pub:>6s} {r['model_states'] / GB:9.1f}")
    z = ZERO_PP
    lines.append(f"published: ZeRO++ cuts ZeRO-3's cross-node bytes {z['reduction']:g}x ({z['zero3_m']:g}M -> "
                 f"{z['zeropp_m']:g}M per step; int4 gradients) and reports up to {z['throughput']:g}x throughput at "
                 f"{z['gpus']} GPUs ({z['source']}); 'x fewer' is the same measure, cross-node bytes against\n"
                 "ZeRO-3's rings; the ZeRO++ column is the paper's figure for the same features (int8 gradients "
                 "here where ZeRO++ sends int4)")
    return "\n".join(lines)
