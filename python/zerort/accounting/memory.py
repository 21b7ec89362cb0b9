"""Where the memory goes: model-state bytes per rank at each ZeRO stage.

    python -m zerort.accounting.memory --params 7.5e9 --world-size 64            # stages 0-3, GB per rank
    python -m zerort.accounting.memory --model gpt --layers 24 --hidden 2048 --vocab 50257 --world-size 8
    python -m zerort.accounting.memory --params 7.5e9 --world-size 64 --stage 3 --json
    python -m zerort.accounting.memory --params 7.5e9 --world-size 64 --plot stages.png

Two columns per category: the ZeRO paper's formula (stage 0: 16Ψ; 1: 4Ψ+12Ψ/W; 2: 2Ψ+14Ψ/W;
3: 16Ψ/W) and the exact bytes of our layout, with the padding of every bucket or unit to
W x 16 elements, the FP32 gradient shard our design adds, the reduce scratch and the
gathered stage-3 units.

engine.memory_report() (zerort.accounting.report: report(), MemoryReport) puts a running
engine beside it: first what the allocator measured (zerort.accounting.phases.EngineMemory,
which the engine sets up and its forward, backward and step feed: the bytes the engine
holds, each phase's peak growth beside what zerort's buffers should add in it, the rest
shown as "other"), then the engine's own counters per category beside exact().
"""
import argparse
import dataclasses
import json
import sys

import torch

from zerort import _C
from zerort.config import Config
from zerort.layout.precision import group_params
from zerort.layout.shard_map import layout
from zerort.accounting.nvme_tier import NvmeTier  # noqa: F401 (the estimate's argument)
from zerort.accounting.phases import (PHASES, PhaseMemory, Phases, allocated, install_counting_allocator,  # noqa: F401
                     reset_peak)

CATEGORIES = [
    ("lp_params", "low-precision params"),
    ("lp_grads", "low-precision grads / buckets"),
    ("master", "FP32 master"),
    ("adam_m", "Adam m"),
    ("adam_v", "Adam v"),
    ("grad_shard", "FP32 grad shard"),
    ("comm_buffers", "comm buffers"),
    ("gathered_units", "gathered stage-3 units"),
    ("state_pool", "offload tier's host buffers"),
]
# Bytes that follow from the layout alone. Stage 3's gathered units depend on execution
# order too; the estimate is then the largest prefetch + 2 consecutive units, an upper bound.
# So does the reduce scratch (two consecutive buckets' or units' at most: _received).
BOUND_ONLY = {"gathered_units", "comm_buffers"}
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # per element of the working copy
STATE_BYTES = {"fp32": 4, "bf16": 2}  # per element of Adam's m and v (state_dtype), or of the master (master_dtype)


def paper_formula(numel, world_size, stage):
    """The ZeRO paper's bytes per rank (2-byte params and grads, K = 12), by category."""
    psi, w = float(numel), float(world_size)
    shard = {0: (1, 1, 1), 1: (1, 1, w), 2: (1, w, w), 3: (w, w, w)}[stage]
    p, g, o = (psi / s for s in shard)
    return {"lp_params": 2 * p, "lp_grads": 2 * g, "master": 4 * o, "adam_m": 4 * o, "adam_v": 4 * o,
            "grad_shard": 0.0, "comm_buffers": 0.0, "gathered_units": 0.0, "state_pool": 0.0}


@dataclasses.dataclass
class Group:
    """Parameters that share one flat layout: their sizes, element bytes, and at stage 3
    whether they stay whole (persistent) or form a unit."""
    numels: list
    element_bytes: int
    persistent: bool = False


