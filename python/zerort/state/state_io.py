"""This rank's optimizer state to and from a checkpoint's shard files, in any tier (Note
[state tiers], runtime/engine_tiers.cpp), never more than a window of the state, or a few
parameters' whole values, in the process's memory beyond what the tier itself holds."""
import math
import os

import torch

from zerort.layout.shard_map import STATE_KEYS, WINDOW, read_state, write_state
from zerort.state import files


def state_for_save(engine, work):
    """This rank's master, m and v in FP32 for its shard file (bf16 moments widen exactly).
    In memory, copies. In another tier each array streams a window at a time into a scratch
    file in the save's folder, mapped back (files.mapped_scratch), so the save never holds a
    whole array in the process's memory."""
    if engine.runtime.state_tier_stats["tier"] == "memory":
        return {k: read_state(engine, k).to(torch.float32) for k in STATE_KEYS}
    n = engine.runtime.state_numel
    windows = lambda k: (read_state(engine, k, lo, min(WINDOW, n - lo)).to(torch.float32) for lo in range(0, n, WINDOW))
    scratch = lambda k: os.path.join(work, f".{k}.rank{engine.rank}")
    return {k: files.mapped_scratch(scratch(k), n, windows(k)) for k in STATE_KEYS}


def restore(engine, key, layout, reader):
    """The saved `key` state of every parameter of layout (param_layout(engine)) into the
    engine: a batch of about WINDOW elements of parameters at a time (reader.assemble builds
    each one's whole value), not the whole model's."""
    for batch in _batches(layout):
        write_state(engine, key, {b: reader.assemble(b, key) for b in batch}, layout)


def _batches(layout):
    """The parameter names of layout in runs of about WINDOW elements (one larger parameter
    alone)."""
    batch, size = [], 0
    for name, info in layout.items():
        n = math.prod(info["shape"])
        if batch and size + n > WINDOW:
            yield batch
            batch, size = [], 0
        batch.append(name)
        size += n
    if batch:
        yield batch
