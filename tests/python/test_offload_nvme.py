"""offload_optimizer.device "nvme" (See Note [state tiers], runtime/engine_tiers.cpp): a CPU
model's master and Adam moments in one O_DIRECT file per rank, streamed through the pool each
step. Against the in-memory tier, the same run must give the same bits: losses, masters and
moments, at stages 1-3, fp32 and bf16 states, W = 2 and 4 (nvme_offload_worker.py); a
checkpoint saved from either tier loads into the other and resumes bit for bit. The files go
when the engine does. A directory that cannot hold the files fails every rank at initialize,
naming the rank, the path and the fix, before any state is written.
"""
import csv
import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zerort._testing.launch import launch, launch_plain  # noqa: E402

STEPS, ACCUMULATION = 4, 2  # nvme_offload_worker's: optimizer steps (each streams the whole state once), micro
# "grads": the FP32 gradient shard in the file too (Note [gradient in the file]); "ram": that part of
# master, m and v kept in RAM, the rest in the file (ram_fraction; C++ Note [NVMe state store]); "devgrad":
# the gradient with the model, stepped from host pieces of chunk_numel (C++ Note [gradient on the device]).
CASES = {2: [{"name": "gpt2-s1", "model": "gpt2", "stage": 1, "state_dtype": "fp32", "grads": True},
             {"name": "gpt2-s2", "model": "gpt2", "stage": 2, "state_dtype": "bf16"},
             {"name": "llama-s3", "model": "llama", "stage": 3, "state_dtype": "fp32", "grads": True},
             {"name": "gpt2-s3p", "model": "gpt2", "stage": 3, "state_dtype": "fp32", "params": True},
             {"name": "llama-s3r", "model": "llama", "stage": 3, "state_dtype": "fp32", "ram": 0.5, "devgrad": True},
             {"name": "gpt2-s1r", "model": "gpt2", "stage": 1, "state_dtype": "bf16", "ram": 0.4}],
         4: [{"name": "qwen2-s3p", "model": "qwen2", "stage": 3, "state_dtype": "bf16", "params": True},
             {"name": "gpt2-s2", "model": "gpt2", "stage": 2, "state_dtype": "fp32", "grads": True}]}


