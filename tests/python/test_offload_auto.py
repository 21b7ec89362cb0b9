"""offload.placement "auto" (Note [auto placement], zerort.accounting.placement): the decision with
made-up budgets (fits on the device, spills to RAM, to NVMe, refused with the numbers; stages 1-3;
sizes 0 and odd, W not dividing them), the bytes it counts against the memory estimator's exact
layout, the H200 example's arithmetic, the budgets read from the machine, the config keys, and
end to end on a CPU model at W = 1 and 2: auto gives the bits of the concrete placement it
resolves to (offload_auto_worker.py)."""
import dataclasses
import json
import os
import sys

import pytest

from zerort.accounting import placement, placement_auto
from zerort.accounting.memory import count_groups, estimate_memory, state_numel
from zerort.accounting.nvme_tier import NvmeTier
from zerort.accounting.placement import Budgets, Shape
from zerort.config import parse
from zerort.config.offload import check_tier
from zerort.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
GB, GIB = 10 ** 9, 1 << 30
BIG = 1 << 50
CAND = {c.name: c for c in placement.CANDIDATES}


def shape(numel, stage, world=1, unit=None):
    """Small NVMe chunks (offload.optimizer.chunk_numel) and buckets, so the pool and the reduce scratch are
    small beside the state."""
    bucket = 1 << 18
    return Shape(count_groups(numel, stage, reduce_bucket_numel=bucket, unit_numel=unit), world, stage,
                 nvme=NvmeTier(3, 4096), reduce_bucket_numel=bucket)


def usable_to_budget(n):
    """The free bytes whose usable part (after the margin) is at least n."""
    return int((n + placement.MARGIN_BYTES) / (1 - placement.MARGIN_FRACTION)) + 2


def needs(s, cuda):
    """{candidate: {tier: bytes needed}}, each unsplit (nothing of nvme's records in RAM)."""
    return {c.name: {t: sum(b.values()) for t, b in placement.tier_bytes(s, c, cuda).items()}
            for c in placement.candidates(s.stage, cuda)}


