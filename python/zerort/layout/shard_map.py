"""The shard map: which rank holds which run of every trainable parameter's elements, and at
what index of its optimizer state (FP32 master, Adam m and v, the FP32 gradient shard).

Every bucket (stage-3 unit) of an engine group is a ShardLayout (partition/shard_layout.h):
its parameters back to back, padded, cut into one shard per rank. The map asks the C++
ShardLayout for each parameter's slices; the checkpoint (what meta.json records, what a load
writes back), the optimizer's param-group regions and the non-finite guard's watched regions
all read it from here, and memory.py sizes its layouts with layout().

A segment is [rank, index, offset, length]: `length` elements of the parameter from `offset`
(row-major) are elements [index, index + length) of `rank`'s optimizer state. With shard_size
the ranks are a group's (engine.runtime.shard_rank), and every group holds the same map (C++ Note
[hybrid sharding]). At stage 0
every rank holds every element: the segments then name rank 0, and each rank reads them as
its own (replicated()).
"""
import math

import torch

from zerort import _C
from zerort.errors import Error

def layout(numels, world_size):
    """The ShardLayout of parameters of these sizes (in flat order) over world_size ranks,
    with the Engine's alignment (zerort._C.SHARD_ALIGNMENT)."""
    return _C.ShardLayout(list(numels), world_size, _C.SHARD_ALIGNMENT)


def replicated(engine):
    """Whether every rank holds the whole optimizer state (stage 0)."""
    return engine.config.stage == 0


def _group_segments(engine, g, params):
    """{id(p): segments} for group g's parameters, from each bucket's ShardLayout."""
    impl, stage0 = engine.runtime, replicated(engine)
    numels = [math.prod(engine.param_index.shapes[id(p)]) for p in params]  # stage 3 empties the params
    offsets = [impl.param_offset(g, i) for i in range(len(params))]
    out = {id(p): [] for p in params}
    for start, padded, shard, opt in impl.bucket_layout(g) if params else []:
        inside = sorted((offsets[i], i) for i in range(len(params))
                        if numels[i] and start <= offsets[i] < start + padded)
        if not inside:
            continue
        # Stage 0: one rank holds the whole bucket (the parameters at their flat offsets).
        bucket = layout([numels[i] for _, i in inside], 1 if stage0 else engine.runtime.shard_size)
        if not stage0 and (bucket.shard_numel, bucket.padded_numel) != (shard, padded):
            raise Error(f"zerort shard map: group {g}'s bucket at {start} has shards of {shard} elements, "
                               f"its ShardLayout {bucket.shard_numel}")
        for j, (_, i) in enumerate(inside):
            out[id(params[i])] = [[s.rank, opt + s.shard_offset, s.param_offset, s.numel]
                                  for s in bucket.slices_of_param(j)]
    return out


def param_layout(engine):
    """{name: {"shape", "dtype", "compute_dtype", "segments"}} for every trainable parameter
    of the engine, in named_parameters() order (a shared parameter under its first name)."""
    where, index = {}, engine.param_index
    for g, params in enumerate(index.groups):
        where.update(_group_segments(engine, g, params))
    out, seen = {}, set()
    for name, p in engine.module.named_parameters():
        if id(p) in where and id(p) not in seen:
            seen.add(id(p))
            out[name] = {"shape": list(index.shapes[id(p)]), "dtype": "float32",  # the saved master
                         "compute_dtype": str(index.dtypes[id(p)]).replace("torch.", ""),
                         "segments": where[id(p)]}
    return out


def owned(engine, layout=None):
    """(index, length, name) of every run of optimizer state this rank holds, in index order."""
    layout = layout or param_layout(engine)
    everything = replicated(engine)
    return sorted((index, length, name) for name, info in layout.items()
                  for rank, index, _, length in info["segments"] if everything or rank == engine.runtime.shard_rank)


STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
WINDOW = 1 << 24  # elements of state write_state reads and writes at once


def read_state(engine, key, start=0, n=None):
    """Elements [start, start + n) (to the end by default) of this rank's `key` state (one of
    STATE_KEYS): a new CPU tensor, float32 for the master and the state dtype for Adam's
    moments. The indices run across the engine's groups, as the segments' do. Any tier: See
    Note [state tiers] (runtime/engine_tiers.cpp)."""
    impl = engine.runtime
    return impl.read_state(key, start, impl.state_numel - start if n is None else n)


def flat(tensors):
    """One flat tensor of a list of them (a copy when there are several), or of one tensor."""
    if isinstance(tensors, list):
        return torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
    return tensors.reshape(-1)


def write_state(engine, key, full, layout=None):
    """This rank's part of full[name] (each a whole parameter's values) into the engine's
    `key` state (one of STATE_KEYS), for the parameters full names; layout: param_layout(engine),
    when the caller has it. The runs go in windows of about WINDOW elements, each read, filled
    and written back whole (what lies between runs keeps its values), so no more than a
    window, or one run, is held beside `full`, in any tier."""
    layout = layout or param_layout(engine)
    rank, everything = engine.runtime.shard_rank, replicated(engine)
    runs = sorted((index, offset, length, name) for name, values in full.items()
                  for r, index, offset, length in layout[name]["segments"] if everything or r == rank)
    i = 0
    with torch.no_grad():
        while i < len(runs):
            lo, hi, j = runs[i][0], runs[i][0] + runs[i][2], i + 1
            while j < len(runs) and runs[j][0] + runs[j][2] - lo <= WINDOW:
                hi = max(hi, runs[j][0] + runs[j][2])
                j += 1
            window = read_state(engine, key, lo, hi - lo)
            for index, offset, length, name in runs[i:j]:
                window[index - lo:index - lo + length] = full[name].reshape(-1)[offset:offset + length]
            engine.runtime.write_state(key, lo, window)
            i = j
