"""The planner (python -m zerort.accounting.planner) against references computed another way.

- Communication: the textbook per-rank volumes of a step, written out here (DDP
  2(W-1)/W*Ψ*b_g; ZeRO-1/2 (W-1)/W*Ψ*(b_g+b_p); ZeRO-3 (W-1)/W*Ψ*(2b_p+b_g)), and the
  intra/inter split against simulations that move real arrays and count the bytes each
  rank sends: zerort's all-to-all reduce-scatter, and the hierarchical ring the
  all-gather is modelled as (test_two_hosts.py measures the all-to-all's split).
- FLOPs: torch.utils.flop_counter.FlopCounterMode on examples/gpt.py's GPT.
- Activations: the bytes autograd saves for backward (saved-tensor hooks) on that GPT.
- Model states: zerort.estimate_memory, which the planner reuses.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerort
from zerort.accounting import planner as plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import GPT  # noqa: E402

WORLDS = [(1, 8), (2, 8), (8, 8), (16, 4), (64, 8), (1024, 8), (12, 1)]  # (W, GPUs per node)
BYTES = [(2, 2), (2, 4), (4, 2)]  # (b_p, b_g): unequal values tell the terms apart


def textbook(psi, w, stage, bp, bg):
    f = (w - 1) / w * psi
    return {0: 2 * f * bg, 1: f * (bg + bp), 2: f * (bg + bp), 3: f * (2 * bp + bg)}[stage]


@pytest.mark.parametrize("w,g", WORLDS)
@pytest.mark.parametrize("bp,bg", BYTES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_volume_equals_closed_form(w, g, bp, bg, stage):
    psi = 70e9
    colls = plan.collectives(psi, w, g, stage, param_bytes=bp, grad_bytes=bg)
    total = sum(c["intra_bytes"] + c["inter_bytes"] for c in colls)
    assert total == pytest.approx(textbook(psi, w, stage, bp, bg), rel=1e-12, abs=1e-6)
    if w <= g:  # one node: nothing crosses nodes
        assert all(c["inter_bytes"] == 0 for c in colls)
    if g == 1:  # one GPU per node: everything crosses nodes
        assert all(c["intra_bytes"] == 0 for c in colls)


def simulated_reduce_scatter(w, g, elements):
    """A hierarchical ring reduce-scatter on real arrays: a ring within each node, then a
    ring across nodes among ranks with the same local index. Returns (intra, inter)
    elements sent by each rank, after checking every rank ends with its piece of the sum."""
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 100, elements).astype(np.int64) for _ in range(w)]
    total = np.sum(data, axis=0)
    bufs = [d.copy() for d in data]
    sent_intra, sent_inter = [0] * w, [0] * w
    nodes = w // g

    def ring(members, lo, hi, sent):
        """Ring reduce-scatter of bufs[m][lo:hi] over members; member i ends owning piece
        (i + 1) % n. Returns {member: (start, end)}."""
        n = len(members)
        edges = np.linspace(lo, hi, n + 1).astype(int)
        for k in range(n - 1):
            msgs = []
            for i, m in enumerate(members):
                c = (i - k) % n
                msgs.append((members[(i + 1) % n], c, bufs[m][edges[c]:edges[c + 1]].copy()))
                sent[m] += edges[c + 1] - edges[c]
            for dst, c, chunk in msgs:
                bufs[dst][edges[c]:edges[c + 1]] += chunk
        return {m: (edges[(i + 1) % n], edges[(i + 1) % n + 1]) for i, m in enumerate(members)}

    owned = {}
    for node in range(nodes):
        owned.update(ring([node * g + i for i in range(g)], 0, elements, sent_intra))
    final = {}
    for local in range(g):
        members = [node * g + local for node in range(nodes)]
        lo, hi = owned[members[0]]  # ranks with one local index own the same node piece
        assert all(owned[m] == (lo, hi) for m in members)
        final.update(ring(members, lo, hi, sent_inter))
    for r, (lo, hi) in final.items():
        assert np.array_equal(bufs[r][lo:hi], total[lo:hi]), r
    return sent_intra, sent_inter


GRIDS = [(8, 4), (12, 4), (6, 2), (4, 4), (5, 1)]
ELEMENTS = 2 * 3 * 4 * 5 * 7 * 8 * 3  # divisible by every piece count used here


@pytest.mark.parametrize("w,g", GRIDS)
def test_all_gather_split_matches_a_simulated_hierarchical_ring(w, g):
    """The all-gather's model: a hierarchical ring (an all-gather runs the reduce-scatter's
    phases in reverse, so it sends the same bytes)."""
    intra, inter = simulated_reduce_scatter(w, g, ELEMENTS)
    bp = 2
    (ag,) = [c for c in plan.collectives(ELEMENTS, w, g, 2, param_bytes=bp, grad_bytes=bp)
             if c["collective"] == "all-gather"]
    assert all(x * bp == ag["intra_bytes"] for x in intra), (intra, ag)
    assert all(x * bp == ag["inter_bytes"] for x in inter), (inter, ag)
    assert ag["intra_steps"] == g - 1 and ag["inter_steps"] == w // g - 1


def simulated_all_to_all_reduce_scatter(w, g, elements):
    """zerort's reduce-scatter on real arrays: rank r sends chunk q of its buffer to rank q,
    which sums what it receives. Returns (intra, inter) elements sent by each rank, after
    checking every rank ends with its chunk of the sum."""
    rng = np.random.default_rng(1)
    data = [rng.integers(0, 100, elements).astype(np.int64) for _ in range(w)]
    n = elements // w
    sent_intra, sent_inter = [0] * w, [0] * w
    got = [np.zeros(n, dtype=np.int64) for _ in range(w)]
    for r in range(w):
        for q in range(w):
            got[q] += data[r][q * n:(q + 1) * n]
            if q != r:
                same_node = r // g == q // g
                (sent_intra if same_node else sent_inter)[r] += n
    total = np.sum(data, axis=0)
    for q in range(w):
        assert np.array_equal(got[q], total[q * n:(q + 1) * n]), q
    return sent_intra, sent_inter


@pytest.mark.parametrize("w,g", GRIDS)
def test_reduce_scatter_split_matches_a_simulated_all_to_all(w, g):
    intra, inter = simulated_all_to_all_reduce_scatter(w, g, ELEMENTS)
    bp = 2
    (rs,) = [c for c in plan.collectives(ELEMENTS, w, g, 2, param_bytes=bp, grad_bytes=bp)
             if c["collective"] == "reduce-scatter"]
    assert all(x * bp == pytest.approx(rs["intra_bytes"]) for x in intra), (intra, rs)
    assert all(x * bp == pytest.approx(rs["inter_bytes"]) for x in inter), (inter, rs)
    assert rs["intra_steps"] == int(g > 1) and rs["inter_steps"] == int(w > g)


def test_model_states_are_the_memory_estimator():
    shape = plan.Shape(layers=4, hidden=256, heads=4, vocab=1000)
    cluster = plan.Cluster(gpus=16, gpus_per_node=8)
    numel = shape.numel(128)
    for stage in range(4):
        row = plan.plan_stage(numel, shape, 128, 2, cluster, stage)
        est = zerort.estimate_memory(numel, 16, stage, "bf16", unit_numel=shape.block_numel)
        assert row["model_states"] == est["exact"]["total"]
        assert row["model_states_paper"] == est["paper"]["total"]


def _math_attention(q, k, v, is_causal=False):
    """Attention written with matmuls, so FlopCounterMode counts it (it does not count the
    CPU flash kernel)."""
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if is_causal:
        t = q.shape[-2]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def test_flops_match_flop_counter(monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode

    layers, h, heads, seq, batch, vocab = 2, 64, 4, 32, 3, 256
    monkeypatch.setattr(F, "scaled_dot_product_attention", _math_attention)
    torch.manual_seed(0)
    model = GPT(layers=layers, d=h, heads=heads, seq=seq, vocab=vocab)
    x = torch.randint(0, vocab, (batch, seq))
    counter = FlopCounterMode(display=False)
    with counter:
        F.cross_entropy(model(x).view(-1, vocab), x.view(-1)).backward()
    shape = plan.Shape(layers, h, heads, vocab)
    assert plan.flops_per_token(None, shape, seq, False) * batch * seq == counter.get_total_flops()
    # Checkpointing runs the forward once more: 4/3 of the above.
    assert plan.flops_per_token(None, shape, seq, True) * 3 == plan.flops_per_token(None, shape, seq, False) * 4
    # A bare count: 6 FLOPs per parameter per token.
    assert plan.flops_per_token(1e9, None, seq, False) == 6e9


def saved_bytes(model, x, checkpointing):
    """Bytes of the tensors autograd saves in forward (each storage once, parameters
    excluded), with the loss as train_gpt.py computes it."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    def block_call(blk, y):
        return torch.utils.checkpoint.checkpoint(blk, y, use_reentrant=False) if checkpointing else blk(y)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model.tok(x) + model.pos(torch.arange(x.shape[1]))
        for blk in model.blocks:
            y = block_call(blk, y)
        logits = model.head(model.ln(y))
        F.cross_entropy(logits.float().view(-1, logits.shape[-1]), x.view(-1))
    return sum(seen.values())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_match_saved_tensors(checkpointing):
    import torch.utils.checkpoint  # noqa: F401

    layers, h, heads, seq, batch, vocab = 3, 128, 4, 64, 2, 256
    torch.manual_seed(0)
    model = GPT(layers=layers, d=h, heads=heads, seq=seq, vocab=vocab).to(torch.bfloat16)
    x = torch.randint(0, vocab, (batch, seq))
    measured = saved_bytes(model, x, checkpointing)
    shape = plan.Shape(layers, h, heads, vocab)
    predicted = plan.activation_bytes(shape, seq, batch, checkpointing)
    if checkpointing:
        # Forward keeps the block inputs only; backward adds one recomputed block.
        predicted -= plan.activation_bytes(plan.Shape(1, h, heads, vocab), seq, batch, False) - \
            plan.activation_bytes(plan.Shape(0, h, heads, vocab), seq, batch, False)
    # The position indices (seq int64s) are the only bytes the formula leaves out.
    assert abs(measured - predicted) <= 8 * seq, (measured, predicted)


