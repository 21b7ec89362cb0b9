"""Checkpoints never destroy a user's files and never load a mix (issue 14).

The rank scenarios run in one launch per launcher (ckpt_worker.py safety: W = 2, stage 2
under mpirun, stage 3 under torchrun, comm timeout 30 s); each test below reads what
every rank recorded. Every launch and every in-process test checks that the files outside
the checkpoint directories are byte-identical before and after (tree_digest). A load or
save that must fail fails on every rank, naming the file, field or tag, well within the
collective timeout. The offline cases (consolidate's output, two jobs racing for one
directory) run without a launcher.
"""
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch

import zerort
from zerort.state import checkpoint as ck
from zerort.state import consolidate
from zerort._testing.launch import environment, launch
from zerort.state.checkpoint import CheckpointError

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ckpt_worker.py")
ENV = environment()
TIMEOUT = 30  # comm.timeout_s in the worker: every failure must come well before it
HANG = 300    # s: the whole launch; far above what it takes
needs_mpi = pytest.mark.skipif(not zerort._C.with_mpi, reason="MPI is optional at build time and this build has none")
STAGE = {"mpirun": 2, "torchrun": 3}


def tree_digest(root, skip=()):
    """SHA-256 over every entry under root (path, type, mode, link target, bytes), not
    following links and not descending into `skip`."""
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if os.path.join(folder, d) not in skip)
        for name in sorted(dirs + files):
            path = os.path.join(folder, name)
            st = os.lstat(path)
            h.update(f"{os.path.relpath(path, root)}\0{st.st_mode}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(path).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def user_files(base):
    """A user's folder next to the checkpoints: what a symlinked tag points at."""
    victim = base / "outside" / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "notes.txt").write_text("my data\n")
    (victim / "sub" / "weights.bin").write_bytes(os.urandom(4096))
    (base / "outside" / "step2").write_text("not a checkpoint")


def try_mount_tmpfs(path, options):
    """A small tmpfs at path (root, in a sandbox that allows it), or False."""
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    return p.returncode == 0


def unmount(path):
    subprocess.run(["umount", str(path)], capture_output=True)


@pytest.fixture(scope="module", params=[pytest.param("mpirun", marks=needs_mpi), "torchrun"])
def run(request, tmp_path_factory):
    """One launch of every rank scenario: (launcher, base dir, [rank 0's, rank 1's results])."""
    how = request.param
    base = tmp_path_factory.mktemp(f"safety_{how}")
    user_files(base)
    tmpfs = base / "tmpfs"
    mounted = try_mount_tmpfs(tmpfs, "size=2m")
    skip = {str(base / "ck"), str(base / "results"), str(tmpfs / "ck")}
    before = tree_digest(base, skip)
    try:
        p = launch(how, 2, WORKER, "safety", base, "mlp", STAGE[how], timeout=HANG, check=False)
        rc, out, took = p.returncode, p.output, p.seconds
        after = tree_digest(base, skip)
    finally:
        if mounted:
            unmount(tmpfs)
    assert rc == 0 and "CKPT WORKER OK rank 1/2" in out, out[-6000:]
    assert after == before, "files outside the checkpoint directories changed"
    results = [json.loads((base / "results" / f"{r}.json").read_text()) for r in range(2)]
    print(f"{how}: the launch took {took:.1f} s")
    return how, base, results, mounted


def failed_everywhere(results, key, *parts, rank0=()):
    """The scenario failed on both ranks with a CheckpointError whose text has every part
    (and on rank 0, which quotes rank 1's failure, the parts in rank0), long before the
    collective timeout. Returns rank 0's message."""
    for rank, res in enumerate(results):
        r = res[key]
        assert r["error"] is not None, f"{key}: rank {rank} did not fail: {r}"
        assert r["type"] == "CheckpointError", (key, rank, r)
        for part in parts + (rank0 if rank == 0 else ()):
            assert part in r["error"], f"{key}: rank {rank}: {part!r} not in: {r['error']}"
        assert r["took"] < TIMEOUT / 2, (key, rank, r["took"])
    return results[0][key]["error"]


def ok_everywhere(results, key):
    values = []
    for rank, res in enumerate(results):
        assert res[key]["error"] is None, f"{key}: rank {rank}: {res[key]}"
        values.append(res[key].get("value"))
    assert values[0] == values[1], (key, values)
    return values[0]


# ---- 1. a tag that is a symlink --------------------------------------------------------

