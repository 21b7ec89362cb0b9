"""The planner's multi-node rows for a GPU cluster (python -m zerort.accounting.planner --cluster gpu-400g;
zerort.accounting.cluster_rows): 70B on 128 nodes x 8 at stage 3 in bf16. Every row's bytes per rank
across nodes and within, and its network time, against the traffic formulas counted here by hand
(docs/PLANNER.md and Note [two hops]: a hierarchical ring all-gather sends (G-1)/G S within the node and
(N-1)/N S / G across; zerort's flat reduce-scatter, an all-to-all, (G-1)/W S and (W-G)/W S; the two-hop
one (G-1)/G S within and (N-1)/W of the elements across on its wire; hybrid groups of a node sum across
the N groups with 2 (N-1) pieces of Psi / W elements on their wire), and ZeRO++'s published 4x beside."""
import json
import subprocess
import sys

import pytest

PSI, N, G = 70e9, 128, 8
W = N * G
S = 2 * PSI  # one pass of bf16 parameters or gradients, bytes
INT8 = 1 + 4 / 256  # an int8 code per element and an FP32 scale per block of 256
RING_ACROSS, RING_WITHIN = (N - 1) / N * S / G, (G - 1) / G * S


def cli(*args):
    p = subprocess.run([sys.executable, "-m", "zerort.accounting.planner", *args], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout


def by_hand():
    """(across, within) bytes per rank per step of each row."""
    two_hop_across = lambda wire: (N - 1) / W * PSI * wire
    return {
        "ZeRO-3 rings": (3 * RING_ACROSS, 3 * RING_WITHIN),
        "flat": (2 * RING_ACROSS + (W - G) / W * S, 2 * RING_WITHIN + (G - 1) / W * S),
        "two_hop bf16": (2 * RING_ACROSS + two_hop_across(2), 3 * RING_WITHIN),
        "hybrid int8": (2 * (N - 1) * PSI / W * INT8, 3 * RING_WITHIN),
        "hpZ": (RING_ACROSS + two_hop_across(2), 3 * RING_WITHIN),
        "ZeRO++'s three": (RING_ACROSS / 2 * INT8 + two_hop_across(INT8), RING_WITHIN / 2 * INT8 + 2 * RING_WITHIN),
    }


@pytest.fixture(scope="module")
def rows():
    out = json.loads(cli("--params", "70e9", "--gpus", str(W), "--cluster", "gpu-400g", "--stage", "3", "--json"))
    assert out["cluster"]["gpus_per_node"] == G
    return {r["row"]: r for r in out["multi_node_rows"]}


def test_each_rows_bytes_are_the_hand_counted_ones(rows):
    want = by_hand()
    assert list(rows) == list(want)
    for name, (across, within) in want.items():
        r = rows[name]
        print(f"[planner gpu-400g 70B 128x8 stage 3] {name:15s} across {r['inter_bytes'] / 1e9:7.2f} GB, within "
              f"{r['intra_bytes'] / 1e9:7.2f} GB, network {r['network_s']:.2f} s, "
              f"{r['x_fewer_than_zero3']:.2f}x fewer across than ZeRO-3's rings")
        assert r["inter_bytes"] == pytest.approx(across, rel=1e-12), name
        assert r["intra_bytes"] == pytest.approx(within, rel=1e-12), name
        # 400 Gbit/s per GPU is 50e9 bytes/s each way; NVLink's 900 GB/s counts both ways: 450e9 each.
        assert r["network_s"] == pytest.approx(within / 450e9 + across / 50e9, rel=1e-12), name
        assert r["x_fewer_than_zero3"] == pytest.approx(3 * RING_ACROSS / across, rel=1e-12), name


def test_the_rows_beside_zero_pps_published_reduction(rows):
    """ZeRO++ (arXiv:2306.10209): 3M -> 0.75M across nodes, 4x; hpZ alone takes the backward's M off.
    zerort's three land at 3M -> (0.5 + 0.5) M * (1 + 4/256): int8 gradients where ZeRO++ sends int4."""
    three = rows["ZeRO++'s three"]
    assert three["zero_pp_published"] == 4.0 and rows["hpZ"]["zero_pp_published"] == 1.5
    assert three["x_fewer_than_zero3"] == pytest.approx(3 / INT8, rel=1e-12)
    assert rows["hpZ"]["x_fewer_than_zero3"] == pytest.approx(1.5, rel=1e-12)  # the published hpZ figure
    assert rows["two_hop bf16"]["inter_bytes"] == pytest.approx(rows["ZeRO-3 rings"]["inter_bytes"], rel=1e-12)


def test_the_model_states_per_rank(rows):
    """hpZ keeps 2 Psi / G more per rank than stage 3 over the world; groups of a node hold 16 Psi / G."""
    flat, hpz, hybrid = (rows[k]["model_states"] for k in ("flat", "hpZ", "hybrid int8"))
    assert hpz - flat == pytest.approx(S / G, rel=1e-5)  # plus the pieces' padding: 78 KB here
    assert hybrid > 16 * PSI / G


def test_presets_and_explicit_flags():
    base = ["--params", "70e9", "--gpus", str(W), "--stage", "3", "--json"]
    node = json.loads(cli(*base, "--cluster", "gpu-400g-node"))
    assert node["cluster"]["inter_bw_gbs"] == 400 / 8 / 8 and node["cluster"]["intra_bw_gbs"] == 450
    own = json.loads(cli(*base, "--cluster", "gpu-400g", "--inter-bw", "12.5"))
    assert own["cluster"]["inter_bw_gbs"] == 12.5  # an explicit flag wins over the preset
    (rings,) = [r for r in own["multi_node_rows"] if r["row"] == "ZeRO-3 rings"]
    assert rings["inter_s"] == pytest.approx(3 * RING_ACROSS / 12.5e9, rel=1e-12)
    plain = json.loads(cli(*base))
    assert "multi_node_rows" not in plain and plain["cluster"]["inter_bw_gbs"] == 25.0
    assert "multi_node_rows" in json.loads(cli(*base, "--multi-node-rows"))
    text = cli("--params", "70e9", "--gpus", str(W), "--cluster", "gpu-400g", "--stage", "3")
    assert "ZeRO++'s three" in text and "arXiv:2306.10209" in text
