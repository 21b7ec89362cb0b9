"""overlap_param_gather (C++ Note [overlapped parameter gather], zerort.engine.param_waits):
step() returns with each bucket's parameter all-gather in flight, and the next forward waits
for a bucket's gather just before the first module holding its parameters runs.

- The bits: every loss, FP32 master and working copy of a run with the overlap equals the
  run without it (stages 1 and 2, bf16 and fp16, accumulation 1 and 2, buckets of an odd
  size so that models span several; an MLP, a transformer and HuggingFace GPT-2, Llama and
  Qwen2 from small configs), at W = 2 under mpirun and W = 4 under torchrun with gloo. One
  case also against plain PyTorch (test_engine_parity's reference).
- The waits: at W = 2, after step() every bucket's gather is in flight; the embedding's
  forward waits for its own bucket only, the whole forward for all of them; a module's
  state_dict() and gathered_parameters() wait too; W = 1 gathers nothing, and stages 0 and 3
  never hold any.
"""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from engine_models import CONFIG, batch, loss_fn, make_model  # noqa: E402
from test_engine_parity import BOUND, STEPS, global_rel, launch, reference  # noqa: E402
from zerort._testing.launch import launch as launch_ranks  # noqa: E402

import zerort  # noqa: E402

CASES = [f"{m}:{s}:{p}:{gas}:3:bucket@{bucket}"
         for m, bucket in (("mlp", 61), ("transformer", 997), ("gpt2", 1999), ("llama", 2003), ("qwen2", 1999))
         for s in (1, 2) for p, gas in (("bf16", 1), ("fp16", 2))]
REFERENCE_CASE = f"mlp:2:bf16:1:{STEPS}:bucket@61"


def _same_bits(results, case):
    plain, overlapped = results[case], results[f"{case}:overlap"]
    assert plain["losses"] == overlapped["losses"], case
    for key in ("master", "params"):
        for name, t in plain[key].items():
            assert torch.equal(t, overlapped[key][name]), (case, key, name)


@pytest.mark.skipif(not zerort._C.with_mpi, reason="built without MPI")
def test_overlap_gives_the_same_bits_w2_mpirun(tmp_path):
    cases = CASES + [REFERENCE_CASE]
    ranks = launch("mpirun", 2, [c for case in cases for c in (case, f"{case}:overlap")], tmp_path)
    for r, res in enumerate(ranks):
        for case in cases:
            _same_bits(res, case)
    _, ref_state = reference(REFERENCE_CASE, 2)
    assert global_rel(ranks[0][f"{REFERENCE_CASE}:overlap"]["master"], ref_state) < BOUND[("mlp", STEPS)]


def test_overlap_gives_the_same_bits_w4_torchrun_gloo(tmp_path):
    cases = [c for c in CASES if c.split(":")[0] in ("mlp", "gpt2")]
    ranks = launch("torchrun", 4, [c for case in cases for c in (case, f"{case}:overlap")], tmp_path)
    for res in ranks:
        for case in cases:
            _same_bits(res, case)


def _engine(stage, name="gpt2"):
    cfg = dict(CONFIG, stage=stage, precision="bf16", reduce_bucket_numel=1999, overlap_param_gather=True)
    return zerort.initialize(make_model(name), cfg, comm=zerort.comm.init("inprocess"))


def _train_step(engine, step=0):
    x, y = batch("gpt2", step, 0, 0)
    engine.backward(loss_fn("gpt2", engine(x), y))
    engine.step()
    return x


@pytest.mark.parametrize("stage", [1, 2])
def test_forward_waits_for_each_bucket_as_its_module_runs(stage):
    """At W = 2 under torchrun (tests/python/overlap_waits_worker.py): after step() every bucket's
    gather is in flight; the embedding waits for its own, the forward for all, state_dict() and
    gathered_parameters() too. At W = 1 none is issued (C++ Note [W = 1 is local])."""
    out = launch_ranks("torchrun", 2, os.path.join(HERE, "overlap_waits_worker.py"), stage, timeout=300)
    assert out.output.count(f"the waits hold at stage {stage}") == 2, out.output[-3000:]
    engine = _engine(stage)
    _train_step(engine)
    assert engine.runtime.param_gathers_in_flight == []
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 3])
def test_stages_without_a_parameter_gather_hold_none(stage):
    engine = _engine(stage)
    assert not engine.runtime.overlaps_param_gather
    _train_step(engine)
    assert engine.runtime.param_gathers_in_flight == []
    engine.destroy()


def test_the_key_is_read_in_both_forms():
    from zerort.config import parse

    assert parse({"overlap_param_gather": True}).overlap_param_gather
    assert parse({"zero_optimization": {"stage": 2}, "zerort": {"overlap_param_gather": True}}).overlap_param_gather
    assert not parse({}).overlap_param_gather
    with pytest.raises(zerort.ConfigError, match="overlap_param_gather"):
        parse({"overlap_param_gather": "yes"})
