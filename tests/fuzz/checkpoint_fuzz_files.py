"""The files of a checkpoint as fuzz_checkpoint_meta.py edits and loads them: find, read,
rewrite (re-signed or not) meta.json and the shards, copy the seed checkpoint, and load
one input with every loader (a CheckpointError is the only failure allowed)."""
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

from zerort.state import consolidate  # noqa: E402
from zerort.state import files as checkpoint_files  # noqa: E402
from zerort.state.checkpoint import CheckpointError  # noqa: E402
from zerort.state.metadata import meta_digest  # noqa: E402


def tag_dir(ckpt):
    with open(os.path.join(ckpt, "latest")) as f:
        return os.path.join(ckpt, f.read().strip())


def meta_path(ckpt):
    return os.path.join(tag_dir(ckpt), "meta.json")


def read_meta_json(ckpt):
    with open(meta_path(ckpt)) as f:
        return json.load(f)


def write_meta_json(ckpt, meta, resign=True):
    meta = dict(meta)
    if resign:
        meta.pop("sha256", None)
        meta["sha256"] = meta_digest(meta)
    with open(meta_path(ckpt), "w") as f:
        json.dump(meta, f, indent=1)


def write_bytes(path, data):
    with open(path, "wb") as f:
        f.write(data)


def rewrite_shard(ckpt, rank, edit, resign=True):
    """Loads rank's shard payload, lets edit change it, re-signs it and writes it back."""
    path = os.path.join(tag_dir(ckpt), f"shard_{rank:05d}.pt")
    payload = torch.load(path, weights_only=True)
    payload["tensors"] = {k: v.clone() for k, v in payload["tensors"].items()}
    edit(payload)
    if resign:
        try:
            payload["sha256"] = checkpoint_files.shard_digest(payload["tensors"], payload["meta"])
        except (KeyError, TypeError, AttributeError, IndexError):
            pass  # the edit broke what the hash covers: keep the old one
    torch.save(payload, path)


def fresh_copy(seed, work):
    if os.path.exists(work):
        shutil.rmtree(work)
    shutil.copytree(seed, work, symlinks=True)
    return work


def exercise(ckpt):
    """Reads the checkpoint as the offline loader does: metadata, every shard, and every
    parameter assembled and streamed (zerort.state.consolidate)."""
    consolidate.consolidate(ckpt, os.path.join(ckpt, "fuzz_out.safetensors"), safetensors=True, adam=True)


def one_input(seed, work, data):
    """The fuzz step: data is meta.json (re-signed when data[0] is odd and it is a JSON
    object). Returns None (loaded) or the CheckpointError; anything else propagates."""
    fresh_copy(seed, work)
    resign, body = bool(data[:1] and data[0] & 1), data[1:]
    meta = None
    if resign:
        try:
            meta = json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError):
            meta = None
    if isinstance(meta, dict):
        write_meta_json(work, meta)
    else:
        write_bytes(meta_path(work), body)
    try:
        exercise(work)
    except CheckpointError as e:
        return e
    return None
