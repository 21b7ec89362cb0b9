"""Sharded checkpoints: every rank writes its own shard, rank 0 the metadata.

    engine.save_checkpoint("ckpt")             # ckpt/step<N>/shard_00000.pt ..., meta.json; ckpt/latest
    engine.load_checkpoint("ckpt")             # the tag in ckpt/latest; any world size

Each shard holds this rank's FP32 master, Adam m and v (FP32 on disk even when the moments
are kept in bf16), the loss-scaler state and the step counters, with a SHA-256 of its
tensors; rank 0's shard also holds the frozen parameters (FP32) and the buffers. With
shard_size, the first group's ranks write the shards and the checkpoint records a world of
shard_size ranks: the other groups hold the same state (C++ Note [hybrid sharding]). No
low-precision copy is written at any stage: a load casts the working weights from the
master (refresh_params). The
metadata records, for every parameter, which rank holds which run of its elements at what
offset, so a checkpoint loads at another world size or stage: loading assembles each
parameter's FP32 master, m and v and writes the part this rank owns in the new layout.

A save writes into a fresh hidden folder `.{tag}.{save id}` (every file to a temporary
name, fsync'ed and renamed); once every rank has finished, rank 0 gives that folder the
name `tag` and then updates `latest`, so a crash mid-save leaves the previous checkpoint
loadable. `tag` is a plain directory (no symlink: upload and sync tools mishandle them):
a rename when the tag is new, an atomic exchange of the two names (renameat2 with
RENAME_EXCHANGE) when it exists. On a file system without that exchange (NFS), two
renames: a crash between them leaves no `tag`, and the previous checkpoint whole at the
hidden name `.{tag}.{save id}.previous`. Rules:

- A save deletes only what it created: on failure, each rank removes the files it wrote
  and the hidden folder; after success, what `tag` named before, when an earlier save
  made it: a checkpoint directory (one with zerort's meta.json), or a hidden folder that a
  link `tag` of an older zerort named (unless another link in the directory names it). A
  tag that is a link to anything else (`ln -s step2 best`, a link out of the directory)
  has only the link replaced, never its target; a tag that is any other file or
  directory is refused.
- Rank 0 holds an exclusive lock (flock on `.zerort-save.lock` in the directory) for the
  whole save; a second save into the same directory meanwhile fails at once, on every
  rank, without writing anything. Every rank writes its shard into the folder by name, so
  the directory must be one that every rank sees (shared storage), or be copied whole.
- meta.json binds its shards: a random save id that every shard carries, and each shard's
  SHA-256. A load checks both, and checks collectively that every rank resolved the same
  tag of the same save; each step that can fail on one rank (resolving the tag, checking
  every shard, writing a shard, publishing) ends with an exchange of outcomes, so a failure
  is raised on every rank, naming the failing rank's file, never a hang in a collective.
  Nothing of the engine's state changes until every rank has checked every shard.
- A full disk names the file and the bytes it needs; the save's folder is removed.

The files themselves (atomic writes, shard files and their checksums, memory-mapped
reads) are zerort.state.files; what each parameter's segments are, zerort.layout.shard_map.
"""
import json
import os

import torch

from zerort import _C
from zerort.state.metadata import (FORMAT, SAVE_ID_DIGITS, STATE_TENSORS, CheckpointError,  # noqa: F401
                                   meta_digest, read_meta)
from zerort.state import directory as directory_names
from zerort.state import files
from zerort.state.directory import LOCK_NAME  # noqa: F401  (tests and tools name it from here)
from zerort.state import loop_state, state_io
from zerort.comm.agreement import gather_if_different, ranks_text
from zerort.layout.shard_map import param_layout



# ---- save / load -----------------------------------------------------------------------

class Steps:
    """Runs the steps of a save or a load on every rank. A step that may fail on some ranks
    only ends with an exchange of outcomes (one all-gather of a digest when they agree), so
    that a failure is raised on every rank: the failing rank raises its own error, the
    others a CheckpointError quoting it. None is left waiting in a collective."""

    def __init__(self, comm, what):
        self.comm, self.what = comm, what
        self.failed_together = False  # a step failed and every rank knows it

    def run(self, step, fn):
        result, error = None, None
        try:
            result = fn()
        except Exception as e:  # reported to every rank below
            error = e
        mine = "" if error is None else (str(error) if isinstance(error, CheckpointError)
                                         else f"{type(error).__name__}: {error}")[:4000]
        texts = gather_if_different(self.comm, mine.encode())
        if error is None and texts is None:
            return result
        self.failed_together = True
        if error is not None:
            raise error
        failed = {}
        for r, t in enumerate(texts):
            if t:
                failed.setdefault(t.decode("utf-8", "replace"), []).append(r)
        raise CheckpointError(f"{self.what} failed while {step} on {ranks_text(sum(failed.values(), []))} of "
                              f"{self.comm.size} (this is rank {self.comm.rank}): "
                              + "; ".join(f"{ranks_text(rs)}: {t}" for t, rs in failed.items()))