def run(tmp_path, world, cases=None, env=None):
    """The worker at W = world on cases (default CASES[world]): its results, tensors, nvme
    folder and Launched (the output, rank 0's banner in it)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    with open(tmp_path / "cases.json", "w") as f:
        json.dump(cases or CASES[world], f)
    launched = launch("torchrun", world, os.path.join(HERE, "nvme_offload_worker.py"), tmp_path / "out", nvme,
                      tmp_path / "cases.json", timeout=900, env=env)
    with open(tmp_path / "out.json") as f:
        return json.load(f), torch.load(tmp_path / "out.pt"), nvme, launched


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", [2, 4])
def test_nvme_tier_equals_memory_tier_bitwise(tmp_path, world):
    result, tensors, nvme, _ = run(tmp_path, world)
    for case in CASES[world]:
        name = case["name"]
        ram, disk = result[f"{name}:none"], result[f"{name}:nvme"]
        assert ram["losses"] == disk["losses"], name
        assert same(tensors[f"{name}:none"], tensors[f"{name}:nvme"]), name
        # The files: one per rank while the engine lives, sized for its chunks (and one of the
        # parameters' shards with offload_param); gone after.
        kinds = ("states", "params") if case.get("params") else ("states",)
        assert disk["files"] == sorted([f"zerort-{k}-rank{r}.bin{lock}" for k in kinds for r in range(world)
                                        for lock in ("", ".lock")]), disk["files"]
        params = disk["param_stats"]
        if case.get("params"):
            assert params["tier"] == "nvme" and params["path"].startswith(str(nvme)), params
            size = params["file_bytes"]
            assert size > 0 and size % 4096 == 0, params
            # Each micro-step gathers every unit once or twice (forward, and backward unless kept
            # between them), each gather reading its shard; initialize and every step write them
            # all, the last step's writes maybe still in flight.
            assert STEPS * ACCUMULATION * size <= params["bytes_read"] <= 2 * STEPS * ACCUMULATION * size, params
            assert STEPS * size <= params["bytes_written"] <= (STEPS + 1) * size, params
            assert "stage-3 parameters on nvme" in disk["report"] and "parameter file" in disk["report"]
        else:
            assert params["tier"] == "memory", params
        assert disk["files_after_destroy"] == [] and ram["files"] == []
        stats = disk["stats"]
        assert stats["tier"] == "nvme" and stats["path"].startswith(str(nvme))
        # chunk_numel 1000, rounded up to the 4096-byte alignment as an element count: 4096.
        record = 4096 * (4 + 2 * (4 if case["state_dtype"] == "fp32" else 2))
        records = stats["file_bytes"] - stats["gradient_bytes"]
        # The estimate (zerort.accounting.memory's NvmeTier) knows the file and the RAM to the byte.
        assert disk["file_estimate"] == stats["file_bytes"], (disk["file_estimate"], stats)
        assert all(m == e for m, e in disk["against_estimate"].values()), disk["against_estimate"]
        assert records % record == 0 and records >= 2 * record, stats
        # A split: the first floor(ram x chunks) records in RAM, counted as master and moments in the report.
        in_ram = stats["ram_bytes"] // record
        assert stats["ram_bytes"] % record == 0 and in_ram == int(case.get("ram", 0) * (in_ram + records // record))
        assert (in_ram > 0) == ("split (ram_fraction)" in disk["report"]) == bool(case.get("ram")), stats
        if case.get("grads"):  # the gradient after the records, 4 bytes an element on whole 4096-byte units
            assert records // record * 4096 * 4 >= stats["gradient_bytes"] > 0, stats
            # buffer_count 3 records, each with its chunk's gradient slot; two staging pieces of 2**16 elements
            assert stats["pool_bytes"] == 3 * (record + 4096 * 4) + 2 * 2 ** 18, stats
            assert disk["grad_ram"] < ram["grad_ram"], (disk["grad_ram"], ram["grad_ram"])  # the largest bucket's shard
            # Each step reads the records once, the gradient at least twice (the decision's pass and the
            # update) and writes both; the reduces' reads and their end units come on top.
            assert stats["step_bytes_read"] >= STEPS * (records + 2 * stats["gradient_bytes"]), stats
            assert stats["step_bytes_written"] >= STEPS * (records + stats["gradient_bytes"]) - stats["pool_bytes"]
        else:
            piece = 4 * 4096 if case.get("devgrad") else 0  # the host piece: a record's chunk of floats
            assert stats["gradient_bytes"] == 0 and stats["pool_bytes"] == 3 * record + piece, stats  # any size
            assert stats["gradient_on_device"] == bool(case.get("devgrad")), stats
            assert disk["grad_ram"] == ram["grad_ram"]
            # Every step reads and writes the whole file, in the next forward's order (C++ Note [NVMe
            # state store]: order): at stages 1-2 (the offsets' reverse) each record once; at stage 3
            # the units gathered at the step come first, and the records they share with the units
            # beside them are visited twice. Bytes count when their request completes: the last
            # step's last writes may still be in flight (at most the pool), and the first step drops
            # what was read ahead in offset order before the order was known (at most the pool).
            most = (1 if case["stage"] < 3 else 2) * STEPS * stats["file_bytes"]
            assert STEPS * stats["file_bytes"] <= stats["step_bytes_read"] <= most + stats["pool_bytes"], stats
            assert STEPS * stats["file_bytes"] - stats["pool_bytes"] <= stats["step_bytes_written"] <= most, stats
        assert ram["stats"]["tier"] == "memory"
        # The monitor's I/O columns: every rank's file read once per step (all ranks' files alike).
        with open(tmp_path / name / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == STEPS and all(float(r["nvme_wait_s"]) >= 0 for r in rows), rows
        state_mib = world * stats["file_bytes"] / 2 ** 20  # plus the gathers' reads with offload_param
        pool_mib = world * stats["pool_bytes"] / 2 ** 20  # the first step's reads ahead, dropped (above)
        assert all(float(r["nvme_read_mib"]) > state_mib if case.get("params") or case.get("grads") else
                   state_mib <= float(r["nvme_read_mib"]) <= (1 if case["stage"] < 3 else 2) * state_mib +
                   (pool_mib if i == 0 else 0)
                   for i, r in enumerate(rows)), rows
        assert "optimizer states on nvme" in disk["report"], disk["report"]
        # A checkpoint from either tier resumes in the other to the same bits.
        assert result[f"{name}:none->nvme"]["losses"] == result[f"{name}:nvme->none"]["losses"]
        assert same(tensors[f"{name}:none->nvme"], tensors[f"{name}:nvme->none"]), name
    assert os.listdir(nvme) == []


def init_each_rank(tmp_path, world, paths):
    """zerort.initialize at W = world with rank r's nvme_path paths[r]: each rank's Launched."""
    script = tmp_path / "init.py"
    script.write_text(
        "import os, sys\nsys.path.insert(0, %r)\n" % HERE +
        "import zerort\nfrom engine_models import hf_model\n"
        f"path = {[str(p) for p in paths]!r}[int(os.environ['RANK'])]\n"
        "zerort.initialize(hf_model('gpt2'), {'stage': 2, 'offload': {'optimizer': {'device': 'nvme', "
        "'nvme_path': path}}})\n")
    return launch_plain(world, script, timeout=300)


def every_output(ranks):
    """Each rank's exit status and output: a failure shows the rank that ended first, too."""
    return "\n".join(f"--- rank {r} (exit {p.returncode}):\n{p.output}" for r, p in enumerate(ranks))


