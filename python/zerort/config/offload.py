"""Offload: where the optimizer states and stage 3's parameters live (the Config's offload
section, zerort.config.sections.OffloadConfig), read from either form, and what this
version does with each tier (check_tier, describe).

    ours:      {"offload": {"optimizer": {"device": "cpu"}, "param": {...}, "aio": {...}}}
    DeepSpeed: {"zero_optimization": {"offload_optimizer": {"device": "cpu"},
                                      "offload_param": {...}}, "aio": {...}}

The keys, their defaults and their rules are DeepSpeed's (0.19's offload_config.py and
swap_tensor's aio constants): device none | cpu | nvme; a ratio below 1 only at stage 3;
aio.use_gds only false. Where DeepSpeed ignores a tier it documents for other stages
(offload_param below stage 3, offload_optimizer at stage 0), DeepSpeed's form ignores it too,
resets it before anything here sees it, and rank 0's banner names it
(zerort.config.lenient.below_stage3); zerort's own form names the key as an error (rules).
Both forms read them with the same functions here; only the section names differ.

Note [offload tiers]: the states of a CPU model are in host memory already, so device "cpu"
for a CPU model is accepted and changes nothing in the step. offload_optimizer "cpu" for a GPU
model is the Engine's 'cpu' tier (Note [state tiers], runtime/engine_tiers.cpp): the states and
the FP32 gradient in host memory, the step on the CPU; the engine says so once in its
log line at initialize (zerort.monitoring.progress.announce) and in engine.memory_report().
offload_optimizer.device "nvme" puts a CPU model's master and Adam moments in one file per rank
under nvme_path, streamed through a pool of buffer_count buffers with aio's block_size and
queue_depth, through aio's io_backend (zerort's own key: "auto" takes io_uring where it was
built and the kernel allows it, else a pool of threads; C++ Note [IoQueue backends]) (Note [state
tiers], runtime/engine_tiers.cpp); the step always overlaps the reads
and writes with compute, so pipeline_read and pipeline_write (DeepSpeed's switches for that
overlap) change nothing; zerort's own gradient_in_file puts the FP32 gradient shard in that
file too (Note [gradient in the file], runtime/nvme_gradient.h). offload_param.device "nvme"
(stage 3, a CPU model, with the optimizer states on NVMe too) puts each released unit's
low-precision shard in a second file per rank under offload_param.nvme_path, read by the unit's
gather (and so ahead of use by the unit prefetch) through two staging buffers of the largest
unit's shard (Note [RegionFile]); buffer_count, buffer_size and max_in_cpu size DeepSpeed's
own swap buffers and change nothing here. With the optimizer states in memory, stage 3's
gathers cast from the FP32 master and keep no low-precision shard to offload, so parameters
on NVMe need the states there too, and for the same reason offload_param "cpu" for a GPU model
(its stage-3 shards in host memory, copied to the device by each gather: the Engine's
param_host) needs offload_optimizer "cpu". NVMe for a CUDA model is the same tier as for a CPU
model: the file, its pool and the step on the CPU's cores, with the model's memory reached
through the host tier's mover (C++ Note [state tiers]). zerort's own ram_fraction splits the
nvme tier: that part of master, m and v (whole records, the first ones) stays in host RAM, the
rest goes to the file, and the step streams only the file's part (C++ Note [NVMe state store]);
offload placement "auto", when it takes nvme, keeps there as many records in RAM as fit. zerort's
own gradient_on_device (with 'cpu' or 'nvme') keeps the FP32 gradient shard on the model's device
instead of host memory: the reduces sum into it there, the step copies it down piece by piece
(C++ Note [gradient on the device]); on a CPU model that is host memory either way.
DeepSpeed's partial NVMe offload (ratio < 1: the rest on the model's device) is a tier this
version does not build: check_tier refuses it with a ConfigError at initialize, from the config
and the model's device alone, so every rank raises the same error before any collective.

Off memory (offload_optimizer "cpu" or "nvme"), zerort's own offload_optimizer.overlap_step
(default: on there) overlaps the update with the next forward, unit by unit, never a step behind
(C++ Note [overlapped step], runtime/step_overlap.h). A CPU model's offload_optimizer "cpu" keeps
its states where they are, in memory, unless overlap_step is true: then it runs the Engine's
'cpu' tier, its mover a memcpy, so the update runs beside the forward there too. That costs
the reduces' FP32 scratch of the largest bucket's shard more than memory does, which the memory
report counts in the FP32 gradient's category (8 x Linear(1024) at stage 2, one bucket: 208 MiB
held, 208 estimated).
"""
import dataclasses

