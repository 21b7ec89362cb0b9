"""engine.memory_report(): what a running engine allocated on every rank, beside the exact
estimate of its layout (zerort.accounting.memory): the allocator's figures first (its
EngineMemory, zerort.accounting.phases: the bytes the engine held when initialize returned,
each phase's peak growth beside what zerort's own buffers should add in it, the rest shown
as "other"), then the engine's own counters per category.
"""
import math
import resource

import torch

from zerort.accounting.memory import (BOUND_ONLY, BYTES, CATEGORIES, STATE_BYTES, NvmeTier, _layout_groups, exact,
                                      nvme_file_bytes, nvme_param_file_bytes, phase_estimates)
from zerort.accounting import placement_auto
from zerort.accounting.phases import PHASES
from zerort.config.offload import describe


_OTHER = {
    "forward": "other (activations, autograd)",
    "backward": "other (autograd's grads, queued packs)",
    "step": "other (temporaries)",
}


class MemoryReport:
    """What one run allocated on every rank, beside our exact estimate.

    allocator: the allocator's figures (zerort's counting CPU allocator; on CUDA torch's
    memory statistics), per rank with min and max across ranks: the bytes the engine held
    when zerort.initialize returned (allocated during it and still live), beside the layout's
    resident bytes; and for each phase (forward: engine(...), backward: engine.backward,
    step: engine.step) the most it allocated at its peak above what was live when it began
    (the largest over its calls), beside what zerort's own buffers should add in it
    (phase_estimates). The difference is not zerort's: activations and what autograd saves
    and computes, which the engine cannot know, shown as "other".

    measured (per category): the engine's own counters, its bookkeeping of the buffers it
    made, beside the exact estimate of the same layout (estimate_memory)."""

    def __init__(self, measured, across, estimate, peak_rss, cuda_peak, stage, world_size, allocator=None,
                 offload="offload none", tier=None, param_tier=None, shard_size=None, placement=None, auto=False):
        self.measured, self.across, self.estimate = measured, across, estimate
        self.shard_size = shard_size or world_size  # shard_size: the ranks the estimates shard over
        self.peak_rss, self.cuda_peak, self.stage, self.world_size = peak_rss, cuda_peak, stage, world_size
        self.allocator = allocator
        self.offload = offload  # where the states live (zerort.config.offload.describe)
        # The optimizer state's tier (the engine's state_tier_stats, with "file_estimate" and
        # "file_bytes_sum" across ranks for nvme); None: in memory. param_tier: the same for
        # stage 3's parameter file (the engine's param_tier_stats); None: in memory.
        self.tier, self.param_tier = tier, param_tier
        # The zerort.accounting.placement.Placement: auto's choice, or the config's own tiers (None: not a candidate)
        self.placement, self.auto = placement, auto

    def to_dict(self):
        rows = {}
        for k, _ in CATEGORIES:
            rows[k] = {"measured": self.measured[k], "min": self.across[k][0], "max": self.across[k][1],
                       "sum": self.across[k][2], "estimate": self.estimate[k],
                       "diff": self.measured[k] - self.estimate[k], "bound_only": k in BOUND_ONLY}
        return {"stage": self.stage, "world_size": self.world_size, "shard_size": self.shard_size, "categories": rows,
                "total_measured": sum(self.measured.values()), "peak_rss_bytes": self.peak_rss,
                "cuda_max_allocated_bytes": self.cuda_peak, "allocator": self.allocator, "offload": self.offload,
                "state_tier": self.tier, "param_tier": self.param_tier,
                "placement": _placement_dict(self.placement, self.auto)}

    def table(self):
        mib, w = 1 << 20, 46
        f = lambda b: "" if b is None else f"{b / mib:.3f}"
        groups = f" in groups of {self.shard_size}" if self.shard_size != self.world_size else ""
        lines = [f"memory report: ZeRO stage {self.stage}, W={self.world_size}{groups}, per rank (MiB)", self.offload]
        if self.placement is not None:
            lines += placement_auto.summary(self.placement, self.auto)
        head = lambda first: lines.append(f"{first:{w}s}{'this rank':>11s}{'min':>10s}{'max':>10s}"
                                          f"{'estimate':>10s}{'diff':>10s}")
        row = lambda label, m=None, lo=None, hi=None, e=None, d=None: lines.append(
            f"{label:{w}s}{f(m):>11s}{f(lo):>10s}{f(hi):>10s}{f(e):>10s}{f(d):>10s}".rstrip())
        a = self.allocator
        if a is not None:
            head("measured by the allocator")
            lines.append(f"  ({a['source']})")
            h = a["held"]
            if h["measured"] is None:
                row("held by the engine: not measured (no initialize)")
            else:
                row("held by the engine after initialize", h["measured"], h["min"], h["max"], h["estimate"],
                    h["measured"] - h["estimate"])
            row("  the categories below at rest (no gathered", e=h["layout"])
            row("  units, stage-3 pack buffer, reduce scratch)")
            row("  frozen params + FP32 copies, cast buffers", e=h["other_tensors"])
            for name in PHASES:
                ph = a["phases"][name]
                if ph["growth"] is None:
                    row(f"{name}: not run yet")
                    continue
                calls = f"{ph['calls']} call{'s' if ph['calls'] != 1 else ''}"
                row(f"{name}: peak growth ({calls})", ph["growth"], ph["min"], ph["max"], ph["estimate"],
                    ph["growth"] - ph["estimate"])
                for part in ph["parts"]:
                    row(f"  {part['label']}{', a bound' if part['bound'] else ''}", e=part["bytes"])
                if not ph["parts"]:
                    row("  zerort's buffers: none in this phase", e=0)
                if ph["engine_gathered"] is not None:
                    row("  gathered units, engine's counter", m=ph["engine_gathered"])
                row(f"  {_OTHER[name]}", d=ph["growth"] - ph["estimate"])
            lines += ["  peak growth: the most allocated during the phase above what was live at its start;",
                      "  estimate: what zerort's own buffers add in it (phase_estimates); other = diff: what",
                      "  zerort cannot know. forward: activations and what autograd saves; backward: autograd's",
                      "  gradients before zerort packs them, pack buffers of reduces queued behind the comm",
                      "  thread, less the activations backward frees; step: temporaries"]
            if a["not_counted"]:
                lines.append(f"  not seen by the allocator: the communicator's reduce scratch (peak "
                             f"{f(a['not_counted'])} MiB, in 'comm\n  buffers' below), which it allocates outside it")
            if self.measured["state_pool"]:
                pool = f(self.measured["state_pool"])
                lines.append(f"  not seen by the allocator: the offload tier's host buffers ({pool} MiB, below: the "
                             "NVMe tier's, aligned for direct I/O,\n  and the host piece a gradient on the device goes "
                             "down through), allocated outside it")
        head("engine bookkeeping (zerort's own counters)")
        for k, label in CATEGORIES:
            m, (lo, hi, _), e = self.measured[k], self.across[k], self.estimate[k]
            note = "  (estimate is a bound)" if k in BOUND_ONLY and e else ""
            row(label, m, lo, hi, e, m - e)
            lines[-1] += note
        total_m, total_e = sum(self.measured.values()), sum(self.estimate.values())
        row("model states", total_m, e=total_e, d=total_m - total_e)
        for what, t in (("state", self.tier), ("parameter", self.param_tier)):
            if t is None:
                continue
            grad = f", the FP32 gradient {t['gradient_bytes'] / mib:.3f} MiB of it" if t["gradient_bytes"] else ""
            lines.append(f"on NVMe: this rank's {what} file {t['path']}: {t['file_bytes'] / mib:.3f} MiB{grad} "
                         f"(estimate {t['file_estimate'] / mib:.3f}; all ranks {t['file_bytes_sum'] / mib:.3f} MiB)")
            if t.get("ram_bytes"):
                lines.append(f"  split (ram_fraction): {t['ram_bytes'] / mib:.3f} MiB of its records kept in RAM, "
                             "counted in master and adam_m/adam_v above")
            lines.append(f"  I/O since initialize: read {t['bytes_read'] / mib:.1f} MiB, wrote "
                         f"{t['bytes_written'] / mib:.1f} MiB; {t['io_wait_seconds']:.3f} s spent waiting for it")
        lines.append(f"peak process RSS: {self.peak_rss / mib:.1f} MiB" +
                     ("" if self.cuda_peak is None else f"; CUDA max allocated {self.cuda_peak / mib:.1f} MiB"))
        return "\n".join(lines)


