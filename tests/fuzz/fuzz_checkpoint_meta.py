"""Fuzz target for the checkpoint loaders: corrupted meta.json, `latest` and shard files.

Every input either loads, or raises zerort.state.checkpoint.CheckpointError; any other exception
(KeyError, TypeError, IndexError, ...) is a bug in the parser. The deterministic corpus
(corpus() below, run by tests/python/test_checkpoint_fuzz.py) also requires each of its
damaged inputs to be rejected with a message naming the file and the field.

    python tests/fuzz/fuzz_checkpoint_meta.py [--seed-checkpoint DIR] [--iterations N]
    python tests/fuzz/fuzz_checkpoint_meta.py --atheris [libFuzzer options]   # coverage-guided, optional

Without a seed checkpoint, one is saved from a small model with the in-process backend.
An input is meta.json's bytes; with the first byte odd, a JSON object is re-signed (its
sha256 recomputed) so the mutation reaches the field checks behind the checksum, as a
hand-edited or wrongly written file would.
"""
import argparse
import json
import os
import random
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402

from checkpoint_fuzz_files import (exercise, fresh_copy, meta_path, one_input, read_meta_json,  # noqa: E402,F401
                                   rewrite_shard, tag_dir, write_bytes, write_meta_json)


# ---- the deterministic corpus -----------------------------------------------------------

def _meta_edit(fn, resign=True):
    def apply(ckpt):
        meta = read_meta_json(ckpt)
        fn(meta)
        write_meta_json(ckpt, meta, resign)
    return apply


def _meta_bytes(fn):
    def apply(ckpt):
        with open(meta_path(ckpt), "rb") as f:
            data = f.read()
        write_bytes(meta_path(ckpt), fn(data))
    return apply


def _shard_edit(rank, fn, resign=True):
    return lambda ckpt: rewrite_shard(ckpt, rank, fn, resign)


def _set(path, value):
    """meta edit: set meta[path[0]][path[1]]... = value (a missing path[-1] is added)."""
    def fn(meta):
        d = meta
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return fn


def _delete(path):
    def fn(meta):
        d = meta
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]
    return fn


def _swap_shards(ckpt):
    d = tag_dir(ckpt)
    a, b = os.path.join(d, "shard_00000.pt"), os.path.join(d, "shard_00001.pt")
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)


