"""offload.placement "auto" on a machine: the budgets measured, the choice of
zerort.accounting.placement turned into the concrete offload settings at initialize, before any
state is allocated, and the table for a machine given by flags (Note [auto placement]):

    python -m zerort.accounting.placement_auto --params 13e9 --stage 3 --gpu-gb 139 --ram-gb 120 --disk-gib 64
    python -m zerort.accounting.placement_auto --llama 40,5120,13824,32000 --stage 3 --gpu-gb 139 --ram-gb 120 \\
        --disk-gib 64 --nvme-path /tmp
    python -m zerort.accounting.placement_auto --params 1e9 --stage 2 --here    # this machine's free bytes

Budgets: the device's free bytes (torch.cuda.mem_get_info; a CPU model's device is host RAM),
MemAvailable in /proc/meminfo, and the free bytes at nvme_path (os.statvfs of the folder, or of
its nearest parent that exists). Every rank measures its own and takes the least over the ranks
(one all-reduce), so every rank makes the same choice, or raises the same ConfigError.
"""
import argparse
import dataclasses
import math
import os
import sys

import torch

from zerort.accounting import placement
from zerort.accounting.memory import STATE_BYTES, count_groups, model_groups
from zerort.accounting.nvme_tier import NvmeTier
from zerort.config import Config, native, offload, replace
from zerort.errors import ConfigError

GIB = 1 << 30


def mem_available(path="/proc/meminfo"):
    """MemAvailable in bytes (the kernel's estimate of what can be allocated without swapping)."""
    with open(path) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{path}: no MemAvailable line (a Linux kernel older than 3.14?)")


def disk_free(path):
    """Free bytes for an unprivileged user at path, or at its nearest parent that exists; 0 for no path."""
    if not path:
        return 0
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def device_free(device, ranks_per_host=1):
    """This rank's free bytes on a CUDA device (shared evenly by the ranks on one GPU); None for a CPU model."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    per_gpu = math.ceil(ranks_per_host / max(1, torch.cuda.device_count()))
    return free // per_gpu


def _ranks_per_host(comm):
    from zerort.comm import detect_launch_env

    env = detect_launch_env()
    return max(1, env["local_world_size"]) if env["launcher"] != "none" else comm.size


CAPS_ENV = "ZERORT_OFFLOAD_BUDGETS"


def caps(text):
    """ZERORT_OFFLOAD_BUDGETS, e.g. "ram=8e9,disk=2e11,device=4e10": the most bytes auto may count of each
    budget (to leave room for other jobs on the machine), as {"device"|"ram"|"disk": bytes}."""
    out = {}
    for item in filter(None, (text or "").replace(" ", "").split(",")):
        key, _, value = item.partition("=")
        try:
            out[key] = int(float(value))
        except ValueError:
            out[key] = -1
        if key not in ("device", "ram", "disk") or out[key] < 0:
            raise ConfigError([f"{CAPS_ENV}: got {item!r}; allowed: comma-separated device=BYTES, ram=BYTES, "
                               "disk=BYTES with BYTES a number >= 0 (such as ram=8e9): fix or unset it"])
    return out


def measure(device, nvme_path, comm=None):
    """The Budgets of this machine, each at most its cap in ZERORT_OFFLOAD_BUDGETS (caps): the least over
    comm's ranks when comm is given (a collective)."""
    ranks = _ranks_per_host(comm) if comm is not None else 1
    dev, cap = device_free(device, ranks), caps(os.environ.get(CAPS_ENV))
    vals = [-1 if dev is None else min(dev, cap.get("device", dev)), min(mem_available(), cap.get("ram", 1 << 62)),
            min(disk_free(nvme_path), cap.get("disk", 1 << 62))]
    if comm is not None and comm.size > 1:
        t = torch.tensor(vals, dtype=torch.int64, device=comm.device)
        comm.all_reduce(t, "min")
        vals = [int(v) for v in t.cpu()]
    return placement.Budgets(None if vals[0] < 0 else vals[0], vals[1], vals[2], ranks)


def shape_of(groups, c, world_size):
    """The placement.Shape of these layout groups under the Config c."""
    o = c.offload.optimizer
    return placement.Shape(groups, world_size, c.stage, STATE_BYTES[c.optimizer.state_dtype],
                           STATE_BYTES[c.optimizer.master_dtype], NvmeTier(o.buffer_count, o.chunk_numel),
                           c.reduce_bucket_numel, c.stage3.prefetch)