from zerort.config.reader import MAX_IO_DEPTH, MAX_NUMEL
from zerort.config.sections import Aio, OffloadOptimizer, OffloadParam
from zerort.errors import ConfigError

DEVICES = ("none", "cpu", "nvme")
IO_BACKENDS = ("auto", "io_uring", "threads")  # C++ Note [IoQueue backends] (io/io_backend.h)


def section(r, d, name):
    """(section dict, its reader); a null section is an absent one (DeepSpeed's Optional)."""
    if name in d and d[name] is None:
        d[name] = {}
    return r.child(d, name)


def _common(r, d, default):
    """The keys both offload sections have, as DeepSpeed names them."""
    return dict(device=r.choice(d, "device", default.device, DEVICES),
                nvme_path=r.typed(d, "nvme_path", default.nvme_path, (str, type(None)), "a folder path (a string) "
                                  "or null"),
                pin_memory=r.boolean(d, "pin_memory", default.pin_memory),
                buffer_count=r.number(d, "buffer_count", default.buffer_count, integer=True, low=0))


def read_optimizer(r, d):
    """DeepSpeed's offload_optimizer keys (our offload.optimizer) from the dict d."""
    o = OffloadOptimizer()
    return OffloadOptimizer(**_common(r, d, o), pipeline_read=r.boolean(d, "pipeline_read", o.pipeline_read),
                            pipeline_write=r.boolean(d, "pipeline_write", o.pipeline_write),
                            fast_init=r.boolean(d, "fast_init", o.fast_init),
                            ratio=r.number(d, "ratio", o.ratio, low=0, high=1),
                            chunk_numel=r.number(d, "chunk_numel", o.chunk_numel, integer=True, low=1,
                                                 high=MAX_NUMEL, integral_float=True),
                            gradient_in_file=r.boolean(d, "gradient_in_file", o.gradient_in_file),
                            ram_fraction=r.number(d, "ram_fraction", o.ram_fraction, low=0, high=1),
                            gradient_on_device=r.boolean(d, "gradient_on_device", o.gradient_on_device),
                            overlap_step=r.boolean(d, "overlap_step", o.overlap_step))


def read_param(r, d):
    """DeepSpeed's offload_param keys (our offload.param) from the dict d."""
    p = OffloadParam()
    numel = lambda key, default: r.number(d, key, default, integer=True, low=0, high=MAX_NUMEL, integral_float=True)
    return OffloadParam(**_common(r, d, p), buffer_size=numel("buffer_size", p.buffer_size),
                        max_in_cpu=numel("max_in_cpu", p.max_in_cpu))


def read_aio(r, d):
    """The aio keys (DeepSpeed's top-level aio, our offload.aio) from the dict d."""
    a = Aio()
    count = lambda key, default, high=None: r.number(d, key, default, integer=True, low=1, high=high,
                                                     integral_float=True)
    out = Aio(block_size=count("block_size", a.block_size), queue_depth=count("queue_depth", a.queue_depth,
                                                                              MAX_IO_DEPTH),
              intra_op_parallelism=count("intra_op_parallelism", a.intra_op_parallelism),
              single_submit=r.boolean(d, "single_submit", a.single_submit),
              overlap_events=r.boolean(d, "overlap_events", a.overlap_events),
              io_backend=r.choice(d, "io_backend", a.io_backend, IO_BACKENDS))
    present, gds = r._take(d, "use_gds")
    if present and gds is not False:
        r.bad("use_gds", gds, "false (zerort does not support GPUDirect Storage; leave the key out or set it to "
              "false)", not isinstance(gds, bool))
    return out


PLACEMENTS = ("manual", "auto")