def corpus(seed):
    """[(name, apply(ckpt), [substrings the error must contain])] for a seed checkpoint saved
    by 2 ranks with at least one parameter split across both and one extra (buffer)."""
    meta = read_meta_json(seed)
    world, params = meta["world_size"], meta["params"]
    assert world == 2, "the corpus is written for a 2-rank seed checkpoint"
    split = next(n for n, i in params.items() if len(i["segments"]) >= 2)  # on both ranks
    seg0 = params[split]["segments"][0]
    other = next(n for n, i in params.items() if n != split and i["segments"] and i["segments"][0][0] == seg0[0])
    shape = params[split]["shape"]
    extra = meta["extras"][0]
    alias = next(iter(meta["aliases"]))
    P, M, S0, S1, L = (f"params['{split}']", "meta.json", "shard_00000.pt", "shard_00001.pt", "latest")
    cases = []

    def add(name, apply, *expect):
        cases.append((name, apply, list(expect)))

    # bytes of meta.json, not re-signed: the JSON decoder or the checksum rejects them
    add("empty meta.json", _meta_bytes(lambda d: b""), M, "truncated or corrupt")
    for frac in (0.01, 0.25, 0.5, 0.9, 0.999):
        add(f"meta.json truncated to {frac:.1%}", _meta_bytes(lambda d, f=frac: d[:max(1, int(len(d) * f))]), M)
    for frac in (0.02, 0.1, 0.3, 0.5, 0.7, 0.95):
        def flip(d, f=frac):
            b = bytearray(d)
            i = int(len(b) * f)
            b[i] ^= 0x01
            return bytes(b)
        add(f"meta.json byte flipped at {frac:.0%}", _meta_bytes(flip), M)
    add("meta.json not UTF-8", _meta_bytes(lambda d: d[:5] + b"\xff\xfe" + d[5:]), M, "corrupt")
    add("meta.json a JSON list", _meta_bytes(lambda d: b"[1, 2]"), M, "expected a JSON object")
    add("meta.json null", _meta_bytes(lambda d: b"null"), M)
    add("meta.json nested 100000 deep", _meta_bytes(lambda d: b"[" * 100000), M, "corrupt")
    add("meta.json a 5000-digit number", _meta_bytes(lambda d: b'{"world_size": ' + b"9" * 5000 + b"}"), M, "corrupt")
    add("value edited without re-signing", _meta_edit(_set(["stage"], 1), resign=False), M, "checksum mismatch")
    add("format of another version", _meta_edit(_set(["format"], "zerort-checkpoint-9")), M,
        "not zerort checkpoint metadata")
    # bad hashes
    add("sha256 missing", _meta_edit(_delete(["sha256"]), resign=False), M, "field sha256", "64 lowercase hex")
    add("sha256 a number", _meta_edit(_set(["sha256"], 12345), resign=False), M, "field sha256")
    add("sha256 too short", _meta_edit(_set(["sha256"], "abc123"), resign=False), M, "field sha256")
    add("sha256 upper case", _meta_edit(lambda m: m.update(sha256=m["sha256"].upper()), resign=False), M,
        "field sha256")
    add("sha256 of other contents", _meta_edit(_set(["sha256"], "0" * 64), resign=False), M, "checksum mismatch")
    # missing keys and wrong types at the top level (re-signed: past the checksum)
    for key in ("world_size", "stage", "precision", "config", "shards", "params", "aliases", "extras"):
        add(f"{key} missing", _meta_edit(_delete([key])), M, f"field {key}", "missing")
    for key, bad in (("world_size", "2"), ("world_size", True), ("world_size", 0), ("world_size", -2),
                     ("world_size", 2 ** 70), ("world_size", 2.0), ("stage", 4), ("stage", "3"), ("stage", None),
                     ("precision", "int8"), ("precision", 16), ("config", []), ("shards", "shard_00000.pt"),
                     ("params", []), ("params", None), ("aliases", ["x"]), ("extras", {"a": 1}), ("extras", "pos")):
        add(f"{key} = {bad!r}", _meta_edit(_set([key], bad)), M, f"field {key}")
    # wrong world size and shard lists
    add("world_size 1 with 2 shards", _meta_edit(_set(["world_size"], 1)), M, "field ")
    add("world_size 3 with 2 shards", _meta_edit(_set(["world_size"], 3)), M, "field shards", "3 file names")
    add("one shard listed", _meta_edit(_set(["shards"], ["shard_00000.pt"])), M, "field shards")
    add("shard name escapes the directory", _meta_edit(_set(["shards"], ["../shard_00000.pt", "shard_00001.pt"])),
        M, "field shards[0]", "plain file name")
    add("shard name absolute", _meta_edit(_set(["shards"], ["shard_00000.pt", "/etc/passwd"])), M, "field shards[1]")
    add("shard name not a string", _meta_edit(_set(["shards"], ["shard_00000.pt", 1])), M, "field shards[1]")
    add("the same shard twice", _meta_edit(_set(["shards"], ["shard_00000.pt", "shard_00000.pt"])), M, "distinct")
    add("shards listed in swapped order", _meta_edit(_set(["shards"], ["shard_00001.pt", "shard_00000.pt"])),
        S1, "field meta.rank", "swapped")
    # one parameter's record
    add("parameter record a list", _meta_edit(_set(["params", split], [1])), M, P)
    add("parameter name empty", _meta_edit(lambda m: m["params"].update({"": m["params"].pop(split)})), M,
        "field params")
    for key in ("shape", "dtype", "compute_dtype", "segments"):
        add(f"{key} missing", _meta_edit(_delete(["params", split, key])), M, f"{P}.{key}", "missing")
    for key, bad in (("shape", "37x24"), ("shape", [-1, 24]), ("shape", [37.0, 24]), ("shape", [True, 24]),
                     ("shape", [2 ** 40, 2 ** 40]), ("shape", [1] * 17), ("dtype", "float16"),
                     ("compute_dtype", "int8"), ("segments", None), ("segments", {"0": 1})):
        add(f"{key} = {bad!r}", _meta_edit(_set(["params", split, key], bad)), M, f"{P}.{key}")
    add("shape with one more row (numel mismatch)",
        _meta_edit(_set(["params", split, "shape"], [shape[0] + 1] + shape[1:])), M, f"{P}.segments", "cover")
    add("shape with one fewer row (numel mismatch)",
        _meta_edit(_set(["params", split, "shape"], [shape[0] - 1] + shape[1:])), M, f"{P}.segments",
        "covering exactly")
    add("no segments", _meta_edit(_set(["params", split, "segments"], [])), M, f"{P}.segments", "cover")
    seg = ["params", split, "segments", 0]
    for i, bad, what in ((0, 2, "rank"), (0, -1, "rank"), (0, "0", "rank"), (1, -5, "shard index"),
                         (2, -1, "parameter offset"), (3, 0, "length"), (3, -3, "length"), (3, 2 ** 60, "length"),
                         (1, 2.5, "shard index"), (3, None, "length")):
        add(f"segment {what} = {bad!r}", _meta_edit(_set(seg + [i], bad)), M, f"{P}.segments[0][{i}] ({what})")
    add("segment of 3 numbers", _meta_edit(_set(seg, seg0[:3])), M, f"{P}.segments[0]", "[rank, shard index")
    add("segment a string", _meta_edit(_set(seg, "0,0,0,1")), M, f"{P}.segments[0]")
    add("segment one element longer (overlap)", _meta_edit(_set(seg + [3], seg0[3] + 1)), M, f"{P}.segments", "overlap")
    add("segment one element shorter (gap)", _meta_edit(_set(seg + [3], seg0[3] - 1)), M, f"{P}.segments",
        "leaves elements")
    add("segment listed twice", _meta_edit(lambda m: m["params"][split]["segments"].append(list(seg0))), M,
        f"{P}.segments", "overlaps")
    add("segments overlapping another parameter's shard elements",
        _meta_edit(lambda m: m["params"][other]["segments"][0].__setitem__(1, seg0[1])), M, "no overlap with")
    add("segment index past the end of its shard", _meta_edit(_set(seg + [1], 10 ** 9)), S0, "tensors['master']",
        "at least")
    # aliases and extras
    add("alias of a missing parameter", _meta_edit(_set(["aliases", alias], "no.such.param")), M, f"aliases['{alias}']")
    add("parameter aliased to itself", _meta_edit(_set(["aliases", split], split)), M, f"aliases['{split}']")
    add("extra not a string", _meta_edit(lambda m: m["extras"].append(7)), M, "field extras[")
    add("extra listed twice", _meta_edit(lambda m: m["extras"].append(extra)), M, "distinct")
    add("extra named like a parameter", _meta_edit(lambda m: m["extras"].append(split)), M, "not also a parameter")
    add("extra not saved in shard 0", _meta_edit(lambda m: m["extras"].append("no.such.buffer")), S0,
        "tensors['extra::no.such.buffer']")
    add("saved extra not listed", _meta_edit(lambda m: m["extras"].remove(extra)), S0, f"extra::{extra}")
    # the `latest` file
    add("latest not UTF-8", lambda c: write_bytes(os.path.join(c, "latest"), b"\xff\xfe\x00"), L, "not UTF-8")
    add("latest points outside", lambda c: write_bytes(os.path.join(c, "latest"), b"../elsewhere"), L, "plain name")
    add("latest empty", lambda c: write_bytes(os.path.join(c, "latest"), b""), L, "plain name")
    add("latest with a trailing space", lambda c: write_bytes(os.path.join(c, "latest"), open(os.path.join(
        c, "latest"), "rb").read().strip() + b" \n"), L, "plain name", "whitespace")
    add("latest names a missing tag", lambda c: write_bytes(os.path.join(c, "latest"), b"step999"),
        "step999", "is missing")
    # shard files: structure, counters, tensors (re-signed unless said)
    add("shard files swapped", _swap_shards, S0, "field meta.rank", "swapped")
    add("shard from a 3-rank checkpoint", _shard_edit(1, lambda p: p["meta"].update(world_size=3)), S1,
        "field meta.world_size", "another number of ranks")
    add("shard rank a string", _shard_edit(0, lambda p: p["meta"].update(rank="0")), S0, "field meta.rank")
    add("shard meta missing", _shard_edit(0, lambda p: p.pop("meta")), S0, "field meta")
    add("shard tensors a list", _shard_edit(0, lambda p: p.update(tensors=[1])), S0, "field tensors")
    add("shard tensor not a tensor", _shard_edit(0, lambda p: p["tensors"].update(master=[1.0])), S0,
        "tensors['master']")
    add("shard sha256 a number", _shard_edit(0, lambda p: p.update(sha256=5), resign=False), S0, "field sha256")
    add("shard counters missing", _shard_edit(0, lambda p: p["meta"]["state"].pop("adam_steps")), S0,
        "meta.state.adam_steps", "missing")
    for key, bad in (("global_step", -1), ("global_step", 1.5), ("skipped_steps", "0"), ("adam_steps", 2 ** 70),
                     ("scale", float("nan")), ("scale", -1.0), ("scale", "1"), ("scale", float("inf"))):
        add(f"shard counter {key} = {bad!r}", _shard_edit(0, lambda p, k=key, b=bad: p["meta"]["state"].update({k: b})),
            S0, f"meta.state.{key}")
    add("shard state not an object", _shard_edit(1, lambda p: p["meta"].update(state=None)), S1, "meta.state")
    add("master missing", _shard_edit(0, lambda p: p["tensors"].pop("master")), S0, "tensors['master']", "missing")
    add("master shorter than its segments", _shard_edit(0, lambda p: p["tensors"].update(
        master=p["tensors"]["master"][:seg0[1] + 1].clone())), S0, "tensors['master']", "at least")
    add("exp_avg of another length", _shard_edit(1, lambda p: p["tensors"].update(
        exp_avg=torch.cat([p["tensors"]["exp_avg"], torch.zeros(3)]))), S1, "of one length")
    add("master in float16", _shard_edit(0, lambda p: p["tensors"].update(master=p["tensors"]["master"].half())),
        S0, "tensors['master']", "float32")
    add("master 2-D", _shard_edit(0, lambda p: p["tensors"].update(master=p["tensors"]["master"].reshape(1, -1))),
        S0, "tensors['master']", "1-D")
    add("extra tensor missing", _shard_edit(0, lambda p: p["tensors"].pop(f"extra::{extra}")), S0, f"extra::{extra}")
    add("shard tensor flipped, not re-signed", _shard_edit(1, lambda p: p["tensors"]["master"].__setitem__(0, 7.0),
                                                           resign=False), S1, "checksum mismatch")
    # the binding of shards to meta.json: a save id and each shard's SHA-256
    add("format 1 (shards not bound)", _meta_edit(_set(["format"], "zerort-checkpoint-1")), M, "zerort-checkpoint-1",
        "save the checkpoint again")
    for bad in (None, 5, "xyz", "0" * 15, "0" * 17, "A" * 16):
        add(f"save_id = {bad!r}", _meta_edit(_set(["save_id"], bad)), M, "field save_id", "16 lowercase hex")
    add("save_id missing", _meta_edit(_delete(["save_id"])), M, "field save_id", "missing")
    add("shard_sha256 missing", _meta_edit(_delete(["shard_sha256"])), M, "field shard_sha256", "missing")
    add("shard_sha256 one digest", _meta_edit(lambda m: m["shard_sha256"].pop()), M, "field shard_sha256",
        "one per shard")
    add("shard_sha256 a string", _meta_edit(_set(["shard_sha256"], "0" * 64)), M, "field shard_sha256", "a list")
    add("shard_sha256[1] too short", _meta_edit(_set(["shard_sha256", 1], "ab")), M, "field shard_sha256[1]")
    add("shard of another save (re-signed)", _shard_edit(1, lambda p: p["meta"].update(save_id="0123456789abcdef")),
        S1, "belongs to another save", "'0123456789abcdef'")
    add("shard rewritten after the save (re-signed)", _shard_edit(1, lambda p: p["tensors"]["master"].__setitem__(
        0, 7.0)), S1, "SHA-256", "records for rank 1's shard")
    add("save id in meta.json changed (re-signed)", _meta_edit(_set(["save_id"], "fedcba9876543210")), S0,
        "belongs to another save")
    add("shard digest in meta.json changed (re-signed)", _meta_edit(_set(["shard_sha256", 0], "1" * 64)), S0,
        "records for rank 0's shard")
    # odd files in a checkpoint's place: named, never opened (a FIFO would block), never 'missing'
    add("meta.json a directory", lambda c: _replace(meta_path(c), os.mkdir), M, "is a directory, not a regular file")
    add("meta.json a FIFO", lambda c: _replace(meta_path(c), os.mkfifo), M, "a FIFO")
    add("latest a directory", lambda c: _replace(os.path.join(c, L), os.mkdir), L, "is a directory")
    add("latest a FIFO", lambda c: _replace(os.path.join(c, L), os.mkfifo), L, "a FIFO")
    add("shard a FIFO", lambda c: _replace(os.path.join(tag_dir(c), S1), os.mkfifo), S1, "a FIFO")
    add("shard a directory", lambda c: _replace(os.path.join(tag_dir(c), S0), os.mkdir), S0, "a directory")
    add("meta.json a symlink loop", lambda c: _replace(meta_path(c), _loop), M, "a symlink loop")
    add("shard a symlink loop", lambda c: _replace(os.path.join(tag_dir(c), S1), _loop), S1, "a symlink loop")
    add("latest a symlink loop", lambda c: _replace(os.path.join(c, L), _loop), L, "a symlink loop")
    add("tag a symlink loop", _tag_loop, "a symlink loop")
    add("tag a dangling link", lambda c: _replace(tag_dir(c), lambda p: os.symlink(".gone", p)), "does not exist")
    add("tag a regular file", lambda c: _replace(tag_dir(c), lambda p: open(p, "w").close()), "not a directory")
    add("shard a dangling link", lambda c: _replace(os.path.join(tag_dir(c), S0), lambda p: os.symlink("gone", p)),
        S0, "does not exist")
    return cases