def _new_save_id(comm, rank):
    """64 random bits from rank 0, as 16 hex digits, on every rank."""
    x = torch.tensor([int.from_bytes(os.urandom(8), "little", signed=True) if rank == 0 else 0], dtype=torch.int64)
    comm.broadcast(x, 0)
    return f"{x.item() & (2 ** 64 - 1):0{SAVE_ID_DIGITS}x}"


NO_SHARD = "00" * 32  # the digest a rank that writes no shard (shard_size: groups after the first) sends


def _gather_digests(comm, digest):
    """Every rank's shard SHA-256 (hex), indexed by rank."""
    mine = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.int64)
    out = comm.all_gather(mine, torch.empty(comm.size * mine.numel(), dtype=torch.int64))
    raw = out.view(torch.uint8).view(comm.size, -1)
    return [bytes(raw[r].tolist()).hex() for r in range(comm.size)]


def save(engine, directory, tag=None, client_state=None, save_latest=True):
    """Writes into a fresh directory `.{tag}.{save id}`; once complete, it becomes the
    directory `tag` atomically and `latest` is updated (unless save_latest is
    false). A crash at any point leaves `tag` and `latest` on the previous complete
    checkpoint. client_state and the lr schedule's state go with it
    (zerort.state.loop_state). See the module docstring."""
    from zerort.config import to_dict

    comm, rank = engine.comm, engine.rank
    tag = f"step{engine.global_step}" if tag is None else tag
    steps = Steps(comm, f"save_checkpoint({directory!r}, tag={str(tag)[:100]!r})")
    lock, created, committed = [], [], [False]  # this rank's files, for the cleanup of a failed save
    work = None
    state_body = []  # rank 0: engine_state.pt's bytes

    def check():
        directory_names.prepare(directory, tag, rank, lock)
        if rank == 0:  # a client_state that cannot be saved fails here, on every rank
            state_body.append(loop_state.encode(engine, client_state))

    try:
        steps.run("checking the tag, the directory and client_state", check)
        texts = gather_if_different(comm, repr(tag).encode())  # every rank saves the same tag
        if texts is not None:
            raise CheckpointError(f"{steps.what} on rank {rank} of {comm.size}: the ranks passed different tags: "
                                  + "; ".join(f"rank {r}: {t.decode()}" for r, t in enumerate(texts)))
        save_id = _new_save_id(comm, rank)
        work = os.path.join(directory, f".{tag}.{save_id}")
        extras = {}  # rank 0: frozen parameters (FP32) and buffers, so the state_dict is complete

        def write_my_shard():
            if rank >= engine.runtime.shard_size:  # shard_size: group 0 writes the one copy of the state
                return NO_SHARD
            try:
                os.makedirs(work, exist_ok=True)
            except OSError as e:
                raise files.write_error(e, work, work, 4096) from None
            # FP32 on disk whatever the states' dtype in memory (bf16 optimizer states widen
            # exactly), so a checkpoint loads into either.
            tensors = state_io.state_for_save(engine, work)
            if rank == 0:
                extras.update(_extras(engine))
                path = os.path.join(work, loop_state.FILE)
                files.atomic_write(path, lambda f: f.write(state_body[0]), len(state_body[0]) + 4096, save_id)
                created.append(path)
            tensors.update({f"extra::{k}": v for k, v in extras.items()})
            path = os.path.join(work, f"shard_{rank:05d}.pt")
            digest = files.write_shard(path, tensors, {"rank": rank, "world_size": engine.runtime.shard_size,
                                                 "save_id": save_id, "state": engine.runtime.state()})
            created.append(path)
            return digest

        digest = steps.run("writing the shards", write_my_shard)
        digests = _gather_digests(comm, digest)[:engine.runtime.shard_size]

        def publish():
            if rank != 0:
                return
            meta = {"format": FORMAT, "zerort_version": _version(), "world_size": engine.runtime.shard_size,
                    "stage": engine.config.stage, "precision": engine.config.precision,
                    "config": to_dict(engine.config), "params": param_layout(engine),
                    "aliases": _aliases(engine), "extras": sorted(extras), "save_id": save_id,
                    "shards": [f"shard_{r:05d}.pt" for r in range(engine.runtime.shard_size)], "shard_sha256": digests,
                    **loop_state.meta_entries(engine, state_body[0])}
            meta["sha256"] = meta_digest(meta)
            body = json.dumps(meta, indent=1).encode()
            path = os.path.join(work, "meta.json")
            files.atomic_write(path, lambda f: f.write(body), len(body), save_id)
            created.append(path)
            target = os.path.join(directory, tag)
            # Everything that takes space first, then two renames: `tag`, then `latest`.
            latest = os.path.join(directory, "latest")
            latest_tmp = os.path.join(directory, f".latest.{save_id}")
            if save_latest:
                files.write_new_file(latest_tmp, lambda f: f.write(tag.encode()), len(tag.encode()), shown=latest)
                created.append(latest_tmp)
            previous = directory_names.switch(work, target)  # `tag` now names the new, complete checkpoint
            committed[0] = True
            if save_latest:
                os.replace(latest_tmp, latest)
                created.remove(latest_tmp)
            files.fsync_dir(directory)
            if previous:
                directory_names.drop_previous(directory, tag, previous, os.path.basename(work))

        steps.run("publishing the checkpoint", publish)
    except BaseException:
        if work is not None and steps.failed_together:
            try:
                _clean_up(comm, rank, work, created, committed)
            except Exception:  # noqa: BLE001 - the save's own error is the one to report
                pass
        raise
    finally:
        for held in lock:
            held.release()
    return os.path.join(directory, tag)