def read_ours(r, cfg, c):
    """Our form's offload section {"optimizer": {...}, "param": {...}, "aio": {...}, "placement": ...}
    into the Draft c; "offload": "auto" is short for {"placement": "auto"}."""
    if cfg.get("offload") == "auto":
        cfg["offload"] = {"placement": "auto"}
    off, rf = section(r, cfg, "offload")
    c.offload.placement = rf.choice(off, "placement", c.offload.placement, PLACEMENTS)
    for name, read in (("optimizer", read_optimizer), ("param", read_param), ("aio", read_aio)):
        d, rd = section(rf, off, name)
        setattr(c.offload, name, read(rd, d))
        rd.leftover(d)
    rf.leftover(off)


def rules(c, problems, keys):
    """DeepSpeed's rules that join the offload keys with the stage; keys: the form's names of
    (offload_optimizer, offload_param, zero stage)."""
    opt, par = c.offload.optimizer, c.offload.param
    opt_key, par_key, stage_key = keys
    if par.device != "none" and c.stage != 3:
        problems.lines.append(f"{par_key}.device: got {par.device!r} at {stage_key} {c.stage}; parameter offload "
                              "works at stage 3 only (DeepSpeed documents it so, and ignores it below): set "
                              f"{stage_key} to 3, or remove {par_key}")
    if opt.ratio < 1 and c.stage != 3:
        problems.lines.append(f"{opt_key}.ratio: got {opt.ratio!r} at {stage_key} {c.stage}; a partial optimizer "
                              f"offload (ratio < 1) works at stage 3 only (DeepSpeed's rule): set {stage_key} to 3, "
                              "or ratio to 1")
    if opt.device != "none" and c.stage == 0:
        problems.lines.append(f"{opt_key}.device: got {opt.device!r} at {stage_key} 0; optimizer offload works at "
                              "stages 1-3 (DeepSpeed documents it so, and ignores it at stage 0): set "
                              f"{stage_key} to 1, 2 or 3")
    if opt.gradient_in_file and opt.device != "nvme":
        problems.lines.append(f"{opt_key}.gradient_in_file: true with device {opt.device!r}; it puts the FP32 "
                              "gradient shard in the NVMe state file, so it needs device 'nvme' (remove the key, or "
                              "set device to 'nvme')")
    if opt.ram_fraction > 0 and opt.device != "nvme":
        problems.lines.append(f"{opt_key}.ram_fraction: got {opt.ram_fraction!r} with device {opt.device!r}; it "
                              "keeps part of the NVMe tier's states in RAM, so it needs device 'nvme' (remove the "
                              "key, or set device to 'nvme')")
    if opt.ram_fraction > 0 and opt.gradient_in_file:
        problems.lines.append(f"{opt_key}.ram_fraction: got {opt.ram_fraction!r} with gradient_in_file true; a split "
                              "keeps the FP32 gradient in RAM, which gradient_in_file would take out of it: remove "
                              "gradient_in_file, or set ram_fraction to 0")
    if opt.gradient_on_device and opt.device == "none":
        problems.lines.append(f"{opt_key}.gradient_on_device: true with device 'none'; it keeps the FP32 gradient "
                              "shard on the model's device while master, m and v are offloaded, and with device "
                              "'none' all of them are there already: set device to 'cpu' or 'nvme', or remove the key")
    if opt.gradient_on_device and opt.gradient_in_file:
        problems.lines.append(f"{opt_key}.gradient_on_device: true with gradient_in_file true; the FP32 gradient "
                              "shard goes to one place: remove one of them")
    if c.offload.placement == "auto":
        given = [f"{opt_key}.device {opt.device!r}"] * (opt.device != "none") + \
            [f"{par_key}.device {par.device!r}"] * (par.device != "none") + \
            [f"{opt_key}.gradient_in_file true"] * opt.gradient_in_file + \
            [f"{opt_key}.gradient_on_device true"] * opt.gradient_on_device + \
            [f"{opt_key}.ram_fraction {opt.ram_fraction!r}"] * (opt.ram_fraction > 0)
        if given:
            problems.lines.append(f"offload placement 'auto': given with {', '.join(given)}; auto chooses these "
                                  "itself (Note [auto placement]): remove them (keep nvme_path, where auto may put "
                                  "files), or leave the placement 'manual'")
    for key, section in ((opt_key, opt), (par_key, par)):
        if section.device == "nvme" and not section.nvme_path:
            problems.lines.append(f"{key}.nvme_path: missing; device 'nvme' needs the folder for its files")


