"""A DeepSpeed training script (ds_script.py: param groups, a WarmupDecayLR from the
config, accumulation 2, clipping, save_checkpoint with client_state, load_checkpoint) runs
under zerort with only its import changed, at stages 1-3, W = 2, under torchrun and
mpirun, and matches plain PyTorch: torch.optim.AdamW with the same param groups, the mean
gradient of the same micro-batches (each rank's share from torch's own
DistributedSampler), torch.nn.utils.clip_grad_norm_, and the lr of every update from
DeepSpeed's WarmupDecayLR formula written out here.

Tolerance: both sides compute in FP32 and differ only in the order of the gradient sums
(rank order vs one process) and the clip norm's. The largest difference of any master
weight after 6 updates is 6e-8 (bound 1e-6), except on the attention biases (c_attn.bias),
whose key part has a true gradient of zero (softmax ignores a constant added to every
key): its gradient is rounding noise, which Adam normalises into steps of up to lr, so
two roundings drift apart there. Measured 8.9e-6 there; bound 1e-4 (the worst case is
6 updates x lr 1e-2).
"""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ds_script  # noqa: E402

import zerort  # noqa: E402
from zerort._testing.launch import launch as launch_ranks  # noqa: E402

W, STAGES = 2, (1, 2, 3)
UPDATES = ds_script.SAMPLES // W // 2 // 2  # samples per rank / micro batch / accumulation
BOUND, NOISE_BOUND = 1e-6, 1e-4


def warmup_decay_lr(n, lo=1e-4, hi=1e-2, warmup=3, total=8):
    """DeepSpeed's WarmupDecayLR (linear warm-up) for Adam step n (1-based): the schedule
    is built at iteration -1 (min lr) and stepped after every update, so update n runs at
    iteration n - 2."""
    it = n - 2
    if it < 0:
        return lo
    if it < warmup:
        return lo + (hi - lo) * it / warmup
    return lo + (hi - lo) * max(0.0, (total - it) / max(1, total - warmup))


def reference():
    """Plain PyTorch: the same GPT-2, groups and micro-batches."""
    model, data = ds_script.model_and_data()
    groups = ds_script.param_groups(model, 0.1)
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    shares = [list(torch.utils.data.distributed.DistributedSampler(data, num_replicas=W, rank=r)) for r in range(W)]
    lrs, norms = [], []
    for n in range(1, UPDATES + 1):
        for g in opt.param_groups:
            g["lr"] = warmup_decay_lr(n)
        lrs.append([warmup_decay_lr(n)] * 2)
        for r in range(W):
            for micro in (2 * n - 2, 2 * n - 1):
                ids = data.tensors[0][shares[r][2 * micro:2 * micro + 2]]
                (model(ids, labels=ids).loss / (2 * W)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}, lrs, norms


def resume_at_world_one(work, saved_stage, stage, shares):
    """The W = 2 checkpoint loaded by one process at another stage, trained to the end on
    the same micro-batches (both ranks' shares, 4 per update)."""
    model, data = ds_script.model_and_data()
    cfg = dict(ds_script.config(stage), gradient_accumulation_steps=4, zerort={"comm": {"backend": "inprocess"}})
    engine = zerort.initialize(model, cfg, param_groups=ds_script.param_groups(model, 0.1))
    engine.load_checkpoint(os.path.join(work, f"stage{saved_stage}"))
    assert engine.global_steps == ds_script.SAVE_AT
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1, 0.0]
    lrs = []
    for n in range(ds_script.SAVE_AT + 1, UPDATES + 1):
        lrs.append(engine.get_lr())
        for r in range(W):
            for m in (2 * n - 2, 2 * n - 1):
                ids = data.tensors[0][shares[r][2 * m:2 * m + 2]]
                engine.backward(engine(ids, labels=ids).loss)
                engine.step()
    return lrs, engine.full_state_dict(master=True)