def test_smallest_world_fits_and_the_next_smaller_does_not():
    shape = plan.Shape(layers=86, hidden=8192, heads=64, vocab=32000)
    cluster = plan.Cluster(gpus=1024, gpus_per_node=8, gpu_mem_gb=80)
    numel = shape.numel(4096)
    w = plan.smallest_world(numel, shape, 4096, 1, cluster, 3, "bf16", checkpointing=True)
    assert w is not None and w % 8 == 0
    assert plan.plan_stage(numel, shape, 4096, 1, cluster, 3, world_size=w)["fits_ckpt"]
    assert not plan.plan_stage(numel, shape, 4096, 1, cluster, 3, world_size=w - 8)["fits_ckpt"]
    # Stages 1 and 2 keep 2Ψ bytes of bf16 parameters (139 GB): no world size helps.
    assert plan.smallest_world(numel, shape, 4096, 1, cluster, 2, "bf16", checkpointing=True) is None


def cli(*args, ok=True):
    p = subprocess.run([sys.executable, "-m", "zerort.accounting.planner", *args], capture_output=True, text=True,
                       timeout=120)
    assert (p.returncode == 0) == ok, p.stdout + p.stderr
    return p.stdout if ok else p.stderr


def test_cli_readme_example_and_json():
    args = ["--layers", "86", "--hidden", "8192", "--heads", "64", "--vocab", "32000", "--seq", "4096",
            "--micro-batch", "1", "--gpus", "1024", "--gpus-per-node", "8", "--gpu-mem", "80"]
    text = cli(*args)
    assert "smallest stage that fits at W=1024: stage 3 with activation checkpointing" in text
    p = json.loads(cli(*args, "--stage", "3", "--json"))
    (row,) = p["stages"]
    total = sum(c["intra_bytes"] + c["inter_bytes"] for c in row["collectives"])
    assert total == pytest.approx(textbook(p["numel"], 1024, 3, 2, 2), rel=1e-12)