def with_device(section, device):
    """The OffloadOptimizer or OffloadParam section with its device set (DeepSpeed's legacy
    cpu_offload keys)."""
    return dataclasses.replace(section, device=device)


KEY_NAMES = {"optimizer": "zero_optimization.offload_optimizer.device (offload.optimizer.device in zerort's form; "
                          "the legacy zero_optimization.cpu_offload sets it)",
             "param": "zero_optimization.offload_param.device (offload.param.device in zerort's form; the legacy "
                      "zero_optimization.cpu_offload_param sets it)"}


def check_tier(config, device):
    """Refuses an offload tier this version does not build (Note [offload tiers]): from the
    config and the model's device only, so it raises alike on every rank, before any
    collective."""
    lines = []
    opt, par = config.offload.optimizer, config.offload.param
    for name in ("optimizer", "param"):
        tier = getattr(config.offload, name).device
        host = tier == "cpu" and (name == "optimizer" or opt.device == "cpu")  # the Engine's 'cpu' tier
        if name == "param" and tier == "cpu" and device.type != "cpu" and not host:
            lines.append(f"{KEY_NAMES[name]}: got 'cpu' with offload_optimizer.device {opt.device!r}; for a model "
                         f"on {device}, stage 3's parameter shards go to host memory beside the optimizer states "
                         "(with the states on the device, gathers cast from the FP32 master and keep no "
                         "low-precision shard to move): set zero_optimization.offload_optimizer.device to 'cpu' too")
            continue
        built = tier in ("none", "nvme") or device.type == "cpu" or host  # nvme: the host tier's mover too
        if not built:
            where = "NVMe" if tier == "nvme" else "host memory"
            lines.append(f"{KEY_NAMES[name]}: got {tier!r}; offloading the {_WHAT[name]} to {where} for a model on "
                         f"{device} is not built yet in this version of zerort: set the device to 'none' (the "
                         "states stay where the model is), or train a CPU model"
                         + (" (its optimizer states can go to 'cpu' or 'nvme')" if name == "optimizer" else
                            " (its parameters can go to 'cpu', where they are already, or 'nvme')"))
    if par.device == "nvme" and opt.device != "nvme":
        lines.append(f"zero_optimization.offload_param.device: got 'nvme' with offload_optimizer.device "
                     f"{opt.device!r}; with the optimizer states in memory, stage 3 gathers each unit from the FP32 "
                     "master and keeps no low-precision shard to put on NVMe: set "
                     "zero_optimization.offload_optimizer.device to 'nvme' as well (and its nvme_path)")
    if opt.device == "nvme" and opt.ratio < 1:
        lines.append(f"zero_optimization.offload_optimizer.ratio: got {opt.ratio!r} with device 'nvme'; a partial "
                     "NVMe offload with the rest on the model's device is not built yet in this version of zerort: "
                     "set ratio to 1 (zerort's own offload_optimizer.ram_fraction keeps a part in host RAM instead)")
    if opt.device == "nvme" and opt.buffer_count < 1:
        lines.append("zero_optimization.offload_optimizer.buffer_count: got 0 with device 'nvme'; the NVMe tier "
                     "streams through at least 1 buffer (3 or more overlap reading, stepping and writing): set it "
                     "to 4, DeepSpeed's default")
    if lines:
        raise ConfigError(lines)


_WHAT = {"optimizer": "optimizer states", "param": "stage-3 parameters"}


def describe(config, device):
    """The offload as one phrase for the log line and the memory report (Note [offload tiers])."""
    tiers = [(name, getattr(config.offload, name).device) for name in ("optimizer", "param")]
    on = [f"{_WHAT[name]} on {tier}" for name, tier in tiers if tier != "none"]
    if config.offload.optimizer.gradient_in_file:
        on.insert(1, "the FP32 gradient shard on nvme")
    elif config.offload.optimizer.gradient_on_device and config.offload.optimizer.device != "none":
        on.insert(1, "the FP32 gradient shard on the model's device")
    auto = "placement auto: " if config.offload.placement == "auto" else ""
    if not on:
        return auto + "offload none"
    host = " (a CPU model: host memory is where they already are)" if device.type == "cpu" and \
        any(tier == "cpu" for _, tier in tiers) else ""
    return f"{auto}offload {', '.join(on)}{host}"
