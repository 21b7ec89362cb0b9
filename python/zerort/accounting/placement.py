"""offload.placement "auto": where the FP32 master, Adam's m and v, the FP32 gradient shard and
stage 3's low-precision parameter shards go, across the model's device, host RAM and NVMe.

choose() is the decision, a pure function of the model's layout (its Groups: sizes per unit or
bucket and element bytes), the stage, the world size, the state dtypes and the Budgets, so it is
tested with made-up budgets (tests/python/test_offload_auto.py). zerort.accounting.placement_auto
measures the budgets on a machine, turns the choice into the concrete offload settings before
anything is allocated, and prints the table for a machine given by flags:

    python -m zerort.accounting.placement_auto --params 13e9 --stage 3 --gpu-gb 139 --ram-gb 120 --disk-gib 64

Note [auto placement]: the candidates are the tiers zerort builds, each a whole set of offload
settings (offload_optimizer device, gradient_in_file, gradient_on_device, offload_param device), in order of speed:
every later one moves more bytes per step over a slower link to free a faster tier.

    device         everything on the model's device (offload none)
    cpu dev-grad   master, m and v in host RAM, the step on the CPU; the FP32 gradient shard stays on
                   the device (gradient_on_device; a CUDA model)
    cpu            and the FP32 gradient in host RAM too (a CUDA model)
    cpu+params     and stage 3's shards in host RAM, copied in by each gather (stage 3, a CUDA model)
    nvme dev-grad  master, m and v in a file per rank under nvme_path, the gradient on the device
                   (gradient_on_device; a CUDA model); split like nvme
    nvme           master, m and v in that file, the gradient in RAM; split: as many of their
                   records as RAM holds kept in RAM (ram_fraction), the rest in the file
    nvme+grad      and the FP32 gradient shard in that file (gradient_in_file), nothing split
    nvme+params    and stage 3's shards in a second file (offload_param nvme; stage 3)

A gradient on the device comes before the same tier with it in RAM: it moves fewer bytes over PCIe
(4 an element once a step, copied down by the update, against 8 an element each micro-step for
the reduce's scratch up and back; C++ Note [gradient on the device]) and leaves RAM to more of the
nvme tier's records, at the price of 4 bytes an element of device memory.

Off memory, stage 3 keeps each unit's low-precision shard apart (Note [state tiers]): counted on the
model's device unless offload_param moves it (host RAM, or the parameter file). On a CPU model the
device is host RAM, so "cpu" and "cpu+params" are "device" and are not tried. The first candidate
that zerort builds for this model (zerort.config.offload.check_tier accepts it; the built argument)
and that fits every budget, less the margin, is the choice;
when none fits, ConfigError names every candidate's need beside each budget and how to fix it.
The nvme candidate's split is the largest ram_fraction whose records fit the RAM left after the
rest of that candidate (whole records: C++ Note [NVMe state store]); every record in RAM is one
the step does not read and write on the disk, so more in RAM is never slower. That lets a state
bigger than RAM and than the disk alone train. Not built, so not tried: master, m and v split
between the device and the host (DeepSpeed's ratio), or with the gradient in the file.

The margin: of each budget 90% less 1 GiB is usable (MARGIN_FRACTION, MARGIN_BYTES). The rest
is for what zerort cannot count before the model runs: activations and autograd's buffers,
the CUDA context and the allocator's caching, the page cache (ZERORT_OFFLOAD_BUDGETS caps a budget
where they need more). RAM and disk are the host's, shared by the ranks on it (ranks_per_host); the
device budget is one rank's.
"""
import dataclasses
import math

from zerort.accounting.memory import _in_memory, _largest_shard, _unit_shard_bytes, state_numel
from zerort.accounting.nvme_tier import NvmeTier
from zerort.errors import ConfigError

