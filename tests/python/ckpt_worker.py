"""One rank of the checkpoint tests (under mpirun, or alone with the in-process backend).

    ckpt_worker.py MODE DIR MODEL STAGE [STEPS] [--shard-size S]
    MODE: train  - STEPS steps from scratch, then save DIR/final.pt (full master) and a checkpoint
          resume - load the checkpoint in DIR, STEPS more steps, save DIR/final.pt
          reshard - load the checkpoint in DIR/src, save DIR/full.pt (state right after loading),
                    one more step, save a new checkpoint in DIR/dst
          safety  - the scenarios of test_checkpoint_safety.py in one launch (comm timeout 30 s):
                    checkpoint directories under DIR/ck, the user's files in DIR/outside, a small
                    tmpfs at DIR/tmpfs when the test could mount one; writes DIR/results/<rank>.json
--shard-size S: hybrid sharding in groups of S ranks (shard_size).
"""
import errno
import fcntl
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

import zerort  # noqa: E402
from engine_models import CONFIG, batch, loss_fn, make_model  # noqa: E402


def train(engine, name, first, steps):
    for step in range(first, first + steps):
        x, y = batch(name, step, engine.rank, 0)
        engine.backward(loss_fn(name, engine(x), y))
        engine.step()


class DiskFull:
    """with DiskFull(n): every file zerort writes takes n bytes, then fails with ENOSPC, as
    on a full disk (None: no effect). Wraps the file under zerort.state.checkpoint's writer."""

    def __init__(self, limit):
        self.limit = limit

    def __enter__(self):
        from zerort.state.files import Sink

        self.real, limit = Sink.__init__, self.limit
        real = self.real

        class File:
            def __init__(self, f):
                self.f, self.n = f, 0

            def write(self, data):
                n = memoryview(data).nbytes
                if self.n + n > limit:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self.n += n
                return self.f.write(data)

            def flush(self):
                self.f.flush()

            def close(self):
                self.f.close()

        if limit is not None:
            Sink.__init__ = lambda sink, f: real(sink, File(f))
        return self

    def __exit__(self, *exc):
        from zerort.state.files import Sink

        Sink.__init__ = self.real


SAFETY_TIMEOUT = 30
BAD_TAGS = ["best ", " best", "a\nb", "tab\t", "", ".hidden", ".", "..", "a/b", "..\\x", "latest", "x" * 201,
            "bell\x07", "rtl\u202eoverride"]