def test_the_margin_is_ten_percent_and_a_gib_of_each_budget():
    b = Budgets(100 * GB, 50 * GB, 0)
    assert b.usable("device") == int(90 * GB) - GIB and b.usable("ram") == int(45 * GB) - GIB
    assert b.usable("nvme") == 0 and Budgets(GIB, GIB, GIB).usable("ram") == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_budget_picks_the_fastest_candidate_that_fits(stage):
    s = shape(3_000_017, stage, world=3, unit=400_009)  # odd sizes, W not dividing them
    n = needs(s, cuda=True)
    device_fits = Budgets(usable_to_budget(n["device"]["device"]), 0, 0)
    assert placement.choose(s, device_fits).candidate.name == "device"
    # One byte less of the device: master, m and v spill to host RAM (the step on the CPU), the gradient
    # stays (C++ Note [gradient on the device]).
    short = Budgets(usable_to_budget(n["device"]["device"]) - 10, usable_to_budget(n["cpu dev-grad"]["ram"]), 0)
    assert placement.choose(s, short).candidate.name == "cpu dev-grad"
    # A device without room for the gradient: it goes to RAM as well.
    assert n["cpu"]["device"] < n["cpu dev-grad"]["device"] and n["cpu"]["ram"] > n["cpu dev-grad"]["ram"]
    no_grad = Budgets(usable_to_budget(n["cpu dev-grad"]["device"]) - 10, usable_to_budget(n["cpu"]["ram"]), 0)
    assert placement.choose(s, no_grad).candidate.name == "cpu"
    if stage == 3:  # a device that holds only the working buffers: the shards go to RAM too
        tight = Budgets(usable_to_budget(n["cpu+params"]["device"]), usable_to_budget(n["cpu+params"]["ram"]), 0)
        assert placement.choose(s, tight).candidate.name == "cpu+params"
    # RAM short as well, a disk: NVMe, where zerort builds it for the model (assumed here); the gradient on
    # the device where it has room, else in RAM.
    grad_there = Budgets(usable_to_budget(n["nvme dev-grad"]["device"]), usable_to_budget(n["nvme dev-grad"]["ram"]),
                         usable_to_budget(n["nvme dev-grad"]["nvme"]))
    assert placement.choose(s, grad_there).candidate == CAND["nvme dev-grad"]  # no room for a record: nothing split
    disk = Budgets(usable_to_budget(n["nvme"]["device"]), usable_to_budget(n["nvme"]["ram"]),
                   usable_to_budget(n["nvme"]["nvme"]))
    assert placement.choose(s, disk).candidate == CAND["nvme"]
    # Room for 5 records more: they stay in RAM (the split), and the disk holds 5 records less.
    record = s.nvme.record_bytes(4)
    split = Budgets(disk.device, usable_to_budget(n["nvme"]["ram"] + 5 * record + record // 2),
                    usable_to_budget(n["nvme"]["nvme"] - 5 * record))
    p = placement.choose(s, split)
    state = state_numel(s.groups, s.world_size, s.stage, s.reduce_bucket_numel)
    assert p.candidate.name == "nvme" and s.nvme.replace_fraction(p.candidate.ram_fraction).ram_chunks(state) == 5
    assert p.host_need("ram") == n["nvme"]["ram"] + 5 * record and p.host_need("nvme") == n["nvme"]["nvme"] - 5 * record
    assert p.candidate.label.startswith("nvme ") and p.candidate.label.endswith("% ram")
    lean = Budgets(disk.device, usable_to_budget(n["nvme+grad"]["ram"]), usable_to_budget(n["nvme+grad"]["nvme"]))
    assert placement.choose(s, lean).candidate.name == "nvme+grad"


def test_a_cpu_model_has_one_memory_tier_and_spills_to_nvme():
    s = shape(1_000_003, 3, world=2, unit=99_991)
    n = needs(s, cuda=False)
    assert list(n) == ["device", "nvme", "nvme+grad", "nvme+params"]  # device = host RAM: no "cpu" tiers
    assert all(n[c]["device"] == 0 for c in n)
    assert placement.choose(s, Budgets(None, usable_to_budget(n["device"]["ram"]), 0)).candidate.name == "device"
    ram = usable_to_budget(n["nvme+params"]["ram"])
    assert ram < usable_to_budget(n["nvme+grad"]["ram"])
    chosen = placement.choose(s, Budgets(None, ram, BIG))
    assert chosen.candidate.name == "nvme+params"
    assert chosen.candidate.settings() == {"optimizer": "nvme", "param": "nvme", "gradient_in_file": True,
                                           "ram_fraction": 0.0, "gradient_on_device": False}


def test_stage_0_keeps_its_states_with_the_model():
    s = shape(5_001, 0)
    assert [c.name for c in placement.candidates(0, True)] == ["device"]
    with pytest.raises(ConfigError):
        placement.choose(s, Budgets(0, BIG, BIG))


@pytest.mark.parametrize("stage,world", [(1, 1), (2, 4), (3, 3)])
@pytest.mark.parametrize("numel", [0, 7, 1_000_001])
def test_the_bytes_are_the_exact_layouts(stage, world, numel):
    """On the device, every kind is the memory estimator's exact figure; off it, whole kinds move."""
    est = estimate_memory(numel, world, stage, unit_numel=max(1, numel // 5) if stage == 3 else None)["exact"]
    s = Shape(count_groups(numel, stage, unit_numel=max(1, numel // 5) if stage == 3 else None), world, stage)
    on = placement.tier_bytes(s, CAND["device"])
    for k in ("master", "adam_m", "adam_v", "grad_shard"):
        assert on["device"][k] == est[k]
    assert sum(on["device"].values()) == est["total"] and not any(on["ram"].values()) and not any(on["nvme"].values())
    cpu = placement.tier_bytes(s, CAND["cpu"])
    assert [cpu["ram"][k] for k in ("master", "adam_m", "adam_v", "grad_shard")] == \
        [est[k] for k in ("master", "adam_m", "adam_v", "grad_shard")]
    for name in ("cpu dev-grad", "nvme dev-grad"):  # the gradient on the device; no reduce scratch there
        dev_grad = placement.tier_bytes(s, CAND[name])
        assert dev_grad["device"]["grad_shard"] == est["grad_shard"] and dev_grad["ram"]["grad_shard"] == 0
        assert dev_grad["device"]["working"] == on["device"]["working"]
        piece = s.nvme.gradient_piece(name.startswith("nvme"))  # the host piece the step copies it down through
        assert dev_grad["ram"]["io"] == placement.tier_bytes(s, CAND[name.split()[0]])["ram"]["io"] + 4 * piece
    nvme = placement.tier_bytes(s, CAND["nvme+grad"])  # the file holds whole chunk records
    chunk = s.nvme.aligned(s.nvme.chunk_numel)
    records = -(-est["master"] // 4 // chunk) * chunk
    assert (nvme["nvme"]["master"], nvme["nvme"]["adam_m"]) == (4 * records, 4 * records)
    assert nvme["nvme"]["grad_shard"] == s.nvme.aligned(est["grad_shard"])


def test_a_bf16_master_and_bf16_moments_count_as_the_estimator_does():
    groups = count_groups(3_000_001, 2, reduce_bucket_numel=1 << 20)
    est = estimate_memory(3_000_001, 3, 2, reduce_bucket_numel=1 << 20, optimizer_state_dtype="bf16",
                          master_dtype="bf16")["exact"]
    on = placement.tier_bytes(Shape(groups, 3, 2, state_bytes=2, master_bytes=2, reduce_bucket_numel=1 << 20),
                              CAND["device"])["device"]
    assert [on[k] for k in ("master", "adam_m", "adam_v", "grad_shard")] == \
        [est[k] for k in ("master", "adam_m", "adam_v", "grad_shard")]


def test_what_zerort_does_not_build_is_passed_over():
    import torch

    c = parse({"stage": 3, "offload": {"placement": "auto", "optimizer": {"nvme_path": "/tmp"}},
               "optimizer": {"master_dtype": "bf16"}})
    built = placement_auto.builder(c, torch.device("cpu"))
    assert built(CAND["device"]) == "" and "bf16 master" in built(CAND["nvme"])
    on_gpu = placement_auto.builder(c, torch.device("cuda"))  # the Engine keeps a bf16 master in memory only
    assert all("bf16 master" in on_gpu(CAND[n]) for n in ("cpu", "cpu dev-grad", "cpu+params", "nvme dev-grad"))
    without_path = placement_auto.builder(parse({"stage": 3, "offload": "auto"}), torch.device("cpu"))
    assert without_path(CAND["nvme dev-grad"]) == "no nvme_path"


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.51, 1.0])
def test_only_nvme_splits_its_records_between_ram_and_the_file(fraction):
    """The nvme candidate's records split between RAM and the file as the store splits them (whole records,
    the same total); nothing else is split, and DeepSpeed's ratio (the rest on the device) stays refused."""
    import torch

    c = parse({"stage": 3, "offload": {"optimizer": {"device": "nvme", "nvme_path": "/tmp", "ratio": 0.5}}})
    with pytest.raises(ConfigError, match="partial NVMe offload with the rest on the model's device is not built"):
        check_tier(c, torch.device("cpu"))
    s = shape(2_000_003, 3, world=2, unit=300_007)
    state, record = state_numel(s.groups, s.world_size, s.stage, s.reduce_bucket_numel), s.nvme.record_bytes(4)
    chunks = s.nvme.chunks(state)
    for cand in placement.CANDIDATES:
        cand = dataclasses.replace(cand, ram_fraction=fraction if cand.split else 0.0)
        where = placement.tier_bytes(s, cand)
        split = cand.split and fraction > 0
        for kind in ("master", "adam_m", "adam_v", "params"):
            assert sum(1 for t in placement.TIERS if where[t][kind]) <= 1 + (split and kind != "params"), cand
        if cand.optimizer == "nvme":
            in_ram = int(cand.ram_fraction * chunks)
            assert sum(where[t][k] for t in ("ram", "nvme") for k in ("master", "adam_m", "adam_v")) == chunks * record
            assert where["ram"]["master"] * 3 == in_ram * record == \
                s.nvme.replace_fraction(cand.ram_fraction).ram_chunks(state) * record


def test_a_placement_that_cannot_fit_is_refused_with_the_numbers():
    s = shape(10 ** 9, 2)
    with pytest.raises(ConfigError) as e:
        placement.choose(s, Budgets(7 * GB, 16 * GB, 0), built=lambda c: "no nvme_path" if c.optimizer == "nvme"
                         else "")
    text = str(e.value)
    assert "no placement zerort builds fits 1,000,000,000 parameters at stage 2" in text
    assert "device 5.2 GB, ram 13.3 GB" in text  # 0.9 x budget - 1 GiB
    # 16 bytes a parameter of states and 2 of bf16 parameters; 18.0 - 5.2 = 12.8, 16.0 - 13.3 = 2.7; the gradient
    # on the device: 2 + 4 there, 12 in RAM
    assert "device: needs device 18.0 GB; short of device by 12.8 GB" in text
    assert "cpu dev-grad: needs device 6.0 GB, ram 12.0 GB; short of device by 0.8 GB" in text
    assert "cpu: needs device 2.0 GB, ram 16.0 GB; short of ram by 2.7 GB" in text
    assert "nvme: needs" in text and "no nvme_path" in text
    assert "give offload.optimizer.nvme_path" in text
    assert "the nearest is cpu dev-grad, short by 0.8 GB of device" in text


def test_ranks_on_one_host_share_its_ram_and_disk():
    s = shape(50_000_017, 2, world=4)
    n = needs(s, cuda=True)["cpu"]  # one rank's
    fits = Budgets(usable_to_budget(n["device"]), usable_to_budget(4 * n["ram"]), 0, ranks_per_host=4)
    assert placement.choose(s, fits).candidate.name == "cpu"
    with pytest.raises(ConfigError, match="short of ram"):
        placement.choose(s, Budgets(fits.device, fits.ram - 10, 0, ranks_per_host=4))


def test_the_h200_example(capsys):
    """13B Llama-shaped (40 x 5120, SwiGLU 13824, vocab 32000) on one H200 (139 GB), 120 GB of RAM and
    64 GiB of disk: about 18 bytes a parameter off the device. No whole-kind placement fits, nor the nvme
    tier split between RAM and the file with the gradient in RAM; with the gradient on the device (C++ Note
    [gradient on the device]) two thirds of the records fit RAM and the rest the disk (the CLI's table,
    docs/CONFIG.md)."""
    numel = placement_auto.llama_numel(40, 5120, 13824, 32000)
    assert numel == 13_015_864_320
    unit = 4 * 5120 ** 2 + 3 * 5120 * 13824 + 2 * 5120
    s = Shape(count_groups(numel, 3, unit_numel=unit), 1, 3)
    b = Budgets(139 * GB, 120 * GB, 64 * GIB)
    ps = {p.candidate.name: p for p in placement.evaluate(s, b)}
    assert b.usable("device") == int(0.9 * 139 * GB) - GIB and b.usable("nvme") == int(0.9 * 64 * GIB) - GIB
    off = ps["cpu+params"]  # 2 + 4 x 4 bytes a parameter in RAM, and the host buffer of a block's bf16 shard
    assert off.host_need("ram") - 18 * numel == off.bytes["ram"]["io"] == 2 * unit
    assert abs(ps["device"].bytes["device"]["master"] - 4 * numel) < 16 * 41
    assert ps["device"].short == {"device": ps["device"].host_need("device") - b.usable("device")}
    assert ps["cpu"].short.keys() == {"ram"} and ps["cpu dev-grad"].short.keys() == {"ram"}
    # The gradient in RAM: the split fills RAM to its usable line with records (a third of them), and the
    # disk is still short.
    record = s.nvme.record_bytes(4)
    assert ps["nvme"].short.keys() == {"nvme"} and 0.3 < ps["nvme"].candidate.ram_fraction < 0.4
    assert b.usable("ram") - record < ps["nvme"].host_need("ram") <= b.usable("ram")
    # The gradient on the device (4 bytes a parameter beside the 2 of the shards): two thirds in RAM, a third
    # on the disk, chosen.
    chosen = ps["nvme dev-grad"]
    assert chosen.chosen and [p.candidate.name for p in ps.values() if p.chosen] == ["nvme dev-grad"]
    assert 0.6 < chosen.candidate.ram_fraction < 0.7
    assert b.usable("ram") - record < chosen.host_need("ram") <= b.usable("ram")
    assert chosen.bytes["device"]["grad_shard"] == 4 * state_numel(s.groups, 1, 3)
    assert chosen.host_need("device") <= b.usable("device") and chosen.host_need("nvme") <= b.usable("nvme")
    assert placement_auto.main(["--llama", "40,5120,13824,32000", "--stage", "3", "--gpu-gb", "139", "--ram-gb",
                                "120", "--disk-gib", "64", "--nvme-path", "/tmp"]) == 0
    out = capsys.readouterr().out
    assert "13,015,864,320 parameters" in out and "up to 18." in out
    assert "placement auto: nvme dev-grad 68% ram (offload optimizer nvme" in out and "gradient_on_device true" in out
    assert placement_auto.main(["--params", "1e9", "--stage", "2", "--gpu-gb", "139", "--ram-gb", "120"]) == 0
    assert "placement auto: device" in capsys.readouterr().out
    # 8B: master, m and v fit RAM, the gradient the device: no disk. 10B: part of the records on the disk.
    assert placement_auto.main(["--params", "8e9", "--stage", "3", "--gpu-gb", "139", "--ram-gb", "120",
                                "--disk-gib", "64", "--nvme-path", "/tmp"]) == 0
    assert "placement auto: cpu dev-grad (" in capsys.readouterr().out
    assert placement_auto.main(["--params", "10e9", "--stage", "3", "--gpu-gb", "139", "--ram-gb", "120",
                                "--disk-gib", "64", "--nvme-path", "/tmp"]) == 0
    assert "placement auto: nvme dev-grad 88% ram" in capsys.readouterr().out
    # Refused when the disk is smaller still, with the line that says what a split would need.
    assert placement_auto.main(["--llama", "40,5120,13824,32000", "--stage", "3", "--gpu-gb", "139", "--ram-gb",
                                "120", "--disk-gib", "16", "--nvme-path", "/tmp"]) == 1
    out = capsys.readouterr().out
    assert "nvme+params: needs device 3.8 GB, ram 3.2 GB, nvme 234.3 GB; short of nvme by" in out
    assert "the tiers together:" in out


def test_budgets_read_from_the_machine(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:  10 kB\nMemAvailable:     123456 kB\n")
    assert placement_auto.mem_available(str(meminfo)) == 123456 * 1024
    st = os.statvfs(tmp_path)
    assert placement_auto.disk_free(str(tmp_path / "not" / "yet")) > 0
    assert abs(placement_auto.disk_free(str(tmp_path)) - st.f_bavail * st.f_frsize) < 1 << 26
    assert placement_auto.disk_free(None) == 0
    import torch

    monkeypatch.setenv(placement_auto.CAPS_ENV, "ram=5e6, disk=1000")
    b = placement_auto.measure(torch.device("cpu"), str(tmp_path))
    assert (b.device, b.ram, b.disk) == (None, 5_000_000, 1000)
    monkeypatch.setenv(placement_auto.CAPS_ENV, "rams=5")
    with pytest.raises(ConfigError, match=placement_auto.CAPS_ENV):
        placement_auto.measure(torch.device("cpu"), None)


def test_the_config_keys():
    assert parse({"offload": "auto"}).offload.placement == "auto"
    assert parse({"offload": {"placement": "auto", "optimizer": {"nvme_path": "/x"}}}).offload.placement == "auto"
    ds = parse({"zero_optimization": {"stage": 3}, "zerort": {"offload_placement": "auto"}})
    assert ds.offload.placement == "auto"
    with pytest.raises(ConfigError, match=r"offload placement 'auto': given with offload.optimizer.device 'cpu'"):
        parse({"offload": {"placement": "auto", "optimizer": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match="offload.placement"):
        parse({"offload": {"placement": "fast"}})


@pytest.mark.parametrize("stage,grad", [(2, "file"), (3, "file"), (3, "device")])
def test_the_memory_report_shows_a_manual_placement_per_tier(tmp_path, stage, grad):
    """A config's own tiers (placement manual) in the report: the file's bytes per kind add up to the memory
    estimator's file size, and the gradient and I/O buffers in RAM are its counters' (and the host buffer of
    the largest bucket's shard, which the allocator does not see)."""
    import torch

    import zerort

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 301), torch.nn.Tanh(), torch.nn.Linear(301, 5))
    engine = zerort.initialize(model, {"stage": stage, "reduce_bucket_numel": 5000, "offload": {"optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path), "chunk_numel": 4000, "buffer_count": 3,
        "gradient_in_file": grad == "file", "gradient_on_device": grad == "device"}}})
    try:
        engine.backward(engine(torch.randn(4, 37)).float().pow(2).mean())
        engine.step()
        report = engine.memory_report()
        table, d = report.table(), report.to_dict()["placement"]
        impl = engine.runtime  # the host buffer each bucket's new bf16 shard goes up through: the largest's
        host_out = 2 * max(b[2] for g in range(impl.num_groups) for b in impl.bucket_layout(g))
    finally:
        engine.destroy()
    if grad == "file":
        assert "placement manual: nvme+grad (offload optimizer nvme, param none, gradient_in_file true)" in table
        assert d["name"] == "nvme+grad" and not d["auto"]
    else:  # a CPU model's device is its RAM: the nvme candidate, with the host piece of a 4096-element chunk
        assert "gradient_on_device true" in table and d["name"] == "nvme" and d["settings"]["gradient_on_device"]
        assert report.measured["state_pool"] == 3 * 4096 * 12 + 4 * 4096
    assert sum(d["bytes"]["nvme"].values()) == report.tier["file_estimate"]
    assert d["bytes"]["ram"]["io"] == report.measured["state_pool"] + host_out
    assert d["bytes"]["ram"]["grad_shard"] == report.measured["grad_shard"]


def test_the_benchmark_runs_on_a_cpu_at_a_tiny_size(tmp_path):
    """bench/gpu_offload.py's smoke run: each zerort row trains, the same model and data give the same
    losses in every placement, and the table has every column."""
    import subprocess

    bench = os.path.join(HERE, "..", "..", "bench", "gpu_offload.py")
    p = subprocess.run([sys.executable, bench, "--device", "cpu", "--tiny", "--steps", "2", "--stage", "3", "--rows",
                        "gpu,nvme,auto,ds2", "--nvme-path", str(tmp_path), "--expect-decreasing"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in p.stdout.splitlines() if line.startswith("| ")}
    assert "step s median" in rows["row"] and "disk written GB" in rows["row"] and "compute idle" in rows["row"]
    losses = {r: rows[r].split(" | ")[-1] for r in ("zerort, states on the GPU", "zerort, offload nvme")}
    assert len(set(losses.values())) == 1, losses
    assert rows["zerort, placement auto (device)"].endswith(losses["zerort, offload nvme"])
    # No GPU: no GPU memory; the idle figure is the forward's wait for the overlapped update (the engine's).
    assert "% (engine) | n/a | " in rows["zerort, offload nvme"], rows["zerort, offload nvme"]
    # The DeepSpeed row runs where its venv is (make bench-ds); elsewhere (a fresh CI clone) it is
    # skipped with the reason, and nothing else may be.
    skips = [line for line in p.stdout.splitlines() if "skipped" in line]
    assert all(line.startswith("[ds2] skipped: ") and ("deepspeed does not import here" in line
                                                       or "run on a CUDA device" in line) for line in skips), skips
    assert not os.listdir(tmp_path) or all(not os.listdir(tmp_path / d) for d in os.listdir(tmp_path))


@pytest.mark.parametrize("world,stage,target", [(1, 1, "nvme"), (2, 2, "nvme+grad"), (2, 3, "nvme+params"),
                                                (2, 3, "nvme"), (2, 2, "nvme:3")])
def test_auto_gives_the_bits_of_the_placement_it_resolves_to(tmp_path, world, stage, target):
    from zerort._testing.launch import launch

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    launch("torchrun" if world > 1 else "alone", world, os.path.join(HERE, "offload_auto_worker.py"),
           tmp_path / "out", nvme, stage, target, timeout=600)
    with open(tmp_path / "out.json") as f:
        r = json.load(f)
    target, _, records = target.partition(":")
    assert r["chosen"] == target, r["need"]
    # nvme:K: K of its records in RAM, the rest in the file (the split); else none (record: 4096 x 12 bytes).
    assert r["ram_bytes"] == int(records or 0) * 4096 * 12 and r["label"].endswith("% ram") == bool(records), r
    settings = {c.name: c.settings() for c in placement.CANDIDATES}[target]
    assert r["resolved"] == [settings["optimizer"], settings["param"], settings["gradient_in_file"]]
    assert r["auto_losses"] == r["concrete_losses"] and r["same_states"]
    assert f"placement auto: {r['label']} (offload optimizer nvme" in r["report"]
    held = {line.split(":")[0].strip(): line for line in r["report"].splitlines() if line.startswith("  ")}
    assert "master" in held["nvme"] and ("s3 shards" in held["nvme"]) == (target == "nvme+params")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