def measure(engine, mem):
    """Bytes the engine's runtime allocated on this rank, per category (its own counters);
    mem: its EngineMemory."""
    nbytes = lambda t: t.numel() * t.element_size()
    impl, out = engine.runtime, dict.fromkeys((k for k, _ in CATEGORIES), 0)
    # The reduce's scratch: the world's communicator's, and with shard_size the group's too.
    scratch = sum(c._c.scratch_peak_bytes for c in (engine.comm, *engine.shard_comms) if c is not None)
    out["lp_params"] = impl.resident_param_bytes  # stage 3: the persistent units
    out["gathered_units"] = mem.gathered_peak(impl)
    for g in range(impl.num_groups):
        flat_grads = impl.flat_grads(g)
        out["lp_grads"] += nbytes(flat_grads) if flat_grads is not None else 0
    tier = impl.state_tier_stats
    if tier["tier"] in ("memory", "cpu"):  # the store in memory: the model's, or the host's beside it
        for g in range(impl.num_groups):
            out["master"] += nbytes(impl.master(g))
            out["adam_m"] += nbytes(impl.exp_avg(g))
            out["adam_v"] += nbytes(impl.exp_avg_sq(g))
    else:  # a split nvme tier's RAM records: master, m and v of each element (C++ Note [NVMe state store])
        state_bytes = STATE_BYTES[engine.config.optimizer.state_dtype]
        elements = tier["ram_bytes"] // (4 + 2 * state_bytes)
        out["master"], out["adam_m"], out["adam_v"] = 4 * elements, state_bytes * elements, state_bytes * elements
    out["state_pool"] = tier["pool_bytes"] + impl.param_tier_stats["pool_bytes"]
    out["lp_grads"] += impl.pack_buffer_bytes  # stages 2, 3
    out["grad_shard"] = impl.grad_shard_bytes
    out["comm_buffers"] = scratch + (nbytes(impl.stage0_scratch) if impl.stage0_scratch is not None else 0)
    return out


