"""The training loop's state in a checkpoint, beside the shards (zerort.state.checkpoint):
the param groups, the lr schedule's state and the caller's client_state.

The param groups (their hyperparameters and parameter names, so they survive resharding)
go into meta.json under "optimizer". The schedule's state_dict and the client_state go
into engine_state.pt, written by rank 0 and bound to meta.json by its SHA-256. It is read
with torch.load(weights_only=True), so a client_state holds tensors, numbers, strings,
lists, tuples and dicts; anything else is refused at save, not discovered at load.
"""
import hashlib
import io
import json
import os

import torch

from zerort.errors import CheckpointError
from zerort.state.regular_files import open_regular

FILE = "engine_state.pt"


def encode(engine, client_state):
    """engine_state.pt's bytes, checked to load back as weights_only (and the param groups
    checked to be JSON for meta.json), before anything is written."""
    try:
        json.dumps(engine.optimizer.state_dict()["param_groups"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"save_checkpoint: engine.optimizer.param_groups hold a value JSON cannot store ({e}); "
                              "keep group values to numbers, strings, lists and dicts") from None
    scheduler = engine.lr_scheduler
    state = {"client_state": client_state if client_state is not None else {},
             "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
             "lr_scheduler_type": type(scheduler).__name__ if scheduler is not None else None}
    buf = io.BytesIO()
    try:
        torch.save(state, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        raise CheckpointError(f"save_checkpoint: client_state (or the lr scheduler's state_dict) cannot be saved "
                              f"so that it loads safely ({type(e).__name__}: {str(e)[:300]}); keep it to tensors, "
                              "numbers, strings, lists, tuples and dicts") from None
    return buf.getvalue()


def meta_entries(engine, body):
    """What meta.json records: the param groups, and engine_state.pt's name and digest."""
    return {"optimizer": engine.optimizer.state_dict(),
            "engine_state": {"file": FILE, "sha256": hashlib.sha256(body).hexdigest()}}


def read(folder, meta):
    """(client_state, scheduler state) from engine_state.pt; ({}, None) for a checkpoint
    saved without one."""
    entry = meta.get("engine_state")
    if entry is None:
        return {}, None
    path = os.path.join(folder, entry["file"])
    with open_regular(path, f"{path} is missing: the checkpoint is incomplete") as f:
        body = f.read()
    if hashlib.sha256(body).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checksum mismatch in {path}: the file was modified or damaged")
    state = torch.load(io.BytesIO(body), weights_only=True, map_location="cpu")  # as DeepSpeed: on the CPU
    return state["client_state"], (state.get("lr_scheduler_type"), state["lr_scheduler"])


def check(engine, meta, scheduler, what):
    """Before anything loads: the saved param groups hold this engine's parameters (what
    "all"), and a saved schedule is one of this engine's kind (scheduler: read()'s
    (type name, state), or None when the schedule is not to be loaded)."""
    saved = meta.get("optimizer")
    if what == "all" and saved is not None:
        engine.optimizer.restore_groups(saved["param_groups"], "load_checkpoint", check_only=True)
    kind, state = scheduler or (None, None)
    mine = engine.lr_scheduler
    if state is not None and mine is not None and kind != type(mine).__name__:
        raise CheckpointError(f"load_checkpoint: the checkpoint's lr schedule is a {kind}, this engine's a "
                              f"{type(mine).__name__}; build the same schedule, or pass "
                              "load_lr_scheduler_states=False")


def restore(engine, meta, scheduler, what):
    """The param groups (what: "all") and the schedule (what: "all" or "scheduler";
    scheduler: read()'s (type name, state) or None), once check() passed."""
    scheduler_state = scheduler[1] if scheduler else None
    saved = meta.get("optimizer")
    if what == "all" and saved is not None:
        engine.optimizer.restore_groups(saved["param_groups"], "load_checkpoint")
    if what in ("all", "scheduler") and scheduler_state is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(scheduler_state)


def validate(f, meta):
    """The optional fields in zerort.state.metadata's validator (f: its _Fields)."""
    if "optimizer" in meta:
        groups = f.list(f.dict(meta, "optimizer"), "param_groups", "optimizer.param_groups")
        for k, g in enumerate(groups):
            if not isinstance(g, dict) or not isinstance(g.get("params"), list):
                f.fail(f"optimizer.param_groups[{k}]", g, "an object with a list of parameter names under 'params'")
    if "engine_state" in meta:
        entry = f.dict(meta, "engine_state")
        f.name(f.get(entry, "file", "engine_state.file"), "engine_state.file")
        f.hex(f.get(entry, "sha256", "engine_state.sha256"), "engine_state.sha256", 64)
