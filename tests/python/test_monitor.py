"""The training monitor (zerort.monitoring.monitor) under torchrun, W = 2: DeepSpeed's csv_monitor and
tensorboard keys; one CSV row and one TensorBoard point per optimizer step holding what the
engine reported (the step's stats, the lr after the update as DeepSpeed's monitor writes it,
the skip), the TensorBoard events read
back with the tensorboard package's own reader, and python -m zerort.monitoring.plot's PNG."""
import csv
import json
import math
import os
import subprocess
import sys

import pytest

from zerort._testing.launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))
W = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("monitor")
    out, run_dir = str(tmp / "seen.json"), str(tmp / "runs")
    launch("torchrun", W, os.path.join(HERE, "monitor_worker.py"), out, run_dir, timeout=300)
    with open(out) as f:
        seen = json.load(f)
    with open(os.path.join(run_dir, "job", "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    return seen, rows, os.path.join(run_dir, "job")


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12)


def test_one_csv_row_per_step_with_what_the_engine_reported(run):
    seen, rows, _ = run
    assert len(rows) == len(seen) == 6
    for r, s in zip(rows, seen):
        assert int(r["step"]) == s["step"]
        assert float(r["lr0"]) == pytest.approx(s["lr"][0], rel=1e-12)
        assert float(r["loss_scale"]) == s["loss_scale"] and same(float(r["grad_norm"]), s["grad_norm"])
        assert int(r["skipped"]) == s["skipped"] and int(r["nonfinite"]) == s["nonfinite"]
        assert int(r["skipped_steps"]) == s["skipped_steps"]
        assert float(r["tokens_per_s"]) > 0
        assert all(int(r[f"mem_peak_rank{k}"]) > 0 for k in range(W))
    assert [int(r["skipped"]) for r in rows] == [0, 0, 1, 0, 0, 0]
    assert math.isinf(float(rows[2]["loss"])) and all(0 < float(r["loss"]) < 10 for r in rows if r["skipped"] == "0")


def test_tensorboard_events_read_back_equal_the_csv(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, rows, job = run
    acc = EventAccumulator(job)
    acc.Reload()
    for key in ("loss", "lr0", "loss_scale", "grad_norm", "skipped", "tokens_per_s", "mem_peak_rank1"):
        events = acc.Scalars(f"train/{key}")
        assert [e.step for e in events] == [int(r["step"]) for r in rows], key
        for e, r in zip(events, rows):
            want = float(r[key])
            assert (math.isinf(want) and math.isinf(e.value)) or (math.isnan(want) and math.isnan(e.value)) or \
                e.value == pytest.approx(want, rel=1e-6), key


def test_the_plot_command_writes_a_png(run, tmp_path):
    _, _, job = run
    out = str(tmp_path / "curve.png")
    p = subprocess.run([sys.executable, "-m", "zerort.monitoring.plot", job, "--out", out], capture_output=True,
                       text=True, timeout=120, cwd=os.path.join(HERE, "..", "..", "python"))
    assert p.returncode == 0, p.stderr
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