MARGIN_FRACTION = 0.10
MARGIN_BYTES = 1 << 30
TIERS = ("device", "ram", "nvme")
# What a tier holds: working: the low-precision parameters and gradient buffers, the reduce scratch and
# the gathered stage-3 units (always on the device); params: stage 3's low-precision shard copies (off
# memory only: Note [state tiers]); io: the NVMe tier's pool and staging buffers, and off memory the
# host buffer each bucket's new low-precision shard goes up through (the largest bucket's).
KINDS = (("working", "working"), ("params", "s3 shards"), ("master", "master"), ("adam_m", "adam_m"),
         ("adam_v", "adam_v"), ("grad_shard", "fp32 grad"), ("io", "i/o bufs"))
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One concrete placement: the offload settings it resolves to (Note [auto placement])."""
    name: str
    optimizer: str = "none"       # offload.optimizer.device
    param: str = "none"           # offload.param.device
    gradient_in_file: bool = False
    split: bool = False           # may keep part of the nvme tier's records in RAM (evaluate picks ram_fraction)
    ram_fraction: float = 0.0     # offload.optimizer.ram_fraction
    gradient_on_device: bool = False  # offload.optimizer.gradient_on_device

    def settings(self):
        return {"optimizer": self.optimizer, "param": self.param, "gradient_in_file": self.gradient_in_file,
                "ram_fraction": self.ram_fraction, "gradient_on_device": self.gradient_on_device}

    @property
    def label(self):
        """The name, and a split's part in RAM in whole percent, rounded down ("<1%" for less)."""
        pct = math.floor(100 * self.ram_fraction)
        return f"{self.name} {pct if pct else '<1'}% ram" if self.ram_fraction else self.name


CANDIDATES = (Candidate("device"), Candidate("cpu dev-grad", "cpu", gradient_on_device=True), Candidate("cpu", "cpu"),
              Candidate("cpu+params", "cpu", "cpu"), Candidate("nvme dev-grad", "nvme", split=True,
                                                               gradient_on_device=True),
              Candidate("nvme", "nvme", split=True), Candidate("nvme+grad", "nvme", gradient_in_file=True),
              Candidate("nvme+params", "nvme", "nvme", gradient_in_file=True))


@dataclasses.dataclass(frozen=True)
class Budgets:
    """Free bytes per tier. device: this rank's GPU (torch.cuda.mem_get_info), None for a CPU model,
    whose device is host RAM; ram: the host's MemAvailable; disk: free at nvme_path (0 without one);
    ranks_per_host: the ranks that share the RAM and the disk."""
    device: int | None
    ram: int
    disk: int
    ranks_per_host: int = 1

    def usable(self, tier):
        total = {"device": self.device, "ram": self.ram, "nvme": self.disk}[tier]
        return max(0, int(total * (1 - MARGIN_FRACTION)) - MARGIN_BYTES) if total else 0


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the bytes follow from: the layout's Groups (zerort.accounting.memory), the ranks the
    state is sharded over, the stage, bytes per element of m and v (state_bytes) and of the
    master and gradient (master_bytes), the NVMe tier's pool settings (an NvmeTier) and the
    Config's bucket and prefetch sizes."""
    groups: list
    world_size: int
    stage: int
    state_bytes: int = 4
    master_bytes: int = 4
    nvme: NvmeTier = NvmeTier()
    reduce_bucket_numel: int = 1 << 24
    prefetch: int = 1

    @property
    def numel(self):
        return sum(sum(g.numels) for g in self.groups)


def _host_out(s):
    """Off memory: the host buffer AdamW writes each bucket's low-precision shard into, the largest's."""
    return _largest_shard(s.groups, s.world_size, s.stage, s.reduce_bucket_numel) * \
        max((g.element_bytes for g in s.groups), default=0)