def _replace(path, make):
    """Removes the file, link or checkpoint directory at path (not what a link points to) and
    makes another thing there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)
    make(path)


def _loop(path):
    """path -> path.b -> path: a symlink loop."""
    os.symlink(os.path.basename(path) + ".b", path)
    os.symlink(os.path.basename(path), path + ".b")


def _tag_loop(ckpt):
    with open(os.path.join(ckpt, "latest")) as f:
        tag = f.read().strip()
    _replace(os.path.join(ckpt, tag), _loop)


NEUTRAL = [  # edits that change nothing a loader uses: the load must give the same values
    ("zerort_version changed", _meta_edit(_set(["zerort_version"], "99.0"))),
    ("saved config edited", _meta_edit(_set(["config", "lr"], 5.0))),
    ("meta.json without indentation", lambda c: write_bytes(meta_path(c), json.dumps(read_meta_json(c)).encode())),
    ("meta.json keys reordered", lambda c: write_bytes(meta_path(c), json.dumps(
        dict(reversed(list(read_meta_json(c).items()))), indent=3).encode())),
]


# ---- random mutations (no atheris needed) ------------------------------------------------

def mutate(data, rng):
    """A few random edits of meta.json's bytes, biased to JSON tokens."""
    b = bytearray(data)
    tokens = [b"0", b"-1", b"1e999", b"null", b"true", b"[]", b"{}", b'""', b"9" * 30, b'"x"', b",", b":", b"]", b"}"]
    for _ in range(rng.randint(1, 4)):
        op, i = rng.randrange(5), rng.randrange(len(b) + 1) if b else 0
        if op == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            del b[i:i + rng.randint(1, 16)]
        elif op == 2:
            b[i:i] = rng.choice(tokens)
        elif op == 3:  # replace a JSON number with a token
            j = next((k for k in range(i, len(b)) if chr(b[k]).isdigit()), None)
            if j is not None:
                end = j
                while end < len(b) and chr(b[end]).isdigit():
                    end += 1
                b[j:end] = rng.choice(tokens)
        else:
            b = b[:i]
    return bytes([rng.randrange(256)]) + bytes(b)


