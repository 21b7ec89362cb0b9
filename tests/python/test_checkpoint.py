"""Checkpoints in real processes: bit-exact resume, resharding, consolidation, bad input
and a kill during save."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import zerort
from zerort.state import consolidate
from zerort._testing.launch import environment, launch
from zerort.state.checkpoint import CheckpointError

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ckpt_worker.py")

pytestmark = pytest.mark.skipif(not zerort._C.with_mpi,
                                reason="MPI is optional at build time and this build has none; "
                                       "these tests run ranks under mpirun")


def mpirun(np_, *args):
    launch("mpirun", np_, WORKER, *args, timeout=300)


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_is_bit_exact_in_new_processes(tmp_path, stage):
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight.mkdir(), split.mkdir()
    mpirun(2, "train", straight, "transformer", stage, 8)  # 8 uninterrupted steps
    mpirun(2, "train", split, "transformer", stage, 5)     # 5 steps, save ...
    mpirun(2, "resume", split, "transformer", stage, 3)    # ... new processes: load, 3 more
    a, b = torch.load(straight / "train.pt"), torch.load(split / "resume.pt")
    assert a["global_step"] == b["global_step"] == 8 and a["scale"] == b["scale"]
    assert equal(a["master"], b["master"])


@pytest.fixture(scope="module")
def saved_w4(tmp_path_factory):
    d = tmp_path_factory.mktemp("w4")
    mpirun(4, "train", d, "transformer", 2, 4)
    return d


@pytest.mark.parametrize("world", [2, 3])
def test_reshard_from_4_ranks(saved_w4, tmp_path, world):
    shutil.copytree(saved_w4 / "ckpt", tmp_path / "src")
    mpirun(world, "reshard", tmp_path, "transformer", 2)
    saved = torch.load(saved_w4 / "train.pt")["master"]
    assert equal(torch.load(tmp_path / "full.pt"), saved)  # re-partitioned exactly
    # Adam's m and v too: consolidate both checkpoints with --adam and compare.
    for d in (saved_w4 / "ckpt", tmp_path / "dst"):
        consolidate.main([str(d), str(d / "all.safetensors"), "--safetensors", "--adam"])
    assert equal(load_file(saved_w4 / "ckpt" / "all.safetensors"), load_file(tmp_path / "dst" / "all.safetensors"))


def test_consolidation_round_trip(saved_w4, tmp_path):
    out = tmp_path / "full.pt"
    p = subprocess.run([sys.executable, "-m", "zerort.state.consolidate", str(saved_w4 / "ckpt"), str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    sd = torch.load(out)
    saved = torch.load(saved_w4 / "train.pt")["master"]
    from engine_models import make_model

    make_model("transformer").load_state_dict(sd)  # the original model takes it, strictly
    for k, v in saved.items():
        assert torch.equal(sd[k], v), k


def _broken_copy(saved_w4, tmp_path, damage):
    d = tmp_path / "ckpt"
    shutil.copytree(saved_w4 / "ckpt", d)
    tag = (d / "latest").read_text()
    damage(d / tag)
    return d


def _load(d):
    from engine_models import CONFIG, make_model

    e = zerort.initialize(make_model("transformer"), dict(CONFIG, stage=2, precision="fp16"),
                          comm=zerort.comm.init("inprocess"))
    return e.load_checkpoint(str(d))


def test_bad_checkpoints_name_the_file(saved_w4, tmp_path):
    d = _broken_copy(saved_w4, tmp_path / "a", lambda t: os.remove(t / "shard_00002.pt"))
    with pytest.raises(CheckpointError, match="missing shard file .*shard_00002.pt"):
        _load(d)

    def truncate(t):
        data = (t / "shard_00001.pt").read_bytes()
        (t / "shard_00001.pt").write_bytes(data[: len(data) // 2])
    d = _broken_copy(saved_w4, tmp_path / "b", truncate)
    with pytest.raises(CheckpointError, match="shard_00001.pt is truncated or corrupt"):
        _load(d)

    def flip(t):
        path = t / "shard_00003.pt"
        data = bytearray(path.read_bytes())
        payload = torch.load(path)
        needle = payload["tensors"]["exp_avg"].numpy().tobytes()[:64]
        i = bytes(data).find(needle)
        assert i > 0
        data[i + 3] ^= 0x40
        path.write_bytes(bytes(data))
    d = _broken_copy(saved_w4, tmp_path / "c", flip)
    with pytest.raises(CheckpointError, match="checksum mismatch in .*shard_00003.pt"):
        _load(d)

    # Checkpoint directories one level down, no `latest`: an error, not training from scratch
    with pytest.raises(CheckpointError, match="holds neither a 'latest' file nor a checkpoint folder"):
        _load(tmp_path)
    (tmp_path / "empty").mkdir()  # nothing saved here yet: nothing loaded, as DeepSpeed (rank 0 says so)
    assert _load(tmp_path / "empty") == (None, None)
    with pytest.raises(CheckpointError, match="not a zerort checkpoint directory"):
        zerort.state.metadata.read_meta(str(tmp_path))
    from engine_models import CONFIG, make_model

    e = zerort.initialize(make_model("mlp"), dict(CONFIG, stage=2, precision="fp16"),
                          comm=zerort.comm.init("inprocess"))
    with pytest.raises(CheckpointError, match="parameter 'fc1.weight' .* saved from another model"):
        e.load_checkpoint(str(saved_w4 / "ckpt"))


KILL_CHILD = r"""
import os, sys, time
sys.path.insert(0, {here!r})
import torch, zerort, zerort.state.files as files
from engine_models import CONFIG, batch, loss_fn, make_model
e = zerort.initialize(make_model("mlp"), dict(CONFIG, stage=2, precision="fp16"), comm=zerort.comm.init("inprocess"))
def step(i):
    x, y = batch("mlp", i, 0, 0); e.backward(loss_fn("mlp", e(x), y)); e.step()