def test_a_missing_directory_fails_every_rank_naming_it(tmp_path):
    missing = tmp_path / "no-such-dir"
    ranks = init_each_rank(tmp_path, 2, [missing, missing])
    for rank in ranks:
        assert rank.returncode != 0, every_output(ranks)
        assert "rank 0:" in rank.output and "rank 1:" in rank.output and str(missing) in rank.output, \
            every_output(ranks)


def test_one_rank_that_cannot_make_its_file_fails_every_rank_and_none_is_written(tmp_path):
    ok, missing = tmp_path / "ok", tmp_path / "missing"
    ok.mkdir()
    ranks = init_each_rank(tmp_path, 2, [ok, missing])
    for rank in ranks:
        assert rank.returncode != 0, every_output(ranks)
        assert "none was written" in rank.output and "rank 1:" in rank.output, every_output(ranks)
        assert str(missing) in rank.output and "rank 0:" not in rank.output, every_output(ranks)
    assert os.listdir(ok) == []  # rank 0's file was made, then removed with its engine


def test_nvme_for_a_cuda_model_is_accepted_and_stage_0_and_a_ratio_refused_by_name():
    from zerort.config import parse
    from zerort.config.offload import check_tier
    from zerort.errors import ConfigError

    cuda = torch.device("cuda", 0)  # a device value: no GPU is needed (tests/gpu runs it)
    check_tier(parse({"offload": {"optimizer": {"device": "nvme", "nvme_path": "/tmp"}}}), cuda)
    check_tier(parse({"stage": 3, "offload": {"optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                                              "param": {"device": "nvme", "nvme_path": "/tmp"}}}), cuda)
    with pytest.raises(ConfigError, match="ratio"):
        check_tier(parse({"stage": 3, "offload": {"optimizer": {"device": "nvme", "nvme_path": "/tmp",
                                                                "ratio": 0.5}}}), cuda)
    with pytest.raises(ConfigError, match="stage 0"):
        parse({"stage": 0, "offload": {"optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})
    with pytest.raises(ConfigError, match="ratio"):
        check_tier(parse({"stage": 3, "offload": {"optimizer": {"device": "nvme", "nvme_path": "/tmp",
                                                                "ratio": 0.5}}}), torch.device("cpu"))


def test_a_checkpoint_streams_through_small_windows_between_tiers(tmp_path, monkeypatch):
    """One process (inprocess backend): windows of 300 elements, so the save's scratch files,
    write_state's windows and the load's batches of parameters each take many rounds."""
    from engine_models import batch, hf_model, loss_fn

    import zerort
    from zerort.integrations.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from zerort.layout import shard_map
    from zerort.state import state_io

    monkeypatch.setattr(shard_map, "WINDOW", 300)
    monkeypatch.setattr(state_io, "WINDOW", 300)
    (tmp_path / "nvme").mkdir()

    def engine(tier, seed):
        torch.manual_seed(seed)
        optimizer = {"device": tier, "nvme_path": str(tmp_path / "nvme"), "chunk_numel": 1000}
        return zerort.initialize(hf_model("gpt2"), {"stage": 2, "comm": {"backend": "inprocess"},
                                                    "offload": {"optimizer": optimizer}})

    def states(e):
        return {f"{k}:{n}": (safe_get_full_fp32_param(p) if k == "master" else safe_get_full_optimizer_state(p, k))
                for n, p in e.module.named_parameters() for k in ("master", "exp_avg", "exp_avg_sq")}

    saved = engine("nvme", 1234)
    for step in range(2):
        x, y = batch("gpt2", step, 0, 0)
        saved.backward(loss_fn("gpt2", saved(x), y))
        saved.step()
    saved.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    assert not [f for f in os.listdir(tmp_path / "ckpt" / "t") if f.startswith(".")]  # no scratch file left
    want = states(saved)
    saved.destroy()
    for tier in ("none", "nvme"):
        loaded = engine(tier, 99)
        loaded.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        got = states(loaded)
        assert all(torch.equal(got[k], want[k]) for k in want), tier
        loaded.destroy()


def test_gradient_on_device_is_read_in_both_forms_and_refused_where_it_means_nothing():
    """offload_optimizer.gradient_on_device (zerort's own key; C++ Note [gradient on the device]): with device
    cpu or nvme only, not beside gradient_in_file, not with placement auto (auto picks it); the Engine takes it
    off memory only (a CPU model's offload cpu without overlap_step keeps its states in memory)."""
    import torch

    from zerort.config import native, parse
    from zerort.errors import ConfigError

    nvme = {"device": "nvme", "nvme_path": "/tmp"}
    cpu = torch.device("cpu")
    ours = parse({"stage": 2, "offload": {"optimizer": {**nvme, "gradient_on_device": True}}})
    assert ours.offload.optimizer.gradient_on_device and native.engine_options(ours, cpu).gradient_on_device
    ds = parse({"gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "gradient_on_device": True}}})
    assert ds.offload.optimizer.gradient_on_device and not native.engine_options(ds, cpu).gradient_on_device
    overlapped = parse({"stage": 3, "offload": {"optimizer": {"device": "cpu", "gradient_on_device": True,
                                                              "overlap_step": True}}})
    assert native.engine_options(overlapped, cpu).gradient_on_device  # the Engine's 'cpu' tier
    from zerort.config.offload import describe
    assert "the FP32 gradient shard on the model's device" in describe(ours, cpu)
    bad = {"zero_optimization.offload_optimizer.gradient_on_device: true with device 'none'":
           {"zero_optimization": {"stage": 2, "offload_optimizer": {"gradient_on_device": True}}},
           "offload.optimizer.gradient_on_device: true with gradient_in_file true":
           {"stage": 2, "offload": {"optimizer": {**nvme, "gradient_on_device": True, "gradient_in_file": True}}},
           "given with offload.optimizer.gradient_on_device true":
           {"stage": 2, "offload": {"placement": "auto", "optimizer": {"nvme_path": "/tmp",
                                                                       "gradient_on_device": True}}}}
    for words, cfg in bad.items():
        with pytest.raises(ConfigError) as e:
            parse(cfg)
        assert words in str(e.value), str(e.value)


def test_ram_fraction_is_read_in_both_forms_and_refused_where_it_means_nothing():
    """offload_optimizer.ram_fraction (zerort's own key): 0 to 1, with device nvme only, not beside
    gradient_in_file (the split keeps the gradient in RAM), and not with placement auto (auto picks it)."""
    from zerort.config import native, parse
    from zerort.errors import ConfigError

    nvme = {"device": "nvme", "nvme_path": "/tmp"}
    ours = parse({"stage": 2, "offload": {"optimizer": {**nvme, "ram_fraction": 0.25}}})
    assert ours.offload.optimizer.ram_fraction == 0.25 and native.nvme_options(ours).ram_fraction == 0.25
    ds = parse({"zero_optimization": {"stage": 3, "offload_optimizer": {**nvme, "ram_fraction": 1}}})
    assert ds.offload.optimizer.ram_fraction == 1
    bad = {"zero_optimization.offload_optimizer.ram_fraction: got 0.5 with device 'cpu'":
           {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ram_fraction": 0.5}}},
           "offload.optimizer.ram_fraction: got 0.5 with gradient_in_file true":
           {"stage": 2, "offload": {"optimizer": {**nvme, "ram_fraction": 0.5, "gradient_in_file": True}}},
           "offload.optimizer.ram_fraction": {"stage": 2, "offload": {"optimizer": {**nvme, "ram_fraction": 1.5}}},
           "given with offload.optimizer.ram_fraction 0.5":
           {"stage": 2, "offload": {"placement": "auto", "optimizer": {"nvme_path": "/tmp", "ram_fraction": 0.5}}}}
    for words, cfg in bad.items():
        with pytest.raises(ConfigError) as e:
            parse(cfg)
        assert words in str(e.value), (words, str(e.value))