def exact(groups, world_size, stage, reduce_bucket_numel=1 << 24, prefetch=1, at_rest=False, state_bytes=4,
          nvme=None, secondary=1, master_bytes=4, host_tier=False, grad_piece=0):
    """Exact bytes per rank in memory of our layout for these parameter groups (stages 0-2:
    one group per dtype, cut into reduce buckets; stage 3: the units in execution order).
    state_bytes: per element of Adam's m and v (4, or 2 with bf16 optimizer states). at_rest:
    only what initialize allocates and keeps, without the buffers that live during a
    phase (gathered units, stage 3's per-unit pack buffer, the communicator's reduce
    scratch, which it allocates outside torch's allocator), nor the NVMe tier's pool, which
    io/ allocates outside it too. nvme: an NvmeTier when the states are on NVMe (their
    file's bytes: nvme_file_bytes). world_size: the ranks that shard the state (with shard_size,
    its value: C++ Note [hybrid sharding]). secondary: stage 3's secondary groups' size (hpZ),
    whose pieces of every gathered unit stay (C++ Note [secondary shards]). master_bytes: per element
    of the master and the gradient shard (2: a bf16 master, which adds the reduces' FP32 scratch of
    the largest bucket's shard to grad_shard: C++ Note [bf16 master]). host_tier: the Engine's 'cpu' tier
    (C++ Note [state tiers]), whose reduces sum into an FP32 scratch of the largest bucket's shard on the
    model's device, counted in grad_shard, and at stage 3 keeps each released unit's low-precision shard
    apart (lp_params). grad_piece: with the gradient on the model's device off memory (C++ Note [gradient
    on the device]), the elements of the host piece the step copies it down through (offload_optimizer
    chunk_numel), counted in state_pool; the reduces then need no scratch. 0: the gradient is not there."""
    in_flight = (nvme is None or not nvme.gradients) and master_bytes == 4  # else reached by ranges: waited at once
    out = _in_memory(groups, world_size, stage, reduce_bucket_numel, prefetch, at_rest, state_bytes, master_bytes,
                     in_flight)
    state_numel = out["grad_shard"] // master_bytes
    if master_bytes == 2 or (host_tier and not grad_piece):
        out["grad_shard"] += 4 * _largest_shard(groups, world_size, stage, reduce_bucket_numel)
    if host_tier and stage == 3:  # each released unit's shard copy (C++ Note [state tiers])
        out["lp_params"] += sum(_unit_shard_bytes(groups, world_size))
    if stage == 3 and secondary > 1:
        out["lp_params"] += sum(u // secondary for u in unit_bytes(groups, world_size))
    if nvme is not None:  # master, m and v go to the file (but a split's RAM records); the pool and shard copies stay
        in_ram = nvme.ram_elements(state_numel)
        out["master"], out["adam_m"], out["adam_v"] = 4 * in_ram, state_bytes * in_ram, state_bytes * in_ram
        out["state_pool"] = 0 if at_rest else nvme.pool_bytes(state_bytes)
        if nvme.gradients:  # in RAM only the reduce scratch: the largest bucket's shard
            out["grad_shard"] = 4 * _largest_shard(groups, world_size, stage, reduce_bucket_numel)
        shards = _unit_shard_bytes(groups, world_size) if stage == 3 else []
        if nvme.params:  # the shards go to their own file, through two staging buffers
            out["state_pool"] += 0 if at_rest else 2 * nvme.aligned(max(shards, default=0) or 1)
        else:
            out["lp_params"] += sum(shards)
    if grad_piece and not at_rest:  # outside torch's allocator, like the pool
        out["state_pool"] += 4 * grad_piece
    return out


def _largest_shard(groups, w, stage, reduce_bucket_numel):
    """Elements of the largest bucket's (stage 3: unit's) shard of this rank's state."""
    if stage == 3:
        return max((layout(g.numels, w).shard_numel for g in groups), default=0)
    return max((b[2] for g in groups for b in _C.plan_buckets(g.numels, w, reduce_bucket_numel, _C.SHARD_ALIGNMENT)),
               default=0)


def _unit_shard_bytes(groups, world_size):
    """Stage 3: this rank's low-precision shard of each unit that is not persistent, in bytes."""
    return [layout(g.numels, world_size).shard_numel * g.element_bytes for g in groups if not g.persistent]


def state_numel(groups, world_size, stage, reduce_bucket_numel=1 << 24):
    """Elements of this rank's optimizer state (master, m and v each): its FP32 gradient shard's."""
    return _in_memory(groups, world_size, stage, reduce_bucket_numel, 1, True, 4)["grad_shard"] // 4


def nvme_file_bytes(groups, world_size, stage, nvme, reduce_bucket_numel=1 << 24, state_bytes=4):
    """The bytes of this rank's NVMe state file for these groups (See NvmeTier)."""
    return nvme.file_bytes(state_numel(groups, world_size, stage, reduce_bucket_numel), state_bytes)


def nvme_param_file_bytes(groups, world_size, stage, nvme):
    """The bytes of this rank's NVMe file of stage 3's parameter shards (0 without nvme.params)."""
    on = nvme.params and stage == 3
    return sum(nvme.aligned(b) for b in _unit_shard_bytes(groups, world_size)) if on else 0


def _received(packs):
    """Reduce scratch (packs: in issue order), a bound: two consecutive reduces may hold theirs at once
    while one is left in flight (C++ Note [reduces in flight])."""
    return max([sum(packs[i:i + 2]) for i in range(len(packs))], default=0)


def _in_memory(groups, world_size, stage, reduce_bucket_numel, prefetch, at_rest, state_bytes, master_bytes=4,
               in_flight=True):
    """exact() with every state in memory; in_flight: reduces are left in flight (FP32 gradient in memory)."""
    w = world_size
    out = dict.fromkeys((k for k, _ in CATEGORIES), 0)
    if stage < 3:
        largest_pack, largest_shard, packs = 0, 0, []  # packs: every bucket's packed bytes, in reduce order
        for g in groups:
            padded = shard = 0
            for _, b_padded, b_shard in _C.plan_buckets(g.numels, w, reduce_bucket_numel, _C.SHARD_ALIGNMENT):
                padded += b_padded
                shard += b_shard
                packs.append(b_padded * g.element_bytes)
                largest_pack = max(largest_pack, b_padded * g.element_bytes)
                largest_shard = max(largest_shard, b_shard)
            opt = padded if stage == 0 else shard
            out["lp_params"] += padded * g.element_bytes
            if stage < 2:  # stages 0, 1: the whole flat gradient buffer
                out["lp_grads"] += padded * g.element_bytes
            for k in ("master", "adam_m", "adam_v", "grad_shard"):
                out[k] += (state_bytes if k.startswith("adam") else master_bytes) * opt
        if stage == 2:  # two pack buffers of the largest bucket: one filling, one reducing
            out["lp_grads"] = 2 * largest_pack
        # reduce_scatter_accumulate's received chunks (none at W = 1: a local conversion); stage 0
        # waits at once, and also keeps an FP32 scratch shard for the all-gather.
        received = 0 if at_rest or w == 1 else _received(packs if stage > 0 and in_flight else [largest_pack])
        out["comm_buffers"] = received + (4 * largest_shard if stage == 0 else 0)
        return out
    units, every = [], []  # the gathered units; every unit, in execution order
    for g in groups:
        unit = layout(g.numels, w)
        full = unit.padded_numel * g.element_bytes
        out["lp_params"] += full if g.persistent else 0  # units are cast from the master when gathered
        out["lp_grads"] = max(out["lp_grads"], full)      # the pack buffer of one unit
        for k in ("master", "adam_m", "adam_v", "grad_shard"):
            out[k] += (state_bytes if k.startswith("adam") else master_bytes) * unit.shard_numel
        units += [] if g.persistent else [full]
        every.append(full)
    out["comm_buffers"] = _received(every if in_flight else [max(every, default=0)]) if w > 1 else 0  # W > 1
    out["gathered_units"] = gathered_window(units, prefetch + 2)
    if at_rest:
        out["lp_grads"] = out["comm_buffers"] = out["gathered_units"] = 0
    return out


def unit_bytes(groups, world_size):
    """Stage 3: the gathered bytes of each unit that is gathered and released (the
    non-persistent groups, padded as laid out), in execution order."""
    return [layout(g.numels, world_size).padded_numel * g.element_bytes
            for g in groups if not g.persistent]


def gathered_window(units, k):
    """The most bytes k consecutive units hold (all of them when there are fewer)."""
    k = max(1, min(k, len(units)))
    return max((sum(units[i:i + k]) for i in range(len(units) - k + 1)), default=0)


def model_groups(model, stage, precision="bf16", config=None):
    """The parameter groups zerort.initialize would build for this model (shared parameters
    count once), as precision.group_params groups them."""
    from zerort.layout.units import UnitPlan

    c = config or Config(stage=stage, precision=precision)
    grouping = group_params(model, precision, c.fp32_modules)
    units = UnitPlan(model, grouping.trainable, grouping.fp32_plan.fp32_ids, c) if stage == 3 else None
    return _layout_groups(grouping.groups, lambda p: p.numel(), BYTES[precision], units)


def _layout_groups(engine_groups, numel, lp, units=None):
    """Groups of the Engine's two parameter groups (compute dtype, FP32): stages 0-2 each
    one that has parameters; stage 3 one per unit (in its order), then the FP32 group."""
    low, fp32 = ([numel(p) for p in ps] for ps in engine_groups)
    if units is None:
        return [g for g in (Group(low, lp), Group(fp32, 4)) if g.numels]
    groups = [Group([low[i] for i in ps], lp, persistent) for ps, persistent, _ in units.specs]
    return groups + ([Group(fp32, 4, True)] if fp32 else [])


def count_groups(numel, stage, precision="bf16", reduce_bucket_numel=1 << 24, unit_numel=None):
    """Groups for a bare parameter count: tensors of reduce_bucket_numel elements (stages
    0-2), or units of unit_numel elements (stage 3; default numel / 32)."""
    numel = int(numel)
    piece = reduce_bucket_numel if stage < 3 else (unit_numel or max(1, numel // 32))
    sizes = [piece] * (numel // piece) + ([numel % piece] if numel % piece else [])
    lp = BYTES[precision]
    if stage < 3:
        return [Group(sizes, lp)]
    return [Group([s], lp) for s in sizes]


def estimate_memory(model_or_numel, world_size, stage, precision="bf16", *, reduce_bucket_numel=1 << 24,
                    prefetch=1, unit_numel=None, config=None, optimizer_state_dtype="fp32", nvme=None,
                    shard_size=None, secondary=1, master_dtype="fp32"):
    """Bytes of model states per rank, by category: {"paper": {...}, "exact": {...}} with
    a "total" in each. model_or_numel: a torch.nn.Module (shared parameters counted once)
    or a parameter count. optimizer_state_dtype: "bf16" keeps Adam's m and v in bf16; master_dtype:
    "bf16" the master and the gradient shard (bf16.bf16_master_weights_and_grads).
    nvme: an NvmeTier puts master, m and v on NVMe (a config's offload_optimizer does the
    same when nvme is not given): "exact" is then the RAM, "nvme_file_bytes" each rank's state
    file and "nvme_param_file_bytes" its parameter file (nvme.params, stage 3). shard_size: hybrid
    sharding's groups (the state sharded over shard_size ranks, not world_size: 16 Psi / shard_size
    at stage 3); secondary: hpZ's groups at stage 3 (2 Psi / secondary more)."""
    world_size = shard_size or world_size  # what the states are sharded over
    if isinstance(model_or_numel, torch.nn.Module):
        groups = model_groups(model_or_numel, stage, precision, config)
        numel = sum(sum(g.numels) for g in groups)
    else:
        numel = int(model_or_numel)
        groups = count_groups(numel, stage, precision, reduce_bucket_numel, unit_numel)
    paper = paper_formula(numel, world_size, stage)
    state_bytes = STATE_BYTES[optimizer_state_dtype]
    nvme = nvme or (NvmeTier.of(config) if config is not None else None)
    ours = exact(groups, world_size, stage, reduce_bucket_numel, prefetch, state_bytes=state_bytes, nvme=nvme,
                 secondary=secondary, master_bytes=STATE_BYTES[master_dtype])
    paper["total"] = sum(paper.values())
    ours["total"] = sum(ours.values())
    out = {"paper": paper, "exact": ours, "numel": numel, "world_size": world_size, "stage": stage,
           "precision": precision}
    if nvme is not None:
        out["nvme_file_bytes"] = nvme_file_bytes(groups, world_size, stage, nvme, reduce_bucket_numel, state_bytes)
        out["nvme_param_file_bytes"] = nvme_param_file_bytes(groups, world_size, stage, nvme)
    return out


def phase_estimates(groups, world_size, stage, prefetch=1):
    """What zerort's own buffers add in each phase, from the layout: {phase: [{"label",
    "bytes", "bound"}]}. Stage 3, forward: the units gathered at once when each unit runs
    once, in order: the running one and the next `prefetch` (exact for such a model). Backward:
    the unit whose gradients are still coming in, the one whose output gradient has
    arrived and the next `prefetch`, i.e. prefetch + 2 units (a bound: autograd decides
    the order of a unit's last gradient and the next unit's hook), plus the gradient pack
    buffer of the unit being reduced (one; more when reduces queue behind the comm
    thread). Stages 0-2 allocate nothing per phase (the flat buffers, the gradient buffer
    or pack buffers exist from initialize), nor does any stage's step (it updates the
    shards in place). The communicator's reduce scratch is allocated outside torch's
    allocator and is not counted here."""
    if stage < 3:
        return {"forward": [], "backward": [], "step": []}
    units = unit_bytes(groups, world_size)
    n = len(units)
    fwd, bwd = min(prefetch + 1, n), min(prefetch + 2, n)
    return {
        "forward": [_part(f"gathered units: {fwd} (prefetch {prefetch} + running)",
                          gathered_window(units, fwd))] if n else [],
        "backward": [_part(f"gathered units: {bwd} (prefetch {prefetch} + 2)",
                           gathered_window(units, bwd), bound=True),
                     _part("gradient pack buffer: one unit", max(units))] if n else [],
        "step": [],
    }


def _part(label, nbytes, bound=False):
    return {"label": label, "bytes": nbytes, "bound": bound}


def gpt_numel(layers, hidden, vocab, seq=2048, tied=True):
    """Parameters of a GPT-2-style model: per block 12h^2 + 13h (attention, MLP, two
    LayerNorms, biases); token and position embeddings; final LayerNorm; head tied or not."""
    block = 12 * hidden * hidden + 13 * hidden
    return layers * block + vocab * hidden + seq * hidden + 2 * hidden + (0 if tied else vocab * hidden)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m zerort.accounting.memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, help="parameter count, e.g. 7.5e9")
    ap.add_argument("--model", choices=["gpt"], help="count a model's parameters instead")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--stage", type=int, choices=[0, 1, 2, 3])
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--reduce-bucket-numel", type=int, default=1 << 24)
    ap.add_argument("--unit-numel", type=int, help="stage-3 unit size (default: one GPT block, or params/32)")
    ap.add_argument("--optimizer-state-dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--master-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="the master and the gradient shard (bf16: bf16.bf16_master_weights_and_grads)")
    ap.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default="none",
                    help="where master and Adam's moments live (cpu: host memory, as 'none' on a CPU model; nvme: "
                         "a file per rank, the RAM then holds the I/O pool)")
    ap.add_argument("--nvme-buffer-count", type=int, default=4, help="offload_optimizer.buffer_count")
    ap.add_argument("--nvme-chunk-numel", type=int, default=1 << 20, help="offload_optimizer.chunk_numel")
    ap.add_argument("--nvme-gradients", action="store_true", help="offload_optimizer.gradient_in_file")
    ap.add_argument("--nvme-ram-fraction", type=float, default=0.0,
                    help="offload_optimizer.ram_fraction: the part of master, m and v kept in RAM (0 to 1)")
    ap.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default="none",
                    help="stage 3's parameters (nvme: each unit's shard in a second file; needs --offload-optimizer "
                         "nvme)")
    ap.add_argument("--shard-size", type=int, help="hybrid sharding: the states sharded over groups of this many "
                    "ranks (shard_size), replicated across them")
    ap.add_argument("--secondary-shard-size", type=int, default=1, help="stage 3's hpZ groups (1: off)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", metavar="FILE.png")
    a = ap.parse_args(argv)
    if a.model == "gpt":
        if not (a.layers and a.hidden):
            ap.error("--model gpt needs --layers and --hidden")
        numel = gpt_numel(a.layers, a.hidden, a.vocab, a.seq)
        unit = a.unit_numel or 12 * a.hidden * a.hidden + 13 * a.hidden
    elif a.params:
        numel, unit = int(a.params), a.unit_numel
    else:
        ap.error("give --params N or --model gpt --layers L --hidden H")
    if a.world_size < 1 or (a.shard_size and (a.shard_size < 1 or a.world_size % a.shard_size)):
        ap.error("--world-size must be >= 1, and --shard-size a divisor of it")
    stages = [a.stage] if a.stage is not None else [0, 1, 2, 3]
    if a.offload_optimizer == "nvme":
        stages = [s for s in stages if s > 0]  # stage 0 keeps its states with the model
    if a.nvme_ram_fraction and (a.offload_optimizer != "nvme" or a.nvme_gradients):
        ap.error("--nvme-ram-fraction needs --offload-optimizer nvme, without --nvme-gradients (the config's rule)")
    if a.offload_param == "nvme" and a.offload_optimizer != "nvme":
        ap.error("--offload-param nvme needs --offload-optimizer nvme (zerort.config.offload.check_tier's rule)")
    nvme = NvmeTier(a.nvme_buffer_count, a.nvme_chunk_numel, params=a.offload_param == "nvme",
                    gradients=a.nvme_gradients, ram_fraction=a.nvme_ram_fraction) if a.offload_optimizer == "nvme" \
        else None
    results = [estimate_memory(numel, a.world_size, s, a.precision, reduce_bucket_numel=a.reduce_bucket_numel,
                               unit_numel=unit, optimizer_state_dtype=a.optimizer_state_dtype, nvme=nvme,
                               shard_size=a.shard_size, secondary=a.secondary_shard_size,
                               master_dtype=a.master_dtype)
               for s in stages]
    if a.plot:
        from zerort.accounting.memory_plot import plot
        plot(results, a.plot, CATEGORIES)
    if a.json:
        print(json.dumps(results if a.stage is None else results[0], indent=2))
        return 0
    gb = 1e9
    groups = f" in groups of {a.shard_size}" if a.shard_size else ""
    print(f"model states per rank: {numel:,} parameters ({numel / 1e9:.3f}B), W={a.world_size}{groups}, {a.precision} "
          f"(GB = 1e9 bytes; paper = the ZeRO paper's formula, ours = our exact layout)")
    if nvme is not None:
        print("offload nvme: 'ours' is the RAM per rank; each rank's files on NVMe are the last columns")
    head = f"{'stage':>5s} {'paper':>9s} {'ours':>9s}  " + "  ".join(f"{k:>14s}" for k, _ in CATEGORIES)
    print(head + (f"  {'nvme_file':>14s}  {'nvme_params':>14s}" if nvme else ""))
    for r in results:
        cats = "  ".join(f"{r['exact'][k] / gb:14.3f}" for k, _ in CATEGORIES)
        file = f"  {r['nvme_file_bytes'] / gb:14.3f}  {r['nvme_param_file_bytes'] / gb:14.3f}" if nvme else ""
        print(f"{r['stage']:5d} {r['paper']['total'] / gb:9.3f} {r['exact']['total'] / gb:9.3f}  {cats}{file}")
    if a.plot:
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