step(0)
e.save_checkpoint({d!r}, tag="good")
torch.save(e.full_state_dict(master=True), {d!r} + "/good_master.pt")
step(1)
real = files.atomic_write
def slow(path, write, *args, **kwargs):  # the second save stops half-way through its first file
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(b"partial")
        f.flush()
    open({d!r} + "/in_save", "w").close()
    time.sleep(60)
files.atomic_write = slow
e.save_checkpoint({d!r}, tag={tag2!r})
"""


@pytest.mark.parametrize("tag2", ["bad", "good"])  # a new tag, and the same tag saved again
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path, tag2):
    d = str(tmp_path / "ckpt")
    child = subprocess.Popen([sys.executable, "-c", KILL_CHILD.format(here=HERE, d=d, tag2=tag2)], env=environment())
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(d, "in_save")):
        assert child.poll() is None and time.time() < deadline, "the child died before the save"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert open(os.path.join(d, "latest")).read() == "good"
    from engine_models import CONFIG, make_model

    e = zerort.initialize(make_model("mlp"), dict(CONFIG, stage=2, precision="fp16"),
                          comm=zerort.comm.init("inprocess"))
    assert e.load_checkpoint(d) == (os.path.join(d, "good"), {})
    assert equal(e.full_state_dict(master=True), torch.load(os.path.join(d, "good_master.pt")))


def test_frozen_parameters_and_buffers_round_trip(tmp_path):
    import torch.nn as nn

    def model(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))
        m[2].bias.requires_grad_(False)  # frozen
        return m

    cfg = {"stage": 3, "precision": "bf16", "comm": {"backend": "inprocess"}}
    a = zerort.initialize(model(0), cfg)
    a.backward(a(torch.randn(4, 5)).float().square().mean())  # BatchNorm updates its stats
    a.step()
    a.save_checkpoint(str(tmp_path))
    b = zerort.initialize(model(1), cfg)
    b.load_checkpoint(str(tmp_path))
    assert equal(a.full_state_dict(master=True), b.full_state_dict(master=True))
    out = tmp_path / "full.pt"
    consolidate.main([str(tmp_path), str(out)])
    sd = torch.load(out)
    assert sd["1.num_batches_tracked"].dtype == torch.int64
    model(2).load_state_dict(sd)