def tier_bytes(shape, cand, cuda=True):
    """{tier: {kind: bytes}} per rank for the Candidate cand (a CPU model's device is its RAM)."""
    s, out = shape, {t: {k: 0 for k, _ in KINDS} for t in TIERS}
    mem = _in_memory(s.groups, s.world_size, s.stage, s.reduce_bucket_numel, s.prefetch, False, s.state_bytes,
                     s.master_bytes)
    dev = "device" if cuda else "ram"
    out[dev]["working"] = sum(mem[k] for k in ("lp_params", "lp_grads", "comm_buffers", "gathered_units"))
    opt_numel = mem["grad_shard"] // s.master_bytes
    shards = sum(_unit_shard_bytes(s.groups, s.world_size)) if s.stage == 3 else 0
    largest = 4 * _largest_shard(s.groups, s.world_size, s.stage, s.reduce_bucket_numel)
    # The gradient on the device: no reduce scratch, a host piece to copy it down through (C++ Note
    # [gradient on the device]); else off memory each reduce's scratch on the device (Note [state tiers]).
    scratch, piece = (0, 4 * s.nvme.gradient_piece(cand.optimizer == "nvme")) if cand.gradient_on_device \
        else (largest, 0)
    if cand.optimizer in ("none", "cpu"):
        where = dev if cand.optimizer == "none" else "ram"
        for k in ("master", "adam_m", "adam_v", "grad_shard"):
            out[where][k] = mem[k]
        if s.master_bytes == 2:  # a bf16 master's reduces sum in an FP32 scratch (memory.exact)
            out[where]["grad_shard"] += largest
        if cand.optimizer == "cpu":  # the shard copies with the model, or in RAM
            if cand.gradient_on_device:
                out[dev]["grad_shard"], out["ram"]["grad_shard"] = out["ram"]["grad_shard"], 0
            out[dev]["working"] += scratch
            out["ram" if cand.param == "cpu" else dev]["params"] = shards
            out["ram"]["io"] = _host_out(s) + piece
        return out
    nv = dataclasses.replace(s.nvme, params=cand.param == "nvme", gradients=cand.gradient_in_file,
                             ram_fraction=cand.ram_fraction)
    if cuda:  # the reduce's scratch on the device, whose sums the mover takes to the host
        out[dev]["working"] += scratch
    in_ram = nv.ram_elements(opt_numel)  # a split's records; the file's: every other chunk whole
    in_file = nv.chunks(opt_numel) * nv.aligned(nv.chunk_numel) - in_ram
    for tier, n in (("ram", in_ram), ("nvme", in_file)):
        out[tier].update(master=4 * n, adam_m=s.state_bytes * n, adam_v=s.state_bytes * n)
    out["ram"]["io"] = nv.pool_bytes(s.state_bytes) + _host_out(s) + piece
    if cand.gradient_in_file:
        out["nvme"]["grad_shard"], out["ram"]["grad_shard"] = nv.aligned(4 * opt_numel), largest
    else:
        out[dev if cand.gradient_on_device else "ram"]["grad_shard"] = 4 * opt_numel
    if cand.param == "nvme":
        out["nvme"]["params"] = sum(nv.aligned(b) for b in _unit_shard_bytes(s.groups, s.world_size))
        out["ram"]["io"] += 2 * nv.aligned(max(_unit_shard_bytes(s.groups, s.world_size), default=0) or 1)
    else:
        out[dev]["params"] = shards  # Note [state tiers]: the shard copies stay with the model
    return out


def candidates(stage, cuda):
    """The Candidates worth trying for this stage on this kind of device, fastest first."""
    if stage == 0:  # offload works at stages 1-3 (zerort.config.offload.rules)
        return [CANDIDATES[0]]
    out = [c for c in CANDIDATES if stage == 3 or c.param == "none"]
    return [c for c in out if cuda or (c.optimizer != "cpu" and not c.gradient_on_device)]


@dataclasses.dataclass
class Placement:
    """One candidate's bytes per tier (per rank), the budgets, and why it was passed over
    (refused: check_tier's words; short: {tier: bytes missing on the host}); chosen: whether it is
    the placement taken."""
    candidate: Candidate
    bytes: dict
    budgets: Budgets
    refused: str = ""
    short: dict = dataclasses.field(default_factory=dict)
    chosen: bool = False

    def host_need(self, tier):
        """Bytes needed of a tier's budget: a rank's on the device, the host's ranks' on RAM and disk."""
        per_rank = sum(self.bytes[tier].values())
        return per_rank if tier == "device" else per_rank * self.budgets.ranks_per_host

    def fits(self):
        return not self.refused and not self.short

    def total(self):
        """Bytes per rank across every tier."""
        return sum(sum(kinds.values()) for kinds in self.bytes.values())


def evaluate(shape, budgets, built=lambda cand: "", cuda=None):
    """Every candidate's Placement, in order; the first that is built and fits is chosen.
    built(cand): "" when zerort builds it for this model, else why not. cuda: whether the
    model is on a GPU (default: budgets.device is not None)."""
    cuda = budgets.device is not None if cuda is None else cuda
    out, taken = [], False
    for cand in candidates(shape.stage, cuda):
        refused = built(cand)
        cand = with_split(shape, cand, budgets, cuda) if cand.split and not refused else cand
        p = Placement(cand, tier_bytes(shape, cand, cuda), budgets, refused=refused)
        for tier in TIERS:
            need = p.host_need(tier)
            if need > budgets.usable(tier):
                p.short[tier] = need - budgets.usable(tier)
        if p.fits() and not taken:
            p.chosen = taken = True
        out.append(p)
    return out


def with_split(shape, cand, budgets, cuda):
    """cand with the largest ram_fraction whose RAM records fit the host's usable RAM beside the rest of
    cand's RAM bytes (Note [auto placement]); 0 when none fits."""
    room = budgets.usable("ram") // budgets.ranks_per_host - sum(tier_bytes(shape, cand, cuda)["ram"].values())
    records = room // shape.nvme.record_bytes(shape.state_bytes) if room > 0 else 0
    numel = state_numel(shape.groups, shape.world_size, shape.stage, shape.reduce_bucket_numel)
    return dataclasses.replace(cand, ram_fraction=shape.nvme.fraction_for(numel, records))


