"""Hybrid sharding (shard_size, DeepSpeed's mics_shard_size; C++ Note [hybrid sharding] in
runtime/shard_groups.h): the state sharded within groups of consecutive ranks and replicated
across them; and stage 3's secondary shards (hpZ: stage3.secondary_shard_size, DeepSpeed's
zero_hpz_partition_size; C++ Note [secondary shards]).

- Parity with plain PyTorch (test_engine_parity's reference, FP32 AdamW) at stages 1-3:
  W = 4 in 2 groups of 2 under torchrun with gloo (bf16, fp16 with accumulation 2, the MLP,
  the transformer; HF GPT-2 against the flat engine), and W = 3 in 3 groups of 1 under
  torchrun, where each bucket's shard is split into 3 pieces that do not divide it (buckets of
  61 elements). Every rank sees the same losses, and the replicas of one shard (ranks r and
  r + shard_size) hold the same bits.
- The sum across groups on a bf16, int8 or fp8 wire (comm.inter_node_dtype): the replicas stay
  bit-equal, the master within the transformer's bound of torch's, the last loss within 1%.
- An fp16 overflow on one rank skips the step on every rank, as the flat engine does.
- A checkpoint of the W = 4, shard_size 2 run holds 2 shards (written once, by group 0) and
  loads at W = 2 and 3 flat and at W = 4 in groups of 1, bit for bit.
- The memory report: the estimate is the flat engine's at W = shard_size, and the measured
  state bytes equal it.
- hpZ at W = 4 in pairs (torchrun, gloo): every loss, master and working weight equals the
  stage-3 run without it, bit for bit (the transformer with accumulation 2, GPT-2, and with
  shard_size 2 as well); the re-gathers run on the pair's communicator, so the primary gathers'
  (the world's, or the shard group's) carries fewer calls; the allocator's low-precision
  parameters grow by the gathered units' bytes / 2.
- Refusals name the key: a shard_size that does not divide W, stage 0, an offloaded state,
  the gradients asked for before the window's last micro-step, hpZ at stage 2 or in groups
  larger than the shard group; a rank that skipped backward is named at the world's one
  decision.
The two-host runs are in test_two_hosts.py (shard_size "node").
"""
import json
import os
import shutil
import sys
import types

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_engine_parity import BOUND, global_rel, launch, reference  # noqa: E402
from test_checkpoint import WORKER as CKPT_WORKER, equal  # noqa: E402

import zerort  # noqa: E402
from zerort._testing.launch import launch as launch_ranks  # noqa: E402
from zerort.accounting.memory import estimate_memory, model_groups, unit_bytes  # noqa: E402

TORCH_CASES = ([f"{m}:{s}:bf16:1:20:shard@2" for m in ("mlp", "transformer") for s in (1, 2, 3)]
               + [f"mlp:{s}:fp16:2:20:shard@2" for s in (2, 3)])
GPT2_CASES = [f"gpt2:{s}:bf16:1:4" for s in (2, 3)]
ODD_CASES = [f"mlp:{s}:bf16:1:20:shard@1:bucket@61" for s in (1, 2, 3)]
OVERFLOW = "mlp:2:fp16:1:8:inf@3"
WIRE_CASES = [f"transformer:{s}:bf16:1:20:shard@2:wire@{w}" for s, w in ((2, "bf16"), (2, "int8"), (3, "fp8_e4m3"))]
HPZ_CASES = ["transformer:3:bf16:2:6", "gpt2:3:bf16:1:4", "transformer:3:bf16:1:6:shard@2"]


def _check_run(ranks, case, shard_size):
    world = len(ranks)
    assert all(r[case]["shard_size"] == shard_size for r in ranks), case
    assert all(r[case]["losses"] == ranks[0][case]["losses"] for r in ranks), case
    for r in range(world):  # the replicas of one shard: the same bits
        twin = (r + shard_size) % world
        assert torch.equal(ranks[r][case]["own_master"], ranks[twin][case]["own_master"]), (case, r, twin)


def _against_torch(ranks, case):
    _, ref_state = reference(case, len(ranks))
    name, steps = case.split(":")[0], int(case.split(":")[4])
    worst = global_rel(ranks[0][case]["master"], ref_state)
    print(f"[hybrid W={len(ranks)}] {case}: max |master - torch| / max |torch| = {worst:.2e}")
    assert worst < BOUND[(name, steps)], case


@pytest.fixture(scope="module")
def w4_torchrun(tmp_path_factory):
    cases = (TORCH_CASES + GPT2_CASES + [f"{c}:shard@2" for c in GPT2_CASES] + WIRE_CASES + HPZ_CASES
             + [f"{c}:hpz@2" for c in HPZ_CASES])
    return launch("torchrun", 4, sorted(set(cases), key=cases.index), tmp_path_factory.mktemp("hybrid4"))