def launch(launcher, tmp_path):
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    p = launch_ranks(launcher, W, os.path.join(HERE, "ds_script.py"), out, work, ",".join(map(str, STAGES)),
                     timeout=400)
    return p.stdout, {s: torch.load(f"{out}.stage{s}.pt") for s in STAGES}, work


@pytest.fixture(scope="module")
def expected():
    return reference()


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_the_deepspeed_script_matches_plain_torch(launcher, expected, tmp_path):
    if launcher == "mpirun" and not zerort._C.with_mpi:
        pytest.skip("this build has no MPI; the mpirun case needs it")
    stdout, runs, work = launch(launcher, tmp_path)
    ref, ref_lrs, ref_norms = expected
    groups = ds_script.param_groups(ds_script.model_and_data()[0], 0.1)
    for stage, run in runs.items():
        where = f"{launcher} stage {stage}"
        assert sum(run["lrs"], []) == pytest.approx(sum(ref_lrs, []), rel=1e-12), where
        assert run["norms"] == pytest.approx(ref_norms, rel=1e-5), where
        assert run["full_grads"] == pytest.approx(ref_norms, rel=1e-5), where  # deepspeed.utils.safe_get_full_grad
        diffs = {k: (run["master"][k] - ref[k]).abs().max().item() for k in ref}
        noise = max(v for k, v in diffs.items() if k.endswith("attn.c_attn.bias"))
        worst, name = max((v, k) for k, v in diffs.items() if not k.endswith("attn.c_attn.bias"))
        print(f"{where}: max |zerort - torch| = {worst:.2e} ({name}; bound {BOUND:g}), {noise:.2e} on the "
              f"attention biases (bound {NOISE_BOUND:g})")
        assert worst < BOUND and noise < NOISE_BOUND, where
        assert (run["global_steps"], run["skipped_steps"]) == (UPDATES, 0), where
        assert run["global_samples"] == UPDATES * 2 * 2 * W, where
        assert run["groups"] == [len(g["params"]) for g in groups] and run["forwarded"] == ds_script.VOCAB, where
        # The checkpoint: client_state back, the schedule resumed mid-warm-up, the same result.
        assert run["client_state"] == {"updates": ds_script.SAVE_AT, "note": "mid-run"}, where
        assert os.path.basename(run["resumed_path"]) == f"step{ds_script.SAVE_AT}", where
        assert run["resumed_at"] == ds_script.SAVE_AT, where
        assert run["resumed_lrs"] == run["lrs"][ds_script.SAVE_AT:], where
        for k in ref:
            assert torch.equal(run["resumed_master"][k], run["master"][k]), (where, k)
        saved = run["saved16"]  # fp32 compute: the working copy is the master
        assert all(torch.equal(saved[k], run["master"][k]) for k in ref), where
        # Resharded: the W = 2 checkpoint at W = 1 and another stage, to the same weights.
        model, data = ds_script.model_and_data()
        shares = [list(torch.utils.data.distributed.DistributedSampler(data, num_replicas=W, rank=r))
                  for r in range(W)]
        lrs, master = resume_at_world_one(work, stage, STAGES[stage % len(STAGES)], shares)
        assert lrs == run["lrs"][ds_script.SAVE_AT:], where
        worst = max((master[k] - run["master"][k]).abs().max().item() for k in ref if not k.endswith("c_attn.bias"))
        assert worst < BOUND, (where, worst)
    # steps_per_print 2: DeepSpeed's progress line on rank 0, every second update.
    lines = [ln for ln in stdout.splitlines() if ln.startswith("[Rank 0] step=")]
    assert lines[0].startswith("[Rank 0] step=2, skipped=0, lr=[") and "mom=[(0.9, 0.95), (0.9, 0.95)]" in lines[0]
    per_stage = sum(n % 2 == 0 for n in range(1, UPDATES + 1)) + sum(n % 2 == 0 for n in range(ds_script.SAVE_AT + 1,
                                                                                          UPDATES + 1))
    assert len(lines) == len(STAGES) * per_stage, lines