def settle(c, cand):
    """The Config c with the Candidate's concrete offload settings (placement stays 'auto', for the report)."""
    path = c.offload.optimizer.nvme_path
    return replace(c, offload={"optimizer": {"device": cand.optimizer, "gradient_in_file": cand.gradient_in_file,
                                             "ram_fraction": cand.ram_fraction,
                                             "gradient_on_device": cand.gradient_on_device},
                               "param": {"device": cand.param,
                                         "nvme_path": c.offload.param.nvme_path or (path if cand.param == "nvme"
                                                                                    else None)}})


def builder(c, device):
    """built(cand) for placement.evaluate: '' when zerort builds the candidate for a model on device,
    else the first line of check_tier's refusal."""
    def built(cand):
        if cand.optimizer == "nvme" and not c.offload.optimizer.nvme_path:
            return "no nvme_path"
        if cand.optimizer != "none" and c.optimizer.master_dtype == "bf16":  # parser's rule; the Engine's
            return "a bf16 master stays with the model (optimizer.master_dtype)"
        try:
            offload.check_tier(settle(c, cand), device)
        except ConfigError as e:
            return f"not built for a model on {device.type} (check_tier: {e.problems[0].split(': got')[0]})"
        return ""
    return built


def _world(c, comm):
    """The ranks the state is sharded over (shard_size, or the world)."""
    s = c.shard_size
    if s is None:
        return comm.size
    return _ranks_per_host(comm) if s == "node" else int(s)


def resolve(c, model, device, comm):
    """(Config, Placement): with offload.placement 'auto', c with the chosen placement's offload settings,
    measured on every rank and agreed (a collective); else (c, None). Raises ConfigError, the same on
    every rank, when nothing fits."""
    if c.offload.placement != "auto":
        return c, None
    groups = model_groups(model, c.stage, c.precision, c)
    shape = shape_of(groups, c, _world(c, comm))
    chosen = placement.choose(shape, measure(device, c.offload.optimizer.nvme_path, comm), builder(c, device),
                              cuda=device.type == "cuda")
    return settle(c, chosen.candidate), chosen


def concrete(c, groups, device, world_size):
    """The Placement of the Config c's own offload settings (placement 'manual'), for the memory report, with
    this rank's budgets; None when the settings are none of the candidates (Note [auto placement])."""
    cuda = device.type == "cuda"
    host = lambda tier: "none" if tier == "cpu" and not cuda else tier  # a CPU model's states are in RAM already
    o = c.offload.optimizer
    key = (host(o.device), host(c.offload.param.device), o.gradient_in_file)
    matches = [cand for cand in placement.candidates(c.stage, cuda)
               if (cand.optimizer, cand.param, cand.gradient_in_file) == key]
    if not matches:
        return None
    # The gradient on the device as the Engine has it (off memory only); a tier without a candidate of its
    # own for it (a CPU model's, whose device is RAM, or cpu+params) takes the key's bytes all the same.
    on_device = o.gradient_on_device and native.state_tier(c, device) != "memory"
    cand = next((m for m in matches if m.gradient_on_device == on_device), matches[0])
    try:
        budgets = measure(device, o.nvme_path)
    except (OSError, ConfigError):  # no /proc/meminfo, a bad ZERORT_OFFLOAD_BUDGETS: no budgets to show
        budgets = placement.Budgets(None, 0, 0)
    cand = dataclasses.replace(cand, ram_fraction=o.ram_fraction, gradient_on_device=on_device)
    return placement.Placement(cand, placement.tier_bytes(shape_of(groups, c, world_size), cand, cuda), budgets)


def summary(p, auto=True):
    """One placement as the memory report's lines: what each tier holds, per rank."""
    cand = p.candidate
    lines = [f"placement {'auto' if auto else 'manual'}: {cand.label} (offload optimizer {cand.optimizer}, param "
             f"{cand.param}, gradient_in_file {str(cand.gradient_in_file).lower()}"
             + (", gradient_on_device true" if cand.gradient_on_device else "")
             + (f", ram_fraction {cand.ram_fraction:.4g})" if cand.ram_fraction else ")")]
    for tier in placement.TIERS:
        held = [f"{label} {p.bytes[tier][k] / (1 << 20):.3f}" for k, label in placement.KINDS if p.bytes[tier][k]]
        if held:
            lines.append(f"  {tier}: {', '.join(held)} MiB; of {p.budgets.usable(tier) / (1 << 20):.1f} MiB usable")
    return lines