def _host_tier(engine):
    """The Engine runs its 'cpu' tier (C++ Note [state tiers]): a GPU model's offload cpu, or a CPU model's
    with overlap_step true."""
    return engine.runtime.state_tier_stats["tier"] == "cpu"


def _grad_piece(engine):
    """The host piece (elements) the step copies a gradient on the model's device through (C++ Note [gradient
    on the device]); 0 where the gradient is elsewhere."""
    tier = engine.runtime.state_tier_stats
    o = engine.config.offload.optimizer
    return NvmeTier(o.buffer_count, o.chunk_numel).gradient_piece(tier["tier"] == "nvme") \
        if tier["gradient_on_device"] else 0


def _secondary(engine):
    """Stage 3's secondary groups' size (hpZ; 1: none)."""
    part = engine.shard_comms[2]
    return 1 if part is None else part.size


def _engine_groups(engine):
    index = engine.param_index
    numel = lambda p: math.prod(index.shapes[id(p)])  # stage 3 empties released parameters
    return _layout_groups(index.groups, numel, BYTES[engine.config.precision], engine.unit_plan)


def _allocator_figures(engine, mem, groups):
    """This rank's allocator figures (MemoryReport.allocator, without min and max)."""
    c = engine.config
    layout = sum(exact(groups, engine.runtime.shard_size, c.stage, c.reduce_bucket_numel, c.stage3.prefetch,
                       at_rest=True, state_bytes=STATE_BYTES[c.optimizer.state_dtype], nvme=NvmeTier.of(c),
                       secondary=_secondary(engine), master_bytes=STATE_BYTES[c.optimizer.master_dtype],
                       host_tier=_host_tier(engine), grad_piece=_grad_piece(engine)).values())
    source = ("zerort's counting CPU allocator" if mem.key == "cpu" else
              f"torch.cuda.memory_allocated / max_memory_allocated on {mem.key}")
    out = {"source": source, "device": mem.key,
           "held": {"measured": mem.held, "estimate": layout + mem.other_tensors, "layout": layout,
                    "other_tensors": mem.other_tensors},
           "phases": {}, "not_counted": engine.comm._c.scratch_peak_bytes if mem.key == "cpu" else 0}
    est = phase_estimates(groups, engine.runtime.shard_size, c.stage, c.stage3.prefetch)
    for name in PHASES:
        r = mem.phases.result.get(name)
        parts = est[name]
        out["phases"][name] = {
            "growth": r.growth if r else None, "peak": r.peak if r else None, "start": r.start if r else None,
            "end": r.end if r else None, "calls": r.calls if r else 0,
            "estimate": sum(part["bytes"] for part in parts), "parts": parts,
            "engine_gathered": mem.gathered.get(name) if c.stage == 3 else None}
    return out