def test_groups_of_2_at_w4_match_torch(w4_torchrun):
    for case in TORCH_CASES:
        _check_run(w4_torchrun, case, 2)
        _against_torch(w4_torchrun, case)


def test_low_precision_sums_across_groups_keep_the_replicas_equal(w4_torchrun):
    """comm.inter_node_dtype bf16, int8 and fp8_e4m3 on the sum across groups: both its halves
    on the wire, decoded on every rank (the summing one too), so the replicas stay bit-equal."""
    for case in WIRE_CASES:
        _check_run(w4_torchrun, case, 2)
        _against_torch(w4_torchrun, case)
        exact = w4_torchrun[0]["transformer:2:bf16:1:20:shard@2"]["losses"][-1]
        assert abs(w4_torchrun[0][case]["losses"][-1] - exact) < 0.01 * exact, case


def test_gpt2_in_groups_matches_the_flat_engine(w4_torchrun):
    for case in GPT2_CASES:
        _check_run(w4_torchrun, f"{case}:shard@2", 2)
        flat, hybrid = w4_torchrun[0][case], w4_torchrun[0][f"{case}:shard@2"]
        assert flat["shard_size"] == 4
        worst = global_rel(hybrid["master"], flat["master"])
        print(f"[hybrid W=4] {case}: max |hybrid - flat| / max |flat| = {worst:.2e}")
        assert worst < 1e-2, case  # the same sums in another order, rounded in bf16 forward


def test_the_memory_estimate_is_the_flat_one_at_w_shard_size(w4_torchrun):
    for case in ("transformer:3:bf16:1:20:shard@2", "mlp:2:fp16:2:20:shard@2"):
        mem = w4_torchrun[0][case]["memory"]
        assert mem["shard_size"] == 2 and mem["world_size"] == 4
        stage = int(case.split(":")[1])
        model = "transformer" if case.startswith("transformer") else "mlp"
        from engine_models import make_model

        flat = estimate_memory(make_model(model), 2, stage, "bf16", reduce_bucket_numel=500)["exact"]
        for key in ("master", "adam_m", "adam_v", "grad_shard"):
            row = mem["categories"][key]
            assert row["measured"] == row["estimate"] == flat[key], (case, key, row, flat[key])


def test_secondary_shards_give_the_same_bits_with_fewer_world_calls(w4_torchrun):
    from engine_models import make_model

    for case in HPZ_CASES:
        plain, hpz = w4_torchrun[0][case], w4_torchrun[0][f"{case}:hpz@2"]
        assert hpz["losses"] == plain["losses"], case
        for key in ("master", "params"):
            assert equal(hpz[key], plain[key]), (case, key)
        sharding = 1 if "shard@" in case else 0  # the communicator of the primary gathers: the group's, or the world's
        pair, before, after = hpz["backend_calls"][3], plain["backend_calls"][sharding], hpz["backend_calls"][sharding]
        print(f"[hpZ W=4] {case}: calls on the primary gathers' communicator {before} -> {after}, on the pair's {pair}")
        assert pair > 0 and after < before, case
        if "shard@" in case:
            continue
        units = unit_bytes(model_groups(make_model(case.split(":")[0]), 3), 4)
        grown = hpz["memory"]["categories"]["lp_params"]["measured"] - plain["memory"]["categories"]["lp_params"][
            "measured"]
        assert grown == sum(units) // 2, (case, grown, sum(units))
        assert hpz["memory"]["categories"]["lp_params"]["diff"] == 0, case


def test_groups_of_1_at_w3_split_odd_shards(tmp_path):
    ranks = launch("torchrun", 3, ODD_CASES + [OVERFLOW, f"{OVERFLOW}:shard@1"], tmp_path)
    for case in ODD_CASES:
        _check_run(ranks, case, 1)
        _against_torch(ranks, case)
    flat, hybrid = ranks[0][OVERFLOW], ranks[0][f"{OVERFLOW}:shard@1"]
    assert hybrid["skipped"] == flat["skipped"] and hybrid["skipped"][3] and sum(hybrid["skipped"]) == 1
    assert hybrid["scales"] == flat["scales"]
    for r in ranks:
        assert r[f"{OVERFLOW}:shard@1"]["scales"] == hybrid["scales"]


def ckpt_torchrun(world, *args):
    launch_ranks("torchrun", world, CKPT_WORKER, *args, timeout=300)