def safety(engine, name, base):
    """Every scenario of test_checkpoint_safety.py; returns {scenario: {"error", "type",
    "took", "value"}} for this rank. Files are set up by rank 0 between barriers."""
    from zerort.state import checkpoint as ck
    from zerort.state import consolidate
    from zerort.layout.shard_map import read_state

    comm, rank = engine.comm, engine.rank
    root = os.path.join(base, "ck")  # every checkpoint directory of this run
    D = os.path.join(root, "main")
    out = {}

    def attempt(key, fn):
        rec, t0 = {"error": None}, time.monotonic()
        try:
            rec["value"] = fn()
        except Exception as e:  # noqa: BLE001 - recorded, the test checks type and text
            rec.update(error=str(e), type=type(e).__name__)
        rec["took"] = time.monotonic() - t0
        out[key] = rec
        comm.barrier()  # every rank has cleaned up before the next scenario looks

    def on_rank0(fn):
        if rank == 0:
            fn()
        comm.barrier()

    def loaded(directory, tag=None):
        return [os.path.basename(engine.load_checkpoint(directory, tag)[0]), engine.global_step]

    def state():
        return [engine.global_step, float(read_state(engine, "master").double().sum())]

    def copy(src, dst, edit=None):
        def run():
            shutil.copytree(src, dst, symlinks=True)
            if edit:
                edit(dst)
        on_rank0(run)
        return dst

    def replace(path, make):
        if os.path.isdir(path) and not os.path.islink(path):  # a tag: a checkpoint's directory
            shutil.rmtree(path)
        else:
            os.unlink(path)
        make(path)

    def listing(d):
        return sorted(os.listdir(d))

    train(engine, name, 0, 2)
    engine.save_checkpoint(D)  # step2
    train(engine, name, 2, 2)
    engine.save_checkpoint(D)  # step4
    # 1. a tag that is a link: only the link is replaced
    on_rank0(lambda: os.symlink(os.path.join(base, "outside", "victim"), os.path.join(D, "evil")))
    attempt("link_out_save", lambda: os.path.basename(engine.save_checkpoint(D, "evil")))
    evil = os.path.join(D, "evil")
    out["link_out_kind"] = "link" if os.path.islink(evil) else "directory" if os.path.isdir(evil) else "other"
    attempt("link_out_load", lambda: loaded(D, "evil"))
    on_rank0(lambda: os.symlink("step2", os.path.join(D, "best")))  # ln -s step2 best
    attempt("best_save", lambda: os.path.basename(engine.save_checkpoint(D, "best")))
    attempt("step2_after", lambda: loaded(D, "step2"))
    attempt("best_after", lambda: loaded(D, "best"))
    on_rank0(lambda: os.symlink("step4", os.path.join(D, "keep")))  # ln -s step4 keep: a link by name
    attempt("keep_save", lambda: os.path.basename(engine.save_checkpoint(D, "step4")))  # `keep` follows the name
    attempt("keep_load", lambda: loaded(D, "keep"))
    attempt("best_again", lambda: os.path.basename(engine.save_checkpoint(D, "best")))  # drops its own old folder
    out["hidden"] = [n for n in listing(D) if n.startswith(".")]
    # 4. one tag rule, at save and at load
    before = listing(D)
    for i, tag in enumerate(BAD_TAGS):
        attempt(f"bad_tag_{i}", lambda tag=tag: engine.save_checkpoint(D, tag))
    attempt("bad_tag_load", lambda: loaded(D, "best "))
    attempt("tags_differ", lambda: engine.save_checkpoint(D, f"mine{rank}"))
    out["tags_left_nothing"] = listing(D) == before
    # 2. ranks that see different checkpoints (as hosts without shared storage would)
    V = copy(D, os.path.join(root, "view"), lambda d: open(os.path.join(d, "latest"), "w").write("step2"))
    attempt("views_tag", lambda: loaded(D if rank == 0 else V))
    attempt("views_same_copy", lambda: loaded(D if rank == 0 else V, "step4"))  # a faithful copy loads
    attempt("views_resave", lambda: os.path.basename(engine.save_checkpoint(D, "step4")))
    attempt("views_save", lambda: loaded(D if rank == 0 else V, "step4"))
    on_rank0(lambda: os.makedirs(os.path.join(root, "empty")))
    attempt("views_missing", lambda: loaded(D if rank == 0 else os.path.join(root, "empty")))

    def truncate(d):
        path = os.path.realpath(os.path.join(d, "step4", "shard_00000.pt"))
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    V2 = copy(D, os.path.join(root, "view2"), truncate)
    train(engine, name, 4, 1)
    before = state()
    attempt("views_damaged", lambda: loaded(D if rank == 0 else V2, "step4"))
    out["views_damaged_unchanged"] = state() == before
    # 3. a shard of another save
    M = copy(D, os.path.join(root, "mixed"), lambda d: shutil.copyfile(
        os.path.realpath(os.path.join(d, "step2", "shard_00001.pt")),
        os.path.realpath(os.path.join(d, "step4", "shard_00001.pt"))))
    attempt("mixed_load", lambda: loaded(M, "step4"))
    if rank == 0:
        attempt_local = {"error": None}
        try:
            consolidate.consolidate(M, os.path.join(M, "full.pt"), "step4")
        except Exception as e:  # noqa: BLE001
            attempt_local.update(error=str(e), type=type(e).__name__)
        out["mixed_consolidate"] = attempt_local
    comm.barrier()
    # 5. another save holds the directory's lock (another job, mid-save)
    if rank == 0:
        fd = os.open(os.path.join(D, ck.LOCK_NAME), os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
    comm.barrier()
    before = listing(D)
    attempt("locked_save", lambda: engine.save_checkpoint(D, "step5"))
    out["locked_left_nothing"] = listing(D) == before
    if rank == 0:
        os.close(fd)
    attempt("unlocked_save", lambda: os.path.basename(engine.save_checkpoint(D, "step5")))
    # 6. a full disk: rank 1's files take 1000 bytes, then ENOSPC
    with DiskFull(1000 if rank == 1 else None):
        before = listing(D)
        attempt("enospc_save", lambda: engine.save_checkpoint(D, "full"))
    out["enospc_left_nothing"] = listing(D) == before
    attempt("enospc_previous", lambda: loaded(D))
    tmpfs = os.path.join(base, "tmpfs")
    if os.path.ismount(tmpfs):  # a real full disk: a small tmpfs the test mounted
        T = os.path.join(tmpfs, "ck")
        attempt("disk_first", lambda: os.path.basename(engine.save_checkpoint(T, "a")))

        def fill():
            st = os.statvfs(T)
            room = os.path.getsize(os.path.join(T, "a", "shard_00000.pt")) // 2
            with open(os.path.join(T, "filler.bin"), "wb") as f:
                f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - room))
        on_rank0(fill)
        before = listing(T)
        attempt("disk_full", lambda: engine.save_checkpoint(T, "b"))
        out["disk_left_nothing"] = listing(T) == before
        attempt("disk_previous", lambda: loaded(T))
    # 7. odd files in a checkpoint's place (the tag in D/latest is step5)
    O1 = copy(D, os.path.join(root, "odd1"), lambda d: replace(os.path.join(d, "step5", "shard_00001.pt"), os.mkfifo))
    attempt("fifo_shard_rank1", lambda: loaded(D if rank == 0 else O1))
    O2 = copy(D, os.path.join(root, "odd2"), lambda d: replace(os.path.join(d, "step5", "meta.json"), os.mkfifo))
    attempt("fifo_meta", lambda: loaded(O2))
    O3 = copy(D, os.path.join(root, "odd3"), lambda d: replace(os.path.join(d, "latest"), os.mkdir))
    attempt("latest_dir", lambda: loaded(O3))

    def loop(d):
        replace(os.path.join(d, "step5"), lambda p: os.symlink("step5.b", p))
        os.symlink("step5", os.path.join(d, "step5.b"))
    O4 = copy(D, os.path.join(root, "odd4"), loop)
    attempt("tag_loop", lambda: loaded(O4))
    O5 = copy(D, os.path.join(root, "odd5"), lambda d: replace(os.path.join(d, "step5", "meta.json"), os.mkdir))
    attempt("meta_dir", lambda: loaded(O5))
    attempt("save_over_dir", lambda: engine.save_checkpoint(O3))  # `latest` is a directory: refused, nothing written
    out["final"] = {"listing": listing(D), "links": {n: os.readlink(os.path.join(D, n)) for n in listing(D)
                                                     if os.path.islink(os.path.join(D, n))}}
    return out


