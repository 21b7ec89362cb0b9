"""zerort.integrations.hf.Trainer against the stock transformers.Trainer (hf_trainer_worker.py).

One torchrun launch at W = 2 trains GPT2 and Llama (small configs, no downloads) at
stages 1-3 with zerort.integrations.hf.Trainer, saves and resumes, saves the model, evaluates and
generates at stage 3; one process at W = 1 then runs the stock Trainer on the same windows
(global batch 8), reads the saved models back with from_pretrained, and resumes W = 2's
checkpoint at W = 1.

Tolerance: both sides run FP32 with the same samples per window; they differ in how the
gradient sum over ranks and micro-batches is rounded. Measured: loss 4.8e-7 absolute
(1e-7 relative), grad_norm 1.3e-7 relative, the lr exactly (one step later: see close());
bound 1e-5 relative. A resume
at the same world size is compared bit for bit.
"""
import csv
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")  # transformers' Trainer needs it (requirements.txt pins it)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_trainer_worker as worker  # noqa: E402

from zerort._testing.launch import launch  # noqa: E402

REL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_trainer")
    work = str(tmp / "work")
    script = os.path.join(HERE, "hf_trainer_worker.py")
    launch("torchrun", 2, script, "zerort", tmp / "w2", work, timeout=400)
    launch("alone", 1, script, "stock", tmp / "w1", work, timeout=400)
    out = {}
    for side in ("w2", "w1"):
        with open(tmp / f"{side}.json") as f:
            out[side] = json.load(f)
        out[side + "_weights"] = torch.load(tmp / f"{side}.pt")
    out["work"] = work
    return out


def close(a, b, what, lr_shift=1):
    """Log a against log b. zerort logs the lr after each update, as HuggingFace's DeepSpeed
    integration does; the stock Trainer the one the update used. So with a schedule stepped
    per update, zerort's lr at step k is stock's at step k + 1 (lr_shift=1); with one stepped
    by evaluations, or two zerort logs, the same step's (lr_shift=0)."""
    assert len(a) == len(b) > 0, what
    for k, (x, y) in enumerate(zip(a, b)):
        assert x["step"] == y["step"], what
        assert x["loss"] == pytest.approx(y["loss"], rel=REL), (what, x, y)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=REL), (what, x, y)
        if k + lr_shift < len(b):  # the stock log has no next lr for its last step
            want = b[k + lr_shift]["learning_rate"]
            assert x["learning_rate"] == pytest.approx(want, rel=1e-12, abs=1e-15), (what, x, want)


@pytest.mark.parametrize("model", worker.MODELS)
@pytest.mark.parametrize("stage", worker.STAGES)
def test_logged_values_match_the_stock_trainer(runs, model, stage):
    zerort_log, stock_log = runs["w2"]["parity"][f"{model}:{stage}"], runs["w1"]["parity"][model]
    assert len(stock_log) == worker.PARITY_STEPS
    close(zerort_log, stock_log, f"{model} stage {stage}")


@pytest.mark.parametrize("case", ["epochs:gpt2:0", "epochs:llama:2"])
def test_several_epochs_with_a_short_last_window_match_the_stock_trainer(runs, case):
    stock = runs["w1"][case]
    assert len(stock) == 12  # 2 epochs of 5 full windows and one of half the micro-batches
    close(runs["w2"][case], stock, case)


def test_reduce_lr_on_plateau_follows_the_evaluations_as_in_the_stock_trainer(runs):
    ours, stock = runs["w2"]["plateau"], runs["w1"]["plateau"]
    assert len({h["learning_rate"] for h in stock}) > 2  # the schedule did lower the lr
    close(ours, stock, "reduce_lr_on_plateau", lr_shift=0)


def test_load_best_model_at_end_rotation_predict_and_evaluate_match_the_stock_trainer(runs):
    ours, stock = runs["w2"]["best"], runs["w1"]["best"]
    close(ours["log"], stock["log"], "best-model run")
    assert ours["best"] == stock["best"] and ours["left"] == stock["left"] and len(ours["left"]) == 2
    for k in ("eval_before", "predict_loss", "predict_sum", "best_metric", "eval_after"):
        assert ours[k] == pytest.approx(stock[k], rel=REL), k
    assert ours["eval_after"] == pytest.approx(ours["best_metric"], rel=1e-6)  # the best model is the one loaded


def test_fp16_skipped_steps_do_not_advance_the_schedule(runs):
    """From a loss scale of 2**24 the first updates overflow: each is skipped (its grad_norm
    not finite), and the lr schedule counts only applied updates, as with DeepSpeed."""
    log, skipped = runs["w2"]["fp16"], runs["w2"]["fp16_skipped"]
    applied = [h for h in log if h["grad_norm"] is not None]
    assert skipped == len(log) - len(applied) and 0 < skipped < len(log) - 3
    total, warmup, lr = worker.STEPS + 6, 2, 2e-3
    schedule = lambda k: lr * k / warmup if k < warmup else lr * max(0.0, (total - k) / (total - warmup))
    for k, h in enumerate(applied):  # the k-th applied update ran at schedule step k; the next runs at k + 1
        assert h["learning_rate"] == pytest.approx(schedule(k + 1), rel=1e-12, abs=1e-15), (k, h)
    assert all(h["learning_rate"] == 0.0 for h in log[:log.index(applied[0])])  # schedule step 0, unchanged