def _clean_up(comm, rank, work, created, committed):
    """After a save failed on some rank (every rank knows): unless rank 0 had already
    switched the tag to the new folder, each rank removes the files it created and then
    the folder, which the last rank to get there finds empty."""
    flag = torch.tensor([1 if committed[0] else 0], dtype=torch.int64)
    comm.broadcast(flag, 0)
    if flag.item():
        for path in created:  # only the temporary names; the checkpoint itself is complete
            if os.path.basename(path).startswith("."):
                files.remove(path)
        return
    for path in created:
        files.remove(path)
    try:
        os.rmdir(work)
    except OSError:
        pass  # another rank's files are still there, or it is gone already


def _aliases(engine):
    """Tied parameters: every state_dict name beyond the first, mapped to the first."""
    first, out = {}, {}
    trainable = {id(p) for p in engine.param_index.params}  # frozen tied names are all in the extras
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
    trainable = {id(p) for p in engine.param_index.params}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in trainable:
            continue
        if id(t) in engine.frozen_masters:
            out[name] = engine.frozen_masters[id(t)].clone()
        else:
            out[name] = t.detach().float().clone() if t.is_floating_point() else t.detach().clone()
    return out


def _check_extras(engine, meta, tensors):
    """Frozen parameters and buffers: the saved ones are this model's, with its shapes."""
    live = engine.module.state_dict(keep_vars=True)
    for name in meta.get("extras", []):
        if name not in live:
            raise CheckpointError(f"checkpoint has state {name!r} that this model lacks: saved from another model")
        saved, t = tensors[f"extra::{name}"], live[name]
        if tuple(saved.shape) != tuple(t.shape):
            raise CheckpointError(f"{name!r} has shape {list(t.shape)} here but {list(saved.shape)} in the "
                                  "checkpoint: saved from another model")


def _restore_extras(engine, meta, tensors):
    """Frozen parameters and buffers: rank 0's saved values, in this engine's dtypes."""
    live = engine.module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in meta.get("extras", []):
            saved, t = tensors[f"extra::{name}"], live[name]
            if id(t) in engine.frozen_masters:
                engine.frozen_masters[id(t)].copy_(saved)
            t.data.copy_(saved)  # cast to the working dtype


def _version():
    return _C.__version__


def _same_checkpoint(comm, directory, tag, meta):
    """Every rank resolved the same tag of the same save, or a CheckpointError on every rank
    naming which rank saw which."""
    mine = f"tag {tag!r}, save {meta['save_id']}, meta.json sha256 {meta_digest(meta)[:16]}..."
    texts = gather_if_different(comm, mine.encode())
    if texts is None:
        return
    groups = {}
    for r, t in enumerate(texts):
        groups.setdefault(t.decode(), []).append(r)
    tags = {t.split(", save ")[0] for t in groups}
    what = "different tags" if len(tags) > 1 else f"the same {next(iter(tags))} of different saves"
    raise CheckpointError(f"load_checkpoint({directory!r}) on rank {comm.rank} of {comm.size}: the ranks resolved "
                          f"{what}: " + "; ".join(f"{ranks_text(rs)}: {t}" for t, rs in groups.items())
                          + ". Every rank must load the same save: keep the checkpoint directory on storage that all "
                          "ranks share, or copy the same files to every host")


