"""zerort.layout.shard_map against a reference computed another way: for engine-like bucket
layouts (zerort._C.plan_buckets at W = 1-4, stages 0-3, sizes 0, 1, odd and large), every
parameter's segments equal a plain walk over the flat buffer that cuts it at each shard
boundary, and the segments cover each parameter exactly once. The engines of the other
tests (checkpoints resharded from W = 4 to 2 and 3, the non-finite guard, param groups) use
the same map end to end."""
import math
import random
import types

import pytest
import torch

import zerort
from zerort.layout import shard_map


def reference(a, n, start, shard, opt, replicated):
    """[rank, index, offset, length] of flat elements [a, a+n) of a bucket at `start`."""
    if replicated:
        return [[0, opt + (a - start), 0, n]] if n else []
    out, x = [], a
    while x < a + n:
        r = (x - start) // shard
        end = min(a + n, start + (r + 1) * shard)
        out.append([r, opt + (x - start) - r * shard, x - a, end - x])
        x = end
    return out


class FakeImpl:
    """What the shard map reads of zerort._C.Engine, laid out as the Engine lays out a group:
    buckets back to back, each bucket's parameters back to back in its own order."""

    def __init__(self, numels, world, stage, bucket, rank=0):
        self.shard_size, self.shard_rank = world, rank  # a flat engine's: the whole world
        self.buckets, self.offsets, flat, opt = [], [0] * len(numels), 0, 0
        for params, padded, shard in zerort._C.plan_buckets(numels, world, bucket, zerort._C.SHARD_ALIGNMENT):
            x = flat
            for i in params:
                self.offsets[i] = x
                x += numels[i]
            self.buckets.append((flat, padded, shard, opt))
            flat += padded
            opt += padded if stage == 0 else shard

    def bucket_layout(self, g):
        return self.buckets

    def param_offset(self, g, i):
        return self.offsets[i]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_segments_equal_a_walk_over_the_shards(world, stage):
    rng = random.Random(world * 10 + stage)
    numels = [0, 1, 7, 4096, 3, 0, 1000, 33] + [rng.randrange(0, 5000) for _ in range(20)]
    params = [torch.empty(0) for _ in numels]
    impl = FakeImpl(numels, world, stage, bucket=6000)
    index = types.SimpleNamespace(shapes={id(p): (n,) for p, n in zip(params, numels)})
    engine = types.SimpleNamespace(runtime=impl, param_index=index, config=types.SimpleNamespace(stage=stage),
                                   world_size=world)
    got = shard_map._group_segments(engine, 0, params)
    for i, (p, n) in enumerate(zip(params, numels)):
        a = impl.offsets[i]
        start, padded, shard, opt = next(b for b in impl.buckets if b[0] <= a < b[0] + b[1] or n == 0)
        assert got[id(p)] == reference(a, n, start, shard, opt, stage == 0), (i, n)
        covered = sorted((offset, length) for _, _, offset, length in got[id(p)])
        assert sum(length for _, length in covered) == n
        assert all(o == sum(length for _, length in covered[:k]) for k, (o, _) in enumerate(covered))


def test_an_engines_map_reads_back_its_master():
    for stage in (0, 1, 2, 3):
        torch.manual_seed(stage)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))
        e = zerort.initialize(model, {"stage": stage, "comm": {"backend": "inprocess"}})
        layout = shard_map.param_layout(e)
        master = shard_map.read_state(e, "master")
        for name, p in model.named_parameters():
            whole = torch.empty(math.prod(layout[name]["shape"]))
            for _, index, offset, length in layout[name]["segments"]:
                whole[offset:offset + length] = master[index:index + length]
            assert torch.equal(whole, e.full_state_dict(master=True)[name].reshape(-1)), (stage, name)
        runs = shard_map.owned(e, layout)  # W = 1: this rank holds every element, once
        assert sorted({name for _, _, name in runs}) == sorted(layout), stage
        assert sum(length for _, length, _ in runs) == sum(math.prod(i["shape"]) for i in layout.values()), stage
        assert all(a[0] + a[1] <= b[0] for a, b in zip(runs, runs[1:])), stage