def test_a_symlinked_tag_replaces_the_link_never_its_target(run):
    _, base, results, _ = run
    ok_everywhere(results, "link_out_save")  # ckpt/evil -> ../outside/victim: untouched (the fixture's hash)
    assert results[0]["link_out_kind"] == "directory"  # now a plain directory: its own save
    assert ok_everywhere(results, "link_out_load") == ["evil", 4]
    ok_everywhere(results, "best_save")  # ln -s step2 best; save best
    assert ok_everywhere(results, "step2_after") == ["step2", 2]  # step2's data is intact
    assert ok_everywhere(results, "best_after") == ["best", 4]
    ok_everywhere(results, "keep_save")  # ln -s step4 keep, then step4 saved again: keep follows the name
    assert ok_everywhere(results, "keep_load") == ["keep", 4]
    ok_everywhere(results, "best_again")
    hidden = results[0]["hidden"]  # a save leaves no hidden folder: what a tag named before goes
    assert [h for h in hidden if h != ck.LOCK_NAME] == [], hidden
    final = results[0]["final"]
    for name, target in final["links"].items():  # every tag names a folder that is there
        assert target in final["listing"], (name, target)
    assert (base / "outside" / "victim" / "notes.txt").read_text() == "my data\n"


# ---- 2. ranks that resolve different checkpoints -----------------------------------------

def test_ranks_that_see_different_checkpoints_fail_on_every_rank(run):
    _, _, results, _ = run
    msg = failed_everywhere(results, "views_tag", "the ranks resolved different tags", "rank 0: tag 'best'",
                            "rank 1: tag 'step2'", "storage that all ranks share")
    assert "on rank 0 of 2" in msg and "on rank 1 of 2" in results[1]["views_tag"]["error"]
    assert ok_everywhere(results, "views_same_copy") == ["step4", 4]  # a faithful copy per host loads
    ok_everywhere(results, "views_resave")
    failed_everywhere(results, "views_save", "the same tag 'step4' of different saves", "rank 0: tag 'step4', save ",
                      "rank 1: tag 'step4', save ")
    failed_everywhere(results, "views_missing", "ck/empty is not a zerort checkpoint directory",
                      rank0=("failed while reading the checkpoint's meta.json on rank 1 of 2 (this is rank 0)",))
    failed_everywhere(results, "views_damaged", "view2/step4/shard_00000.pt is truncated or corrupt",
                      rank0=("failed while checking the shards on rank 1 of 2",))
    assert results[0]["views_damaged_unchanged"] and results[1]["views_damaged_unchanged"]  # nothing half-loaded


# ---- 3. a shard of another save -----------------------------------------------------------

def test_a_shard_from_another_save_is_named_by_load_and_consolidate(run):
    _, _, results, _ = run
    failed_everywhere(results, "mixed_load", "mixed/step4/shard_00001.pt belongs to another save", "save id")
    c = results[0]["mixed_consolidate"]
    assert c["type"] == "CheckpointError" and "shard_00001.pt belongs to another save" in c["error"], c


# ---- 4. one tag rule at save and load -----------------------------------------------------

def test_bad_tags_are_rejected_at_save_naming_the_tag(run):
    from ckpt_worker import BAD_TAGS

    _, _, results, _ = run
    for i, tag in enumerate(BAD_TAGS):
        shown = repr(tag) if len(tag) < 50 else "'xxxxxxxxxx"
        failed_everywhere(results, f"bad_tag_{i}", f"checkpoint tag {shown}", "is not a plain name")
    failed_everywhere(results, "bad_tag_load", "checkpoint tag 'best '", "leading or trailing whitespace")
    failed_everywhere(results, "tags_differ", "the ranks passed different tags", "rank 0: 'mine0'", "rank 1: 'mine1'")
    assert results[0]["tags_left_nothing"] and results[1]["tags_left_nothing"]


# ---- 5. a save while another holds the directory ------------------------------------------

def test_a_save_while_another_holds_the_directory_fails_and_leaves_nothing(run):
    _, _, results, _ = run
    failed_everywhere(results, "locked_save", "another save is writing into this checkpoint directory",
                      ck.LOCK_NAME)
    assert results[0]["locked_left_nothing"] and results[1]["locked_left_nothing"]
    ok_everywhere(results, "unlocked_save")


# ---- 6. a full disk --------------------------------------------------------------------------