def main():
    args, cfg = sys.argv[1:], dict(CONFIG, precision="fp16")
    if "--shard-size" in args:
        i = args.index("--shard-size")
        cfg["shard_size"], args = int(args[i + 1]), args[:i] + args[i + 2:]
    mode, directory, name, cfg["stage"] = args[0], args[1], args[2], int(args[3])
    steps = int(args[4]) if len(args) > 4 else 0
    comm = zerort.comm.init("auto", timeout_s=SAFETY_TIMEOUT if mode == "safety" else 120)
    engine = zerort.initialize(make_model(name), cfg, comm=comm)
    if mode == "safety":
        results = safety(engine, name, directory)
        os.makedirs(os.path.join(directory, "results"), exist_ok=True)
        with open(os.path.join(directory, "results", f"{comm.rank}.json"), "w") as f:
            json.dump(results, f, indent=1)
    elif mode == "train":
        train(engine, name, 0, steps)
        engine.save_checkpoint(os.path.join(directory, "ckpt"))
    elif mode == "resume":
        engine.load_checkpoint(os.path.join(directory, "ckpt"))
        train(engine, name, engine.global_step, steps)
    elif mode == "reshard":
        engine.load_checkpoint(os.path.join(directory, "src"))
        full = engine.full_state_dict(master=True)
        if comm.rank == 0:
            torch.save(full, os.path.join(directory, "full.pt"))
        engine.save_checkpoint(os.path.join(directory, "dst"))
        train(engine, name, engine.global_step, 1)  # training goes on
    full = engine.full_state_dict(master=True)
    if comm.rank == 0 and mode not in ("reshard", "safety"):
        torch.save({"master": full, "global_step": engine.global_step, "scale": engine.loss_scale},
                   os.path.join(directory, f"{mode}.pt"))
    print(f"CKPT WORKER OK rank {comm.rank}/{comm.size}", flush=True)


if __name__ == "__main__":
    main()