@pytest.mark.parametrize("args,message", [
    (["--params", "7e9", "--gpus", "12", "--gpus-per-node", "8"],
     "--gpus: got 12, not a multiple of --gpus-per-node 8"),
    (["--params", "7e9", "--gpus", "8", "--inter-bw", "0"], "--inter-bw: got 0.0; it must be > 0"),
    (["--layers", "4", "--gpus", "8"], "needs both --layers and --hidden"),
    (["--layers", "4", "--hidden", "100", "--heads", "3", "--gpus", "8"],
     "--heads: got 3; it must divide --hidden 100"),
    (["--gpus", "8"], "give --params N, or a GPT shape"),
])
def test_cli_errors_name_the_flag(args, message):
    assert message in cli(*args, ok=False)


def simulated_two_hop_reduce_scatter(w, g, elements):
    """Note [two hops] on real arrays: hop 1 within each node (rank r sends to node-peer l the
    chunks of the ranks of local index l, and each rank sums its node's), hop 2 across nodes
    among the ranks of one local index (the partial sum for node k goes to rank k * g + l).
    Returns (intra, inter) elements sent by each rank, after checking every rank's chunk."""
    rng = np.random.default_rng(2)
    data = [rng.integers(0, 100, elements).astype(np.int64) for _ in range(w)]
    n, nodes = elements // w, w // g
    chunk = lambda a, q: a[q * n:(q + 1) * n]
    intra, inter = [0] * w, [0] * w
    partial = {}  # (rank, node k): its node's sum of the chunks for rank k * g + local
    for r in range(w):
        node, local = divmod(r, g)
        for k in range(nodes):
            partial[r, k] = sum(chunk(data[node * g + peer], k * g + local) for peer in range(g))
        intra[r] = (g - 1) * nodes * n  # to each node-peer its ranks' chunks
    for r in range(w):
        node, local = divmod(r, g)
        inter[r] = (nodes - 1) * n  # its partial for each other node's rank of its local index
        got = sum(partial[k * g + local, node] for k in range(nodes))
        assert np.array_equal(got, chunk(np.sum(data, axis=0), r)), r
    return intra, inter