def report(engine, mem):
    """The MemoryReport of a running engine (a collective: call it on every rank); mem: its
    EngineMemory (zerort.accounting.phases)."""
    c = engine.config
    measured = measure(engine, mem)
    groups = _engine_groups(engine)
    alloc = _allocator_figures(engine, mem, groups)
    keys = [k for k, _ in CATEGORIES]
    figures = [alloc["held"]["measured"]] + [alloc["phases"][n]["growth"] for n in PHASES]
    vals = torch.tensor([measured[k] for k in keys] + [0 if v is None else v for v in figures], dtype=torch.int64)
    lo, hi, tot = vals.clone(), vals.clone(), vals.clone()
    engine.comm.all_reduce(lo, "min")
    engine.comm.all_reduce(hi, "max")
    engine.comm.all_reduce(tot, "sum")
    across = {k: (int(lo[i]), int(hi[i]), int(tot[i])) for i, k in enumerate(keys)}
    n = len(keys)
    alloc["held"]["min"], alloc["held"]["max"] = int(lo[n]), int(hi[n])
    for i, name in enumerate(PHASES):
        alloc["phases"][name]["min"], alloc["phases"][name]["max"] = int(lo[n + 1 + i]), int(hi[n + 1 + i])
    state_bytes, nvme = STATE_BYTES[c.optimizer.state_dtype], NvmeTier.of(c)
    est = exact(groups, engine.runtime.shard_size, c.stage, c.reduce_bucket_numel, c.stage3.prefetch,
                state_bytes=state_bytes, nvme=nvme, secondary=_secondary(engine),
                master_bytes=STATE_BYTES[c.optimizer.master_dtype], host_tier=_host_tier(engine),
                grad_piece=_grad_piece(engine))
    tier = param_tier = None
    if nvme is not None:
        tier = _file_figures(engine, engine.runtime.state_tier_stats,
                             nvme_file_bytes(groups, engine.runtime.shard_size, c.stage, nvme, c.reduce_bucket_numel,
                                             state_bytes))
        if nvme.params:
            param_tier = _file_figures(engine, engine.runtime.param_tier_stats,
                                       nvme_param_file_bytes(groups, engine.runtime.shard_size, c.stage, nvme))
    placement = engine.placement or placement_auto.concrete(c, groups, engine.device, engine.runtime.shard_size)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return MemoryReport(measured, across, est, peak_rss, cuda_peak, c.stage, engine.world_size, alloc,
                        describe(c, engine.device), tier, param_tier, engine.runtime.shard_size, placement,
                        engine.placement is not None)


def _placement_dict(p, auto):
    """A Placement as the report's dict: the candidate's name and settings, bytes per tier per kind."""
    if p is None:
        return None
    return {"name": p.candidate.name, "auto": auto, "settings": p.candidate.settings(), "bytes": p.bytes,
            "usable": {t: p.budgets.usable(t) for t in p.bytes}, "ranks_per_host": p.budgets.ranks_per_host}


def _file_figures(engine, stats, estimate):
    """A tier file's stats with its estimate and its size summed over ranks (a collective)."""
    out = dict(stats, file_estimate=estimate)
    total = torch.tensor([out["file_bytes"]], dtype=torch.int64)
    engine.comm.all_reduce(total, "sum")
    out["file_bytes_sum"] = int(total)
    return out