def test_a_checkpoint_in_groups_loads_at_other_worlds_and_shard_sizes(tmp_path):
    saved = tmp_path / "saved"
    saved.mkdir()
    ckpt_torchrun(4, "train", saved, "transformer", 3, 4, "--shard-size", 2)
    want = torch.load(saved / "train.pt")["master"]
    tag = (saved / "ckpt" / "latest").read_text()
    with open(saved / "ckpt" / tag / "meta.json") as f:
        meta = json.load(f)
    assert meta["world_size"] == 2 and meta["shards"] == ["shard_00000.pt", "shard_00001.pt"]
    assert sorted(p for p in os.listdir(saved / "ckpt" / tag) if p.startswith("shard_")) == meta["shards"]
    for world, extra in ((2, ()), (3, ()), (4, ("--shard-size", 1))):
        d = tmp_path / f"w{world}{''.join(map(str, extra))}"
        shutil.copytree(saved / "ckpt", d / "src")
        ckpt_torchrun(world, "reshard", d, "transformer", 3, *extra)
        assert equal(torch.load(d / "full.pt"), want), (world, extra)


def test_a_mics_script_trains_alike_at_every_shard_size(tmp_path):
    """DeepSpeed's MiCS pattern (deepspeed.zero.MiCS_Init, zero_optimization.mics_shard_size,
    ranks seeded differently) at W = 4: shard sizes 1, 2 and 4 give the same losses, and weights
    the same within the rounding of the group's FP32 partial sums (groups of 1 sum as the flat
    engine: bit for bit)."""
    runs = {}
    for shard in (1, 2, 4):
        launch_ranks("torchrun", 4, os.path.join(HERE, "mics_worker.py"), tmp_path / f"mics{shard}.pt", shard,
                     timeout=300)
        runs[shard] = torch.load(tmp_path / f"mics{shard}.pt")
        assert runs[shard]["shard_size"] == shard
    assert runs[1]["losses"] == runs[4]["losses"] and equal(runs[1]["weights"], runs[4]["weights"])
    assert runs[2]["losses"] == pytest.approx(runs[4]["losses"], rel=1e-6)
    for k, v in runs[4]["weights"].items():
        assert torch.allclose(runs[2]["weights"][k], v, rtol=0, atol=1e-6), k


def test_refusals_name_the_key(tmp_path):
    launch_ranks("torchrun", 2, os.path.join(HERE, "hybrid_worker.py"), tmp_path / "err", tmp_path / "nvme",
                 timeout=300)
    for r in range(2):
        with open(tmp_path / f"err.rank{r}.json") as f:
            got = json.load(f)
        assert got["not_a_divisor"][0] == "ConfigError"
        assert "shard_size: got 3, which does not divide the world size 2" in got["not_a_divisor"][1]
        assert got["stage0"][0] == "ConfigError" and "shard_size: stage 0" in got["stage0"][1]
        assert got["offload"][0] == "ConfigError" and "shard_size: hybrid sharding keeps the state in memory" in \
            got["offload"][1]
        assert got["reduce_now_mid_window"][0] == "UsageError" and "with shard_size" in got["reduce_now_mid_window"][1]
        assert got["skipped_backward"][0] == "UsageError" and "rank 1 (1 of 2)" in got["skipped_backward"][1]
        assert got["hpz_at_stage2"][0] == "ConfigError" and "at stages 1-2 drop it" in got["hpz_at_stage2"][1]
        assert got["hpz_beyond_the_group"][0] == "ConfigError"
        assert "groups of 2 ranks do not fit within the groups of 1" in got["hpz_beyond_the_group"][1]


def test_groups_need_a_group_backend():
    """shard_size and stage3.secondary_shard_size split mpi, gloo and nccl communicators (nccl's:
    test_nccl_parts.py); in-process is refused by name where groups would be made, and a group of
    the whole world (shard_size) or of one rank (hpZ off) makes none."""
    from zerort.comm import topology

    comm = types.SimpleNamespace(size=4, rank=1)
    for call in (lambda: topology.shard_groups(comm, "inprocess", 2, 10, False, {}),
                 lambda: topology.node_part(comm, "inprocess", 2, 10, False, {})):
        with pytest.raises(zerort.ConfigError, match="built for the mpi, gloo, nccl backends, not 'inprocess'"):
            call()
    assert topology.shard_groups(comm, "nccl", 4, 10, False, {}) == (None, None)
    assert topology.node_part(comm, "inprocess", 1, 10, False, {}) is None
    with pytest.raises(zerort.ConfigError, match="shard_size: got 3, which does not divide the world size 4"):
        topology.shard_groups(comm, "gloo", 3, 10, False, {})