@pytest.mark.parametrize("w,g", GRIDS)
@pytest.mark.parametrize("inter_bytes", [2, 4, plan.WIRE_BYTES["int8"]])
def test_two_hop_reduce_scatter_split_matches_a_simulated_two_hop(w, g, inter_bytes):
    intra, inter = simulated_two_hop_reduce_scatter(w, g, ELEMENTS)
    (rs,) = [c for c in plan.collectives(ELEMENTS, w, g, 2, grad_bytes=2, inter_bytes=inter_bytes)
             if c["collective"] == "reduce-scatter"]
    assert all(x * 2 == pytest.approx(rs["intra_bytes"]) for x in intra), (intra, rs)
    assert all(x * inter_bytes == pytest.approx(rs["inter_bytes"]) for x in inter), (inter, rs)


def test_two_hop_70b_on_128_nodes():
    """Issue 30's planner rows: 70B on 128 x 8 at stage 3, the gradients' inter-node bytes and
    the network time, flat against two-hop (bf16 between the hops)."""
    base = ["--params", "70e9", "--gpus", "1024", "--gpus-per-node", "8", "--stage", "3", "--json"]
    rows = {}
    two_hop = ["--topology", "two_hop", "--inter-node-dtype"]
    for name, extra in (("flat", []), ("two_hop", [*two_hop, "bf16"]), ("two_hop_int8", [*two_hop, "int8"])):
        (row,) = json.loads(cli(*base, *extra))["stages"]
        (rs,) = [c for c in row["collectives"] if c["collective"] == "reduce-scatter"]
        rows[name] = (rs["inter_bytes"], row["comm_bw_s"])
        print(f"[planner 70B 128x8 stage 3 {name}] gradients across nodes {rs['inter_bytes'] / 1e9:.2f} GB per rank, "
              f"network time {row['comm_bw_s']:.2f} s")
    assert rows["flat"][0] == pytest.approx(1016 / 1024 * 140e9) and rows["flat"][1] > 7.5
    assert rows["two_hop"][0] <= 17.5e9 and rows["two_hop"][1] <= 3.5
    assert rows["two_hop_int8"][0] == pytest.approx(rows["two_hop"][0] * (1 + 4 / 256) / 2)


def test_hybrid_and_hpz_rows_on_128_nodes():
    """Issue 31's planner rows: 70B on 128 x 8 at stage 3 in groups of a node (shard_size), the
    sum across the 128 groups on an int8 wire, and hpZ. Against counts done here: memory is the
    flat layout's at W = 8 (16 Psi / 8 plus units), the sum sends (R - 1) pieces of Psi / W
    elements each way on the wire, and everything else stays in the node; hpZ adds 2 Psi / 8 and
    keeps the flat engine's backward all-gather inside the node."""
    psi, w, g = 70e9, 1024, 8
    base = ["--params", "70e9", "--gpus", str(w), "--gpus-per-node", str(g), "--stage", "3", "--json"]
    (hybrid,) = json.loads(cli(*base, "--shard-size", "node", "--inter-node-dtype", "int8"))["stages"]
    (flat8,) = json.loads(cli(*base[:2], "--gpus", "8", "--gpus-per-node", "8", "--stage", "3", "--json"))["stages"]
    assert hybrid["model_states"] == flat8["model_states"]
    per_piece = psi / w * plan.WIRE_BYTES["int8"]
    across = [c for c in hybrid["collectives"] if c["inter_bytes"] > 0]
    assert [c["collective"] for c in across] == ["all-to-all", "all-gather"]
    assert all(c["inter_bytes"] == pytest.approx((w // g - 1) * per_piece) for c in across)
    assert sum(c["inter_bytes"] for c in hybrid["collectives"]) == pytest.approx(2 * (w // g - 1) * per_piece)
    (flat,) = json.loads(cli(*base))["stages"]
    (hpz,) = json.loads(cli(*base, "--secondary-shard-size", "node"))["stages"]
    assert hpz["model_states"] - flat["model_states"] == pytest.approx(2 * psi / g, rel=1e-3)
    backward = [c for c in hpz["collectives"] if "hpZ" in c["moves"]]
    assert len(backward) == 1 and backward[0]["inter_bytes"] == 0
    inter = lambda row: sum(c["inter_bytes"] for c in row["collectives"])
    print(f"[planner 70B 128x8 stage 3] across nodes per rank: flat {inter(flat) / 1e9:.1f} GB, hpZ "
          f"{inter(hpz) / 1e9:.1f} GB, hybrid int8 {inter(hybrid) / 1e9:.2f} GB; states flat "
          f"{flat['model_states'] / 1e9:.1f} GB, hpZ {hpz['model_states'] / 1e9:.1f} GB, hybrid "
          f"{hybrid['model_states'] / 1e9:.1f} GB")