def test_bf16_follows_the_fp32_stock_trainer(runs):
    """--bf16 reaches the engine through bf16.enabled "auto": the Llama at stage 3 computes in
    bf16 (a 0.4% rounding step), so it follows the FP32 stock run within the parity tests'
    per-step loss bound (1e-2 relative), and not within FP32's."""
    bf16, fp32 = runs["w2"]["bf16"], runs["w1"]["parity"]["llama"]
    assert [h["step"] for h in bf16] == [h["step"] for h in fp32]
    losses = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(bf16, fp32)]
    assert max(losses) < 1e-2 and max(losses) > 1e-6, losses


def test_resume_from_step_5_is_bit_exact(runs):
    straight, resumed = runs["w2"]["straight"], runs["w2"]["resumed"]
    assert [h["step"] for h in straight] == list(range(1, worker.STEPS + 1))
    assert resumed == straight  # steps 1-5 come back from trainer_state.json, 6-10 are trained again
    a, b = runs["w2_weights"]["straight"], runs["w2_weights"]["resumed"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_at_w1_and_stage_2_from_a_w2_stage_3_checkpoint(runs):
    close(runs["w1"]["resumed_w1"][worker.SAVE_AT:], runs["w2"]["straight"][worker.SAVE_AT:], "W = 1 resume",
          lr_shift=0)


def test_save_model_gives_the_fp32_master_exactly(runs):
    master, loaded = runs["w2_weights"]["straight"], runs["w1_weights"]["final"]
    assert runs["w1"]["final_dtype"] == "torch.float32"
    assert master.keys() == loaded.keys()
    for k in master:
        assert loaded[k].dtype == torch.float32 and torch.equal(master[k], loaded[k]), k


def test_checkpoints_leave_the_safetensors_out_when_deepspeeds_switch_says_so(runs):
    files = runs["w2"]["no_weights_checkpoint"]
    assert "latest" in files and "trainer_state.json" in files and "model.safetensors" not in files, files


def test_tied_weights_stay_tied(runs):
    master, loaded = runs["w2_weights"]["gpt2"], runs["w1_weights"]["gpt2"]
    assert runs["w1"]["gpt2_tied"]
    assert torch.equal(loaded["lm_head.weight"], master["transformer.wte.weight"])
    for k in master:
        assert torch.equal(master[k], loaded[k]), k


def test_evaluate_and_generate_at_stage_3(runs):
    assert runs["w2"]["eval_loss"] == pytest.approx(runs["w1"]["eval_loss"], rel=1e-6)
    assert runs["w2"]["generated"] == runs["w1"]["generated"]


def test_from_pretrained_builds_on_meta_and_loads_exactly(runs):
    assert runs["w2"]["lazy_meta"]
    lazy, master = runs["w2_weights"]["lazy"], runs["w2_weights"]["straight"]
    for k in master:
        assert torch.equal(lazy[k], master[k]), k


def test_the_monitor_writes_what_the_trainer_logged(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = os.path.join(runs["work"], "runs", "trainer")
    with open(os.path.join(job, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    logged = runs["w2"]["straight"]
    assert [int(r["step"]) for r in rows] == [h["step"] for h in logged]
    for r, h in zip(rows, logged):
        assert float(r["loss"]) == pytest.approx(h["loss"], rel=1e-6)  # the window's mean, not its 1/GAS parts
        assert float(r["grad_norm"]) == h["grad_norm"] and float(r["lr0"]) == h["learning_rate"]
        assert int(r["skipped"]) == 0 and float(r["tokens_per_s"]) > 0
    acc = EventAccumulator(job)
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [int(r["step"]) for r in rows]
    assert all(math.isclose(e.value, float(r["loss"]), rel_tol=1e-6) for e, r in zip(events, rows))
    png = os.path.join(runs["work"], "curve.png")
    p = subprocess.run([sys.executable, "-m", "zerort.monitoring.plot", job, "--out", png], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case under test is a machine without a GPU (where "
                    "accelerate without use_cpu sees one rank per process); this one has a GPU")
def test_ranks_that_accelerate_sees_as_alone_are_an_error(tmp_path):
    p = launch("torchrun", 2, os.path.join(HERE, "hf_trainer_worker.py"), "without_use_cpu", tmp_path / "o",
               tmp_path / "work", timeout=300, check=False)
    assert p.returncode != 0
    assert "zerort runs 2 ranks, the Trainer (accelerate) 1" in p.output and "use_cpu=True" in p.output, p.output