def choose(shape, budgets, built=lambda cand: "", cuda=None):
    """The chosen Placement (See evaluate), or ConfigError with every candidate's numbers."""
    placements = evaluate(shape, budgets, built, cuda)
    for p in placements:
        if p.chosen:
            return p
    raise ConfigError(refusal(shape, placements))


def _gb(n):
    return f"{n / GB:.1f} GB"


def refusal(shape, placements):
    """ConfigError lines: what each candidate needs beside each budget, and how to fix it."""
    b = placements[0].budgets
    budget = ", ".join(f"{t} {_gb(b.usable(t))}" for t in TIERS if t != "device" or b.device is not None)
    lines = [f"offload.placement: got 'auto', and no placement zerort builds fits {shape.numel:,} parameters at "
             f"stage {shape.stage}, W={shape.world_size}, {b.ranks_per_host} rank(s) a host. Usable budgets "
             f"(Note [auto placement]: 90% of the free bytes less 1 GiB): {budget}"]
    for p in placements:
        need = ", ".join(f"{t} {_gb(p.host_need(t))}" for t in TIERS if p.host_need(t))
        why = p.refused or "short of " + ", ".join(f"{t} by {_gb(n)}" for t, n in p.short.items())
        lines.append(f"  {p.candidate.label}: needs {need}; {why}")
    usable = [p for p in placements if not p.refused]
    best = min(usable, key=lambda p: sum(p.short.values()), default=None)
    fix = "; fix: free or add memory or disk, train on more ranks (the state is sharded over W)"
    if best is not None:
        fix += (f"; the nearest is {best.candidate.label}, short by "
                + ", ".join(f"{_gb(n)} of {t}" for t, n in best.short.items()))
    if b.disk == 0:
        fix += "; give offload.optimizer.nvme_path (a folder on a fast disk) to let auto use NVMe"
    lines.append("  " + fix.removeprefix("; ") + ", or use optimizer.state_dtype bf16 (4 bytes a parameter less)")
    lines.append("  " + split_line(placements))
    return lines


def split_line(placements):
    """Whether the budgets together would hold the thriftiest candidate's bytes, had its states been split
    in a way this version does not build (Note [auto placement]: onto the device too, or beside the gradient
    in the file)."""
    b, need = placements[0].budgets, min(p.host_need("device") + p.host_need("ram") + p.host_need("nvme")
                                         for p in placements)
    room = sum(b.usable(t) for t in TIERS if t != "device" or b.device is not None)
    verdict = "would fit only split in a way this version does not build (master, m and v partly on the device, " \
        "or split between RAM and NVMe with the gradient in the file)" if need <= room else \
        "would not fit however it were split"
    return f"the tiers together: {_gb(room)} usable for {_gb(need)} at the least: it {verdict}"


def table(placements, title=""):
    """Every candidate's bytes per tier and kind, the budgets, and which one is chosen (GB = 1e9)."""
    b = placements[0].budgets
    lines = [title] if title else []
    lines.append(f"budgets (usable after the margin, Note [auto placement]): device "
                 f"{'= ram (a CPU model)' if b.device is None else _gb(b.usable('device'))}, ram {_gb(b.usable('ram'))}"
                 f", nvme {_gb(b.usable('nvme'))}; {b.ranks_per_host} rank(s) share the host's ram and disk")
    lines.append(f"{'placement':22s}{'tier':>7s}" + "".join(f"{label:>10s}" for _, label in KINDS)
                 + f"{'total':>10s}{'budget':>10s}  verdict")
    tiers = [t for t in TIERS if t != "device" or b.device is not None]
    for p in placements:
        verdict = "CHOSEN" if p.chosen else "not built" if p.refused else "fits" if not p.short else \
            "short of " + ", ".join(p.short)
        for i, tier in enumerate(tiers):
            cells = "".join(f"{p.bytes[tier][k] / GB:10.2f}" for k, _ in KINDS)
            lines.append(f"{p.candidate.label if i == 0 else '':22s}{tier:>7s}{cells}{p.host_need(tier) / GB:10.1f}"
                         f"{b.usable(tier) / GB:10.1f}  {verdict if i == 0 else ''}".rstrip())
    lines.append("per rank per kind; total and budget per host for ram and nvme; GB = 1e9 bytes")
    return "\n".join(lines)
