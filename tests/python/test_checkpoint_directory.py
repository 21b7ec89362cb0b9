"""A checkpoint's tag is a plain directory (issue 26, item 8d): no symlink for upload and
sync tools to mishandle, with the guarantees the links gave. A new tag is a rename; a tag
saved again is an atomic exchange of two names (renameat2 RENAME_EXCHANGE), or on a file
system without it two renames; either way the previous checkpoint stays whole until the
new one is complete, and nothing is left behind. A directory of the user's at the tag's
name is refused, and a link there (an older zerort's tag, or the user's) has only the link
replaced. One process, in-process backend."""
import os

import pytest
import torch
import torch.nn as nn

import zerort
from zerort.state import checkpoint as ck
from zerort.state import files

CFG = {"stage": 2, "precision": "bf16", "comm": {"backend": "inprocess"}}


@pytest.fixture
def engine():
    torch.manual_seed(0)
    e = zerort.initialize(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)), CFG)
    yield e
    e.destroy()


def train(e, steps=1):
    for _ in range(steps):
        e.backward(e(torch.randn(3, 4)).pow(2).mean())
        e.step()


def master(e):
    return {k: v.clone() for k, v in e.full_state_dict(master=True).items()}


def listing(d):
    return sorted(n for n in os.listdir(d) if n != ck.LOCK_NAME)


@pytest.mark.parametrize("atomic", [True, False], ids=["exchange", "two-renames"])
def test_a_tag_is_a_plain_directory_saved_again_in_place(engine, tmp_path, monkeypatch, atomic):
    if not atomic:
        monkeypatch.setattr(files, "exchange", lambda a, b: False)  # as on NFS
    d = str(tmp_path)
    train(engine)
    engine.save_checkpoint(d, tag="best")
    first = master(engine)
    train(engine, 2)
    engine.save_checkpoint(d, tag="best")  # over the first: exchanged, the first removed
    second = master(engine)
    path = os.path.join(d, "best")
    assert os.path.isdir(path) and not os.path.islink(path)
    assert listing(d) == ["best", "latest"]  # nothing hidden left behind
    engine.load_checkpoint(d)
    assert all(torch.equal(second[k], v) for k, v in master(engine).items())
    assert not all(torch.equal(first[k], v) for k, v in second.items())


def test_an_older_zerort_link_tag_becomes_a_directory_and_its_folder_goes(engine, tmp_path):
    d = str(tmp_path)
    train(engine)
    engine.save_checkpoint(d, tag="step1")
    os.rename(os.path.join(d, "step1"), os.path.join(d, ".step1.0123456789abcdef"))  # how older saves left it
    os.symlink(".step1.0123456789abcdef", os.path.join(d, "step1"))
    engine.save_checkpoint(d, tag="step1")
    assert os.path.isdir(os.path.join(d, "step1")) and not os.path.islink(os.path.join(d, "step1"))
    assert listing(d) == ["latest", "step1"]


def test_a_users_directory_at_the_tag_is_refused_and_kept(engine, tmp_path):
    d = tmp_path / "ckpt"
    (d / "mine").mkdir(parents=True)
    (d / "mine" / "notes.txt").write_text("my data\n")
    with pytest.raises(zerort.CheckpointError) as e:
        engine.save_checkpoint(str(d), tag="mine")
    assert "mine is a directory, not a checkpoint an earlier save published, or a link" in str(e.value)
    assert (d / "mine" / "notes.txt").read_text() == "my data\n"
    assert listing(d) == ["mine"]


def test_exchange_swaps_two_names_atomically(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "x").write_text("a")
    os.symlink("elsewhere", b)
    if not files.exchange(str(a), str(b)):
        pytest.skip("this file system has no RENAME_EXCHANGE")
    assert os.readlink(a) == "elsewhere" and (b / "x").read_text() == "a"