def make_seed_checkpoint(directory):
    """A 1-rank checkpoint of the tests' small transformer (in-process backend)."""
    import zerort
    from engine_models import CONFIG, batch, loss_fn, make_model

    e = zerort.initialize(make_model("transformer"), dict(CONFIG, stage=3, precision="bf16"),
                          comm=zerort.comm.init("inprocess"))
    x, y = batch("transformer", 0, 0, 0)
    e.backward(loss_fn("transformer", e(x), y))
    e.step()
    e.save_checkpoint(directory)
    return directory


def run_random(seed_ckpt, iterations, rng_seed=0):
    """(loaded, rejected) counts of random mutations; any other exception propagates."""
    rng = random.Random(rng_seed)
    with open(meta_path(seed_ckpt), "rb") as f:
        original = f.read()
    loaded = rejected = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = os.path.join(tmp, "ckpt")
        for _ in range(iterations):
            if one_input(seed_ckpt, work, mutate(original, rng)) is None:
                loaded += 1
            else:
                rejected += 1
    return loaded, rejected


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed-checkpoint", help="a checkpoint directory to mutate (default: a fresh 1-rank one)")
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--atheris", action="store_true", help="coverage-guided fuzzing with atheris (pip install atheris)")
    a, rest = ap.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        seed = a.seed_checkpoint or make_seed_checkpoint(os.path.join(tmp, "seed"))
        if a.atheris:
            import atheris

            work = os.path.join(tmp, "work")
            atheris.Setup([sys.argv[0]] + rest, lambda data: one_input(seed, work, data))
            atheris.Fuzz()
        loaded, rejected = run_random(seed, a.iterations)
        print(f"{a.iterations} mutated meta.json files: {loaded} loaded, {rejected} rejected with CheckpointError, "
              "no other exception")


if __name__ == "__main__":
    main()