def _check_model(engine, directory, tag, meta, mine, reader):
    """The same model (names, shapes; frozen parameters and buffers), and every shard
    present, whole and bound to meta.json: all before anything changes."""
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
    reader.check_all()
    _check_extras(engine, meta, reader.shard(0)[0])


def load(engine, directory, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True,
         load_module_only=False):
    """Loads a checkpoint on every rank (a collective), or raises on every rank; returns
    (path, client_state). With tag None and no `latest` in directory on every rank, loads
    nothing and returns (None, None), as DeepSpeed does. load_optimizer_states=False keeps
    this engine's Adam moments, step count, loss scale and param groups (the weights and
    the step counters load); load_module_only=True loads the weights and buffers alone.
    See the module docstring."""
    comm = engine.comm
    if tag is None:
        mine = directory_names.without_latest(directory)
        votes = comm.all_gather(torch.tensor([mine]), torch.empty(comm.size, dtype=torch.int64)).tolist()
        if min(votes) > directory_names.HAS_LATEST:
            if max(votes) > directory_names.NOTHING_SAVED:
                why = directory_names.NOT_A_CHECKPOINT[max(votes)]
                raise CheckpointError(f"load_checkpoint({directory!r}): {why} (on rank "
                                      f"{votes.index(max(votes))}); pass the directory save_checkpoint wrote")
            if comm.rank == 0:
                print(f"zerort: load_checkpoint({directory!r}): no 'latest' file there, nothing loaded", flush=True)
            return None, None
    what = "module" if load_module_only else "all" if load_optimizer_states else "weights"
    steps = Steps(comm, f"load_checkpoint({directory!r})")
    tag, meta = steps.run("reading the checkpoint's meta.json", lambda: read_meta(directory, tag))
    _same_checkpoint(comm, directory, tag, meta)
    mine = param_layout(engine)
    reader = files.ShardReader(directory, tag, meta)
    folder = os.path.join(directory, tag)
    state = []

    def check():
        _check_model(engine, directory, tag, meta, mine, reader)
        if what != "module":
            _window(engine, meta, dict(reader.shard(0)[1]["state"]))  # raises before anything loads
        state.extend(loop_state.read(folder, meta))
        if what != "module":
            loop_state.check(engine, meta, state[1] if load_lr_scheduler_states else None, what)

    steps.run("checking the shards", check)
    client_state, scheduler_state = state
    steps.run("restoring the state", lambda: _restore(engine, meta, mine, reader, what))
    if what != "module":
        scheduler = "all" if what == "all" else "scheduler"
        loop_state.restore(engine, meta, scheduler_state if load_lr_scheduler_states else None, scheduler)
    return folder, client_state


def _window(engine, meta, saved):
    """The saved counters with micro_steps in this engine's accumulation window: a
    checkpoint saved at a boundary resumes at a boundary whatever gradient_accumulation_steps
    the two runs use (the world size may change it)."""
    gas = engine.config.batch.gradient_accumulation_steps
    saved_gas = meta["config"].get("gradient_accumulation_steps", 1)  # See Note [saved config names]
    inside = saved["micro_steps"] - saved["global_step"] * saved_gas
    if inside and gas != saved_gas:
        raise CheckpointError(f"the checkpoint was saved {inside} micro-steps into an accumulation window of "
                              f"{saved_gas}, and this engine accumulates {gas}; load it with "
                              f"gradient_accumulation_steps {saved_gas}, or save at an accumulation boundary")
    saved["micro_steps"] = saved["global_step"] * gas + inside
    return saved


def _restore(engine, meta, mine, reader, what="all"):
    """what: "all"; "weights" (the master and the counters, not Adam's moments, step
    count or loss scale); "module" (the master alone)."""
    for key in STATE_TENSORS if what == "all" else ("master",):
        state_io.restore(engine, key, mine, reader)
    _restore_extras(engine, meta, reader.shard(0)[0])
    if what != "module":
        saved = _window(engine, meta, dict(reader.shard(0)[1]["state"]))
        if what == "weights":  # this engine's optimizer counters and loss scale stay
            now = engine.runtime.state()
            saved.update({k: v for k, v in now.items() if k not in ("global_step", "skipped_steps", "micro_steps")})
        engine.runtime.load_state(saved)
    engine.runtime.refresh_params()
