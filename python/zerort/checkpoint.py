"""Sharded checkpoints: every rank writes its own shard, rank 0 the metadata.

    engine.save_checkpoint("ckpt")             # ckpt/step<N>/shard_00000.pt ..., meta.json; ckpt/latest
    engine.load_checkpoint("ckpt")             # the tag in ckpt/latest; any world size

Each shard holds this rank's FP32 master, Adam m and v (and at stage 3 its low-precision
shard), the loss-scaler state and the step counters, with a SHA-256 of its tensors. The
metadata records, for every parameter, which rank holds which run of its elements at what
offset, so a checkpoint loads at another world size or stage: loading assembles each
parameter's FP32 master, m and v and writes the part this rank owns in the new layout.

Every file is written to a temporary name, fsync'ed and renamed; `latest` moves to a new
tag only after every rank has finished, behind a barrier, so a crash mid-save leaves the
previous checkpoint loadable.
"""
import hashlib
import json
import os
import shutil
import time

import torch

from .checkpoint_meta import (FORMAT, STATE_TENSORS, CheckpointError, check_shard_contents,  # noqa: F401
                              check_shard_payload, check_tag, meta_digest, read_meta)


# ---- files ------------------------------------------------------------------------------

def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path, write):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _digest(tensors, meta):
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        h.update(k.encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # hashes the (mapped) bytes in place
    return h.hexdigest()


def write_shard(path, tensors, meta):
    payload = {"format": FORMAT, "meta": meta, "tensors": tensors, "sha256": _digest(tensors, meta)}
    _atomic_write(path, lambda f: torch.save(payload, f))


def read_shard(path, rank, meta):
    """(tensors, meta) of rank's shard file, memory-mapped; checks its structure, checksum
    and agreement with the checkpoint's metadata (zerort.checkpoint_meta)."""
    if not os.path.exists(path):
        raise CheckpointError(f"missing shard file {path}: the checkpoint is incomplete or was "
                              "saved by more ranks than this directory holds")
    try:
        payload = torch.load(path, mmap=True, weights_only=True)
    except Exception as e:  # a truncated zip, or not a torch file at all
        raise CheckpointError(f"shard file {path} is truncated or corrupt ({type(e).__name__}: {e})") from None
    check_shard_payload(payload, path)
    try:
        digest = _digest(payload["tensors"], payload["meta"])
    except (TypeError, ValueError) as e:  # metadata that JSON cannot hold
        raise CheckpointError(f"shard file {path} is corrupt: its metadata cannot be hashed ({e})") from None
    if digest != payload["sha256"]:
        raise CheckpointError(f"checksum mismatch in {path}: the file was modified or damaged")
    check_shard_contents(payload, path, rank, meta)
    return payload["tensors"], payload["meta"]


# ---- where each parameter's elements live -----------------------------------------------

def _pieces(a, n, flat_offset, shard, opt_offset, world, replicated):
    """Runs [rank, master_index, param_offset, length] of flat elements [a, a+n) of a bucket
    starting at flat_offset with per-rank shards of `shard` elements."""
    if replicated:
        return [[0, opt_offset + (a - flat_offset), 0, n]] if n else []
    out, x = [], a
    while x < a + n:
        r = (x - flat_offset) // shard
        end = min(a + n, flat_offset + (r + 1) * shard)
        out.append([r, opt_offset + (x - flat_offset) - r * shard, x - a, end - x])
        x = end
    return out


def param_layout(engine):
    """{name: {"shape", "segments"}} for every trainable parameter of the engine."""
    from .stage3 import Stage3

    impl, w = engine._impl, engine.world_size
    where = {}  # id(param) -> segments
    if isinstance(impl, Stage3):
        for g in impl.groups:
            off = 0
            for p, n in zip(g.params, g.numels):
                where[id(p)] = _pieces(off, n, 0, g.shard, g.grad_off, w, False)
                off += n
    else:
        for gi, params in enumerate(engine._groups):
            buckets = impl.bucket_layout(gi) if params else []
            for i, p in enumerate(params):
                a = impl.param_offset(gi, i)
                f, padded, shard, opt = next(b for b in buckets if b[0] <= a < b[0] + b[1] or p.numel() == 0)
                where[id(p)] = _pieces(a, p.numel(), f, shard, opt, w, engine.config.stage == 0)
    out, seen = {}, set()
    for name, p in engine.module.named_parameters():
        if id(p) in where and id(p) not in seen:
            seen.add(id(p))
            out[name] = {"shape": list(engine._shapes[id(p)]), "dtype": "float32",  # the saved master
                         "compute_dtype": str(engine._working_dtype(p)).replace("torch.", ""),
                         "segments": where[id(p)]}
    return out


def _optimizer_tensors(engine):
    from .stage3 import Stage3

    impl = engine._impl
    if isinstance(impl, Stage3):
        return {"master": impl.opt.master, "exp_avg": impl.opt.exp_avg, "exp_avg_sq": impl.opt.exp_avg_sq}
    n = impl.num_groups
    return {"master": [impl.master(g) for g in range(n)], "exp_avg": [impl.exp_avg(g) for g in range(n)],
            "exp_avg_sq": [impl.exp_avg_sq(g) for g in range(n)]}


def _flat(t):
    return torch.cat([x.reshape(-1) for x in t]) if isinstance(t, list) else t.reshape(-1)


# ---- save / load -----------------------------------------------------------------------

def _collective_step(comm, what, fn):
    """Runs fn on every rank; if it fails on any rank, every rank raises (none is left
    waiting for the others in a barrier)."""
    error = None
    try:
        fn()
    except Exception as e:  # reported to every rank below
        error = e
    ok = torch.tensor([0 if error else 1], dtype=torch.int64)
    comm.all_reduce(ok, "min")
    if error is not None:
        raise error
    if ok.item() == 0:
        raise CheckpointError(f"{what} failed on another rank; see that rank's error")


def save(engine, directory, tag=None):
    """Writes into a fresh directory `.{tag}.{id}`; once complete, the name `tag` (a symlink)
    is switched to it atomically and `latest` updated. A crash at any point leaves `tag`
    and `latest` on the previous complete checkpoint."""
    from .config import to_dict
    from .stage3 import Stage3

    comm, rank = engine.comm, engine.rank
    tag = tag or f"step{engine.global_step}"
    check_tag(tag, directory)
    save_id = torch.tensor([time.time_ns() if rank == 0 else 0], dtype=torch.int64)
    comm.broadcast(save_id, 0)  # one fresh directory name on every rank
    work = os.path.join(directory, f".{tag}.{save_id.item()}")
    extras = {}  # rank 0: frozen parameters (FP32) and buffers, so the state_dict is complete

    def write_my_shard():
        os.makedirs(work, exist_ok=True)
        tensors = {k: _flat(v).clone() for k, v in _optimizer_tensors(engine).items()}
        if isinstance(engine._impl, Stage3):
            tensors["lp_shard"] = torch.cat([g.lp_slice.float() for g in engine._impl.groups])
        if rank == 0:
            extras.update(_extras(engine))
        tensors.update({f"extra::{k}": v for k, v in extras.items()})
        write_shard(os.path.join(work, f"shard_{rank:05d}.pt"), tensors,
                    {"rank": rank, "world_size": engine.world_size, "state": engine._impl.state()})

    def publish():
        if rank != 0:
            return
        meta = {"format": FORMAT, "zerort_version": _version(), "world_size": engine.world_size,
                "stage": engine.config.stage, "precision": engine.config.precision,
                "config": to_dict(engine.config), "params": param_layout(engine),
                "aliases": _aliases(engine), "extras": sorted(extras),
                "shards": [f"shard_{r:05d}.pt" for r in range(engine.world_size)]}
        meta["sha256"] = meta_digest(meta)
        _atomic_write(os.path.join(work, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        link = os.path.join(directory, tag)
        old = os.path.realpath(link) if os.path.islink(link) else None
        if os.path.exists(link) and not os.path.islink(link):
            raise CheckpointError(f"{link} exists and is not a zerort checkpoint link; choose another tag")
        tmp_link = os.path.join(directory, f".{tag}.link")
        if os.path.lexists(tmp_link):
            os.remove(tmp_link)
        os.symlink(os.path.basename(work), tmp_link)
        os.replace(tmp_link, link)  # atomic: `tag` now names the new, complete checkpoint
        _atomic_write(os.path.join(directory, "latest"), lambda f: f.write(tag.encode()))
        _fsync_dir(directory)
        if old and old != os.path.realpath(work):
            shutil.rmtree(old, ignore_errors=True)

    _collective_step(comm, f"writing a shard of checkpoint {tag!r}", write_my_shard)
    _collective_step(comm, f"publishing checkpoint {tag!r}", publish)
    return os.path.join(directory, tag)


def _aliases(engine):
    """Tied parameters: every state_dict name beyond the first, mapped to the first."""
    first, out = {}, {}
    trainable = {id(p) for p in engine._params}  # frozen tied names are all in the extras
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) not in trainable:
            continue
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _extras(engine):
    """State outside the optimizer: frozen parameters (their FP32 values) and buffers."""
    out = {}
    trainable = {id(p) for p in engine._params}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in trainable:
            continue
        if id(t) in engine._frozen_fp32:
            out[name] = engine._frozen_fp32[id(t)].clone()
        else:
            out[name] = t.detach().float().clone() if t.is_floating_point() else t.detach().clone()
    return out


def _restore_extras(engine, meta, tensors):
    """Frozen parameters and buffers: rank 0's saved values, in this engine's dtypes."""
    live = engine.module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in meta.get("extras", []):
            if name not in live:
                raise CheckpointError(f"checkpoint has state {name!r} that this model lacks: saved from another model")
            saved, t = tensors[f"extra::{name}"], live[name]
            if tuple(saved.shape) != tuple(t.shape):
                raise CheckpointError(f"{name!r} has shape {list(t.shape)} here but {list(saved.shape)} in the "
                                      "checkpoint: saved from another model")
            if id(t) in engine._frozen_fp32:
                engine._frozen_fp32[id(t)].copy_(saved)
            t.data.copy_(saved)  # cast to the working dtype


def _version():
    from . import __version__

    return __version__


class ShardReader:
    """Reads saved shards memory-mapped, one parameter's elements at a time, keeping only
    the shard in use mapped (the page cache keeps the others cheap to map again)."""

    def __init__(self, directory, tag, meta):
        self.dir = os.path.join(directory, tag)
        self.meta = meta
        self._rank, self._data = None, None
        self._verified = set()

    def shard(self, rank):
        if self._rank != rank:
            self._rank, self._data = None, None  # unmap the previous shard first
            path = os.path.join(self.dir, self.meta["shards"][rank])
            if rank in self._verified:
                payload = torch.load(path, mmap=True, weights_only=True)
                self._data = (payload["tensors"], payload["meta"])
            else:
                self._data = read_shard(path, rank, self.meta)
                self._verified.add(rank)
            self._rank = rank
        return self._data

    def check_all(self):
        """Every shard present, whole and matching its checksum, before anything changes."""
        for r in range(len(self.meta["shards"])):
            self.shard(r)

    def assemble(self, name, key):
        info = self.meta["params"][name]
        out = torch.empty(info["shape"]).reshape(-1)
        for rank, index, offset, length in info["segments"]:
            out[offset:offset + length] = self.shard(rank)[0][key][index:index + length]
        return out.reshape(info["shape"])


def load(engine, directory, tag=None):
    from .stage3 import Stage3

    tag, meta = read_meta(directory, tag)
    mine = param_layout(engine)
    saved = meta["params"]
    for name, info in mine.items():  # the same model: names and shapes
        if name not in saved:
            raise CheckpointError(f"parameter {name!r} of this model is not in checkpoint {directory}/{tag}: "
                                  "it was saved from another model")
        if saved[name]["shape"] != info["shape"]:
            raise CheckpointError(f"parameter {name!r} has shape {info['shape']} here but {saved[name]['shape']} "
                                  f"in checkpoint {directory}/{tag}: it was saved from another model")
    extra = sorted(set(saved) - set(mine))
    if extra:
        raise CheckpointError(f"checkpoint {directory}/{tag} has parameters this model lacks, first {extra[0]!r}")
    reader = ShardReader(directory, tag, meta)
    reader.check_all()  # every shard present, whole and intact before anything changes
    targets = {k: _flat(v) if not isinstance(v, list) else v for k, v in _optimizer_tensors(engine).items()}
    rank, stage0 = engine.rank, engine.config.stage == 0
    with torch.no_grad():
        for key in STATE_TENSORS:
            dest = targets[key]
            views = dest if isinstance(dest, list) else [dest]
            flat = torch.cat([v.reshape(-1) for v in views]) if len(views) > 1 else views[0].reshape(-1)
            for name, info in mine.items():
                full = reader.assemble(name, key).reshape(-1)
                for r, index, offset, length in info["segments"]:
                    if stage0 or r == rank:
                        flat[index:index + length] = full[offset:offset + length]
            if len(views) > 1:  # write back into each group's view
                off = 0
                for v in views:
                    v.reshape(-1).copy_(flat[off:off + v.numel()])
                    off += v.numel()
    _restore_extras(engine, meta, reader.shard(0)[0])
    engine._impl.load_state(reader.shard(0)[1]["state"])
    if isinstance(engine._impl, Stage3):
        engine._impl.refresh_from_master()
    else:
        engine._impl.refresh_params()
    engine.comm.barrier()
    return tag