def llama_numel(layers, hidden, intermediate, vocab, tied=False):
    """Parameters of a Llama-shaped model: per block attention 4h^2, SwiGLU MLP 3hi, two RMSNorms; the
    embedding, the final norm and the head (untied unless tied)."""
    return layers * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) + vocab * hidden + hidden + \
        (0 if tied else vocab * hidden)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m zerort.accounting.placement_auto", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, help="parameter count, e.g. 13e9 (units of --unit-numel at stage 3)")
    ap.add_argument("--llama", help="layers,hidden,intermediate,vocab of a Llama-shaped model (a unit per block)")
    ap.add_argument("--unit-numel", type=int, help="stage-3 unit size (default params/32)")
    ap.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=3)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--ranks-per-host", type=int, help="ranks that share the RAM and disk (default: world size)")
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--optimizer-state-dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--gpu-gb", type=float, help="free GPU memory per rank, GB (1e9); none: a CPU model")
    ap.add_argument("--ram-gb", type=float, help="MemAvailable, GB")
    ap.add_argument("--disk-gb", type=float, help="free disk at nvme_path, GB (1e9)")
    ap.add_argument("--disk-gib", type=float, help="free disk at nvme_path, GiB (2**30)")
    ap.add_argument("--nvme-path", help="with --here: the folder whose free disk counts")
    ap.add_argument("--here", action="store_true", help="measure this machine's budgets (the first GPU, if any)")
    ap.add_argument("--assume-built", action="store_true", help="try every candidate, also those this version "
                    "does not build for the model's device (default: zerort.config.offload.check_tier's answer)")
    a = ap.parse_args(argv)
    if a.llama:
        layers, hidden, inter, vocab = (int(x) for x in a.llama.split(","))
        numel = llama_numel(layers, hidden, inter, vocab)
        unit = a.unit_numel or 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    elif a.params:
        numel, unit = int(a.params), a.unit_numel
    else:
        ap.error("give --params N or --llama layers,hidden,intermediate,vocab")
    ranks = a.ranks_per_host or a.world_size
    if a.here:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        b = measure(dev, a.nvme_path)
        b = placement.Budgets(b.device, b.ram, b.disk, ranks)
    else:
        if a.ram_gb is None:
            ap.error("give --ram-gb (and --gpu-gb, --disk-gb or --disk-gib), or --here")
        disk = a.disk_gib * GIB if a.disk_gib is not None else (a.disk_gb or 0) * 1e9
        b = placement.Budgets(None if a.gpu_gb is None else int(a.gpu_gb * 1e9), int(a.ram_gb * 1e9), int(disk),
                              ranks)
    groups = count_groups(numel, a.stage, a.precision, unit_numel=unit)
    shape = placement.Shape(groups, a.world_size, a.stage, STATE_BYTES[a.optimizer_state_dtype])
    c = replace(Config(stage=a.stage, precision=a.precision),
                offload={"optimizer": {"nvme_path": "nvme" if b.disk else None}})
    built = (lambda cand: "") if a.assume_built else builder(c, torch.device("cpu" if b.device is None else "cuda"))
    ps = placement.evaluate(shape, b, built)
    per = max(p.total() for p in ps) / max(1, numel) * a.world_size
    title = (f"placement for {numel:,} parameters ({numel / 1e9:.2f}B), stage {a.stage}, W={a.world_size}, "
             f"{a.precision} compute, {a.optimizer_state_dtype} Adam states: up to {per:.1f} bytes a parameter "
             "across the tiers (off the device, stage 3 keeps a low-precision shard copy too)")
    print(placement.table(ps, title))
    chosen = [p for p in ps if p.chosen]
    if chosen:
        print("\n".join(summary(chosen[0])))
        return 0
    print("\n".join(placement.refusal(shape, ps)))
    return 1


if __name__ == "__main__":
    sys.exit(main())