def test_a_full_disk_names_the_file_and_bytes_and_keeps_the_previous_checkpoint(run):
    _, _, results, _ = run
    failed_everywhere(results, "enospc_save", "no space left on device while writing", "/shard_00001.pt: it needs "
                      "about", "bytes", rank0=("failed while writing the shards on rank 1 of 2",))
    assert results[0]["enospc_left_nothing"] and results[1]["enospc_left_nothing"]
    assert ok_everywhere(results, "enospc_previous") == ["step5", 5]


def test_a_really_full_tmpfs(run):
    _, _, results, mounted = run
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root); the injected ENOSPC above covers the code path")
    ok_everywhere(results, "disk_first")
    failed_everywhere(results, "disk_full", "no space left on device while writing", "tmpfs/ck/.b.", "it needs about",
                      "are free there")
    assert results[0]["disk_left_nothing"] and results[1]["disk_left_nothing"]
    assert ok_everywhere(results, "disk_previous")[0] == "a"


# ---- 7. odd files ------------------------------------------------------------------------------

def test_odd_files_are_named_never_opened(run):
    _, _, results, _ = run
    failed_everywhere(results, "fifo_shard_rank1", "odd1/step5/shard_00001.pt is a FIFO (named pipe), not a regular "
                      "file", rank0=("on rank 1 of 2",))
    failed_everywhere(results, "fifo_meta", "odd2/step5/meta.json is a FIFO")
    failed_everywhere(results, "latest_dir", "odd3/latest is a directory, not a regular file")
    failed_everywhere(results, "tag_loop", "odd4/step5 is a symlink loop")
    failed_everywhere(results, "meta_dir", "odd5/step5/meta.json is a directory")
    failed_everywhere(results, "save_over_dir", "odd3/latest is a directory, not a regular file", "move it away")


# ---- without ranks: consolidate's output, two jobs racing -------------------------------------

@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    """A 1-rank checkpoint (in-process backend)."""
    from engine_models import CONFIG, batch, loss_fn, make_model

    d = tmp_path_factory.mktemp("small") / "ckpt"
    e = zerort.initialize(make_model("mlp"), dict(CONFIG, stage=2, precision="fp16"),
                          comm=zerort.comm.init("inprocess"))
    x, y = batch("mlp", 0, 0, 0)
    e.backward(loss_fn("mlp", e(x), y))
    e.step()
    e.save_checkpoint(str(d))
    return d


def consolidate_error(capsys, *argv):
    assert consolidate.main(list(map(str, argv))) == 2
    return capsys.readouterr().err


def test_consolidate_output_errors_name_the_output(small_ckpt, tmp_path, capsys):
    before = tree_digest(small_ckpt)
    err = consolidate_error(capsys, small_ckpt, tmp_path / "missing" / "full.pt")
    assert f"cannot write {tmp_path}/missing/full.pt: its folder {tmp_path}/missing does not exist" in err, err
    (tmp_path / "adir").mkdir()
    assert f"cannot write {tmp_path}/adir: it is a directory" in consolidate_error(capsys, small_ckpt,
                                                                                    tmp_path / "adir")
    ro = tmp_path / "ro"
    mounted = try_mount_tmpfs(ro, "ro,size=1m")  # root ignores file modes: a read-only file system
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("root ignores file modes and no read-only tmpfs can be mounted here")
        ro.chmod(0o555)
    try:
        for out in ("full.pt", "full.safetensors"):
            err = consolidate_error(capsys, small_ckpt, ro / out, *(["--safetensors"] if "safe" in out else []))
            assert f"cannot write {ro}/{out}: " in err and ("Read-only" in err or "Permission denied" in err), err
            assert ".tmp" not in err
        assert os.listdir(ro) == []
    finally:
        unmount(ro) if mounted else ro.chmod(0o755)
    assert tree_digest(small_ckpt) == before


def test_consolidate_on_a_full_disk_names_the_output_and_leaves_nothing(small_ckpt, tmp_path, capsys):
    from ckpt_worker import DiskFull

    before = tree_digest(small_ckpt)
    for out in ("full.pt", "full.safetensors"):
        with DiskFull(2000):
            err = consolidate_error(capsys, small_ckpt, tmp_path / out, *(["--safetensors"] if "safe" in out else []))
        assert f"no space left on device while writing {tmp_path}/{out}: it needs about" in err, err
    assert os.listdir(tmp_path) == []
    assert tree_digest(small_ckpt) == before


ATTEMPTS = 10
RACER = r"""
import os, sys, time
ATTEMPTS = {attempts}
sys.path.insert(0, {here!r})
import zerort
from engine_models import CONFIG, make_model
from zerort.state.checkpoint import CheckpointError
e = zerort.initialize(make_model("mlp"), dict(CONFIG, stage=2, precision="fp16"), comm=zerort.comm.init("inprocess"))
open({ready!r} + sys.argv[1], "w").close()
while len([n for n in os.listdir({start!r}) if n.startswith("ready")]) < 2:  # both jobs start together
    time.sleep(0.005)
ok = refused = 0
for attempt in range(ATTEMPTS):  # no retry: each attempt saves, or is refused by the lock
    try:
        e.save_checkpoint({d!r}, tag="shared")
        ok += 1
    except CheckpointError as err:
        assert "another save is writing into this checkpoint directory" in str(err), err
        refused += 1
print("RACER", ok, refused)
"""


def test_two_jobs_saving_one_tag_race_cleanly(tmp_path):
    """Two jobs save one tag into one directory, ATTEMPTS times each at once, with no retry:
    each attempt either saves or is refused with the lock's CheckpointError, at least one
    save lands, and what is left is one complete checkpoint with no orphans. (A refusal
    happening at all is test_a_save_while_another_holds_the_directory_fails_and_leaves_nothing's
    job, which holds the lock on purpose.)"""
    d = tmp_path / "ckpt"
    user_files(tmp_path)
    before = tree_digest(tmp_path / "outside")
    code = RACER.format(here=HERE, d=str(d), ready=str(tmp_path / "ready"), start=str(tmp_path), attempts=ATTEMPTS)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=HANG)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    counts = [tuple(map(int, o.split("RACER")[1].split())) for o in outs]
    print("racing saves (saved, refused) per job:", counts)
    assert all(ok + refused == ATTEMPTS for ok, refused in counts), counts
    assert sum(ok for ok, _ in counts) >= 1, counts
    names = sorted(os.listdir(d))
    hidden = [n for n in names if n.startswith(".") and n != ck.LOCK_NAME]
    assert names == sorted([ck.LOCK_NAME, "latest", "shared"]) and not hidden, names  # no orphans
    assert (d / "shared").is_dir() and not (d / "shared").is_symlink()
    from engine_models import CONFIG, make_model

    e = zerort.initialize(make_model("mlp"), dict(CONFIG, stage=2, precision="fp16"),
                          comm=zerort.comm.init("inprocess"))
    assert e.load_checkpoint(str(d)) == (os.path.join(str(d), "shared"), {})
    assert tree_digest(tmp_path / "outside") == before


def test_a_tag_is_checked_the_same_way_at_load(small_ckpt):
    """`latest` holding 'best ' (a hand edit) is rejected, not stripped to 'best'."""
    from zerort.state.metadata import check_tag

    assert check_tag("step4", "x") == "step4"
    for tag in ("best ", "a\nb", "\u2028", ".x", "x" * 201, "é" * 101, 4):
        with pytest.raises(CheckpointError, match="is not a plain name"):
            check_tag(tag, "here")
    check_tag("é" * 100, "here")  # 200 bytes
    latest = small_ckpt / "latest"
    saved = latest.read_bytes()
    try:
        latest.write_text("step1 \n")
        with pytest.raises(CheckpointError, match=r"latest: checkpoint tag 'step1 ' is not a plain name"):
            ck.read_meta(str(small_ckpt))
        latest.write_text("step1\n")  # one line break, as echo writes: fine
        assert ck.read_meta(str(small_ckpt))[0] == "step1"
    finally:
        latest.write_bytes(saved)


def test_format_1_checkpoints_are_named(small_ckpt, tmp_path):
    d = tmp_path / "old"
    shutil.copytree(small_ckpt, d, symlinks=True)
    meta_path = d / "step1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    for k in ("save_id", "shard_sha256", "sha256"):
        meta.pop(k)
    meta["format"] = "zerort-checkpoint-1"
    meta["sha256"] = ck.meta_digest(meta)
    meta_path.unlink()  # a file of the save's own folder (the copy's)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format 'zerort-checkpoint-1', which did not bind its shards"):
        ck.read_meta(str(d))
    meta = json.loads((small_ckpt / "step1" / "meta.json").read_text())  # a new save binds every shard
    shard = torch.load(small_ckpt / "step1" / "shard_00000.pt", weights_only=True)
    assert shard["meta"]["save_id"] == meta["save_id"] and shard["sha256"] == meta["shard_sha256"][0]
