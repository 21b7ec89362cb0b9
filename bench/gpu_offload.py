"""Training what does not fit the GPU: one table for a Llama-shaped model (issue 46) with a row each for
zerort with the states on the GPU (where they fit), in host memory (offload "cpu"), on NVMe and placed by
offload.placement "auto", and DeepSpeed ZeRO-2 and ZeRO-3 with offload_optimizer "cpu" (offload_param
"cpu" at stage 3) when a Python with deepspeed is at hand (--ds-python; default this one if it imports
deepspeed, else .venv-ds from make bench-ds; its rows are skipped with the reason otherwise).

    python bench/gpu_offload.py --params 6.5e9 --steps 16                       # the speed table
    python bench/gpu_offload.py --params 13e9 --stage 3 --rows auto --steps 3     # the capacity run
    python bench/gpu_offload.py --device cpu --tiny --steps 2                    # a smoke run, seconds

Each row is its own process (this script with --row), so peak RSS, peak GPU memory and the disk bytes
(/proc/self/io, whole process, over the timed steps) are that row's alone. The model is built on the
meta device: zerort makes it real unit by unit inside initialize (zerort.engine.meta_init), DeepSpeed's
rows take it to the GPU with to_empty and initialise it in place, so 13B builds in seconds. Columns:
step time median and p90 over --steps steps after one warm-up, tokens/s (micro-batch x sequence / median),
the GPU's idle fraction (the engine's figure when it reports one, update_wait_ms, the forward's wait for the
overlapped update, which on a CPU model is the compute's idle fraction; else one more step
under the CUDA profiler, 1 - the union of its device events / the step's time; else NVML's
utilisation sampled through the steps, torch.cuda.utilization; n/a on a CPU), peak GPU memory
(torch.cuda.max_memory_allocated), peak RSS, and the disk bytes read and written. Every row prints its
losses, and the auto row the placement chosen.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)
from llama_meta import Llama, init_in_place  # noqa: E402
ROWS = ("gpu", "cpu", "cpu-dg", "nvme", "auto", "ds2", "ds3")
LABELS = {"gpu": "zerort, states on the GPU", "cpu": "zerort, offload cpu",
          "cpu-dg": "zerort, offload cpu, FP32 gradient on the GPU", "nvme": "zerort, offload nvme",
          "auto": "zerort, placement auto", "ds2": "DeepSpeed ZeRO-2, offload_optimizer cpu",
          "ds3": "DeepSpeed ZeRO-3, offload_optimizer + offload_param cpu"}
# Llama shapes by hidden size: (heads, intermediate); layers follow from --params.
SHAPES = {1024: (16, 2816), 2048: (16, 5632), 3072: (24, 8192), 4096: (32, 11008), 5120: (40, 13824),
          6656: (52, 17920), 8192: (64, 28672)}
TINY = dict(layers=2, hidden=64, heads=4, intermediate=176, vocab=256, seq=32, batch=2)
GB = 1e9


def shape_of(a):
    """The model's shape from --tiny, --layers/--hidden or --params (a Llama ladder hidden size)."""
    if a.tiny:
        return dict(TINY)
    vocab, seq, batch = a.vocab, a.seq, a.batch
    if a.hidden:
        hidden = a.hidden
    else:
        ladder = [(1.5e9, 2048), (4.5e9, 3072), (9e9, 4096), (20e9, 5120), (45e9, 6656)]
        hidden = next((h for top, h in ladder if a.params < top), 8192) if a.params >= 0.5e9 else 1024
    heads, inter = SHAPES.get(hidden, (max(1, hidden // 128), 256 * round(2.6875 * hidden / 256)))
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = a.layers or max(1, round((a.params - 2 * vocab * hidden) / per_layer))
    return dict(layers=layers, hidden=hidden, heads=heads, intermediate=inter, vocab=vocab, seq=seq, batch=batch)


def numel_of(s):
    return s["layers"] * (4 * s["hidden"] ** 2 + 3 * s["hidden"] * s["intermediate"] + 2 * s["hidden"]) + \
        2 * s["vocab"] * s["hidden"] + s["hidden"]


def disk_io():
    """(read_bytes, write_bytes) of this process so far (/proc/self/io: what reached the block layer)."""
    try:
        with open("/proc/self/io") as f:
            d = dict(line.split(": ") for line in f.read().splitlines())
        return int(d["read_bytes"]), int(d["write_bytes"])
    except OSError:
        return 0, 0


class Utilisation:
    """NVML's GPU utilisation (torch.cuda.utilization), sampled every 50 ms while open; None without NVML."""

    def __init__(self, cuda):
        self.samples, self.stop, self.thread = [], threading.Event(), None
        try:
            self.ok = cuda and torch.cuda.utilization() is not None
        except Exception:  # no pynvml / amdsmi: no figure
            self.ok = False

    def __enter__(self):
        if self.ok:
            def sample():
                while not self.stop.wait(0.05):
                    self.samples.append(torch.cuda.utilization())
            self.thread = threading.Thread(target=sample, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread:
            self.thread.join()

    def idle(self):
        return 1 - statistics.mean(self.samples) / 100 if self.samples else None


def profiled_idle(step, sync):
    """The GPU's idle fraction over one more step: 1 - (the union of its kernels' and copies' intervals, from
    the CUDA profiler's events) / the step's wall time; None where the profiler gives no device events."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sync()
            t = time.perf_counter()
            step()
            sync()
            wall = time.perf_counter() - t
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as e:  # no kineto / CUPTI here
        print(f"profiler: no device events ({type(e).__name__}: {e})", flush=True)
        return None
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # microseconds; overlapping streams count once
        if b > end:
            busy += b - max(a, end)
            end = b
    return max(0.0, 1 - busy / 1e6 / wall) if spans else None


def zerort_config(row, a, nvme_dir):
    import zerort  # noqa: F401  (the engine's config keys)

    c = {"stage": a.stage, "precision": "bf16", "optimizer": {"lr": a.lr}, "gradient_clipping": 1.0,
         "stage3": {"unit_modules": ["Block"]}}
    if row in ("cpu", "cpu-dg"):  # cpu-dg: C++ Note [gradient on the device]
        c["offload"] = {"optimizer": {"device": "cpu", "gradient_on_device": row == "cpu-dg"},
                        "param": {"device": "cpu" if a.stage == 3 else "none"}}
    elif row == "nvme":
        c["offload"] = {"optimizer": {"device": "nvme", "nvme_path": nvme_dir, "gradient_in_file": True},
                        "param": {"device": "nvme", "nvme_path": nvme_dir} if a.stage == 3 else {}}
    elif row == "auto":
        c["offload"] = {"placement": "auto", "optimizer": {"nvme_path": nvme_dir}}
    return c


def does_not_fit(model, cfg, device):
    """Why the states do not fit the device (the gpu row is skipped then), or ''."""
    from zerort.accounting import placement, placement_auto
    from zerort.accounting.memory import model_groups
    from zerort.config import parse

    c = parse(cfg)
    shape = placement_auto.shape_of(model_groups(model, c.stage, c.precision, c), c, 1)
    p = placement.evaluate(shape, placement_auto.measure(device, None))[0]
    return "" if p.fits() else (f"the states need {p.host_need('device') / GB:.1f} GB of the device's "
                                f"{p.budgets.usable('device') / GB:.1f} GB usable")


def build(row, a, s, device, nvme_dir):
    """(step function, engine or None, extra dict) for one row; the model built on the meta device."""
    with torch.device("meta"):
        model = Llama(**s)
    if row.startswith("ds"):
        import deepspeed

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        model = model.to_empty(device=device)
        init_in_place(model)
        zero = {"stage": int(row[2]), "offload_optimizer": {"device": "cpu", "pin_memory": True}}
        if row == "ds3":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": s["batch"], "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": a.lr}}, "gradient_clipping": 1.0})
        return engine, None, {}
    import zerort
    from zerort.accounting import placement_auto

    cfg = zerort_config(row, a, nvme_dir)
    if row == "gpu" and device.type == "cuda":
        why = does_not_fit(model, cfg, device)
        if why:
            return None, None, {"skipped": why}
    engine = zerort.initialize(model, cfg)
    extra = {}
    if engine.placement is not None:
        extra["placement"] = engine.placement.candidate.name
        print("\n".join(placement_auto.summary(engine.placement)), flush=True)
    return engine, engine, extra


def run_row(row, a):
    """One row in this process: its figures as a dict (written to --out)."""
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    s = shape_of(a)
    torch.manual_seed(0)  # the same model in every row (zerort's meta init seeds from torch's state)
    nvme_dir = tempfile.mkdtemp(prefix=f"gpu_offload_{row}_", dir=a.nvme_path)
    out = {"row": row, "numel": numel_of(s)}
    t0 = time.perf_counter()
    engine, ours, extra = build(row, a, s, device, nvme_dir)
    out.update(extra, build_s=time.perf_counter() - t0)
    if engine is None:
        return out
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=device, generator=g)
    y = torch.roll(x, -1, 1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        logits = engine(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        engine.backward(loss)
        engine.step()
        return loss.item()
    losses = [step()]  # warm-up
    times, waits = [], []
    io0 = disk_io()
    with Utilisation(device.type == "cuda") as util:
        for i in range(a.steps):
            sync()
            t = time.perf_counter()
            losses.append(step())
            sync()
            times.append(time.perf_counter() - t)
            if ours is not None and "update_wait_ms" in ours.stats:
                waits.append(ours.stats["update_wait_ms"] / 1e3)
            print(f"[{row}] step {i + 1}: loss {losses[-1]:.4f}, {times[-1]:.3f} s", flush=True)
    io1 = disk_io()
    times_sorted = sorted(times)
    out.update(median=statistics.median(times), p90=times_sorted[min(len(times) - 1, int(0.9 * len(times)))],
               tokens=s["batch"] * s["seq"], losses=losses, read=io1[0] - io0[0], written=io1[1] - io0[1],
               rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               gpu_peak=torch.cuda.max_memory_allocated() if device.type == "cuda" else None)
    if waits:  # the forward's wait for the overlapped update: the GPU's idle time (a CPU model's compute's)
        out["idle"], out["idle_source"] = sum(waits) / sum(times), "engine"
    elif device.type == "cuda" and (idle := profiled_idle(step, sync)) is not None:
        out["idle"], out["idle_source"] = idle, "cuda events"
    elif util.idle() is not None:
        out["idle"], out["idle_source"] = util.idle(), "nvml"
    return out


def ds_python(a):
    """The Python for DeepSpeed's rows, or (None, why)."""
    if a.ds_python:
        return a.ds_python, ""
    try:
        import deepspeed  # noqa: F401

        return sys.executable, ""
    except ImportError:
        pass
    venv = os.path.join(ROOT, ".venv-ds", "bin", "python")
    if os.path.exists(venv):
        return venv, ""
    return None, "deepspeed does not import here and there is no .venv-ds (make bench-ds) nor --ds-python"


def fmt(v, scale=1.0, digits=2, unit=""):
    return "n/a" if v is None else f"{v / scale:.{digits}f}{unit}"


def table(results, a, s):
    n = numel_of(s)
    dev = torch.cuda.get_device_name() if a.device == "cuda" and torch.cuda.is_available() else "CPU"
    print(f"\n{'GPU: ' if dev != 'CPU' else ''}{dev}, torch {torch.__version__}: Llama-shaped {n / 1e9:.2f}B "
          f"parameters ({s['layers']} layers, hidden "
          f"{s['hidden']}, intermediate {s['intermediate']}, vocab {s['vocab']}), micro-batch {s['batch']}x{s['seq']}, "
          f"bf16 compute, FP32 master and Adam, W = 1, zerort stage {a.stage}; {a.steps} timed steps after 1")
    print(f"| row | step s median | p90 | tokens/s | {'GPU' if dev != 'CPU' else 'compute'} idle | peak GPU GB | "
          "peak RSS GB | disk read GB | disk written GB | losses |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in a.rows:
        r = results[row]
        label = LABELS[row] + (f" ({r['placement']})" if r.get("placement") else "")
        if "median" not in r:
            print(f"| {label} | {r.get('skipped') or r.get('error', 'no result')} | | | | | | | | |")
            continue
        idle = "n/a" if r.get("idle") is None else f"{100 * r['idle']:.0f}% ({r['idle_source']})"
        losses = " ".join(f"{v:.3f}" for v in r["losses"][:4]) + (" ..." if len(r["losses"]) > 4 else "")
        print(f"| {label} | {r['median']:.3f} | {r['p90']:.3f} | {r['tokens'] / r['median']:,.0f} | {idle} | "
              f"{fmt(r['gpu_peak'], GB)} | {fmt(r['rss'], GB)} | {fmt(r['read'], GB, 3)} | "
              f"{fmt(r['written'], GB, 3)} | {losses} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=6.5e9, help="model size (a Llama shape near it)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int, choices=sorted(SHAPES))
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="micro-batch (sequences per step)")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: a smoke run")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=2, help="zerort's rows")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated, of " + ", ".join(ROWS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--nvme-path", default=None, help="folder for the nvme and auto rows' files (default: $TMPDIR)")
    ap.add_argument("--ds-python", help="a Python with deepspeed 0.19.8 installed against this torch")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per row")
    ap.add_argument("--expect-decreasing", action="store_true", help="exit 1 unless every row not skipped trained "
                    "and its loss fell at every step (the capacity check)")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.rows = [r for r in a.rows.split(",") if r]
    bad = [r for r in a.rows if r not in ROWS]
    if bad:
        ap.error(f"--rows: unknown {', '.join(bad)}; allowed: {', '.join(ROWS)}")
    if a.row:  # one row, in this process
        with open(a.out, "w") as f:
            json.dump(run_row(a.row, a), f)
        return 0
    s, results, passthrough = shape_of(a), {}, [x for x in (argv if argv is not None else sys.argv[1:])]
    ds, why_no_ds = ds_python(a)
    for row in a.rows:
        if row.startswith("ds") and (ds is None or a.device != "cuda"):
            results[row] = {"skipped": why_no_ds or "DeepSpeed's offload rows run on a CUDA device here"}
            print(f"[{row}] skipped: {results[row]['skipped']}", flush=True)
            continue
        python = ds if row.startswith("ds") else sys.executable
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            try:
                p = subprocess.run([python, os.path.abspath(__file__), *passthrough, "--row", row, "--out", out.name],
                                   timeout=a.timeout)
                results[row] = json.load(open(out.name)) if p.returncode == 0 else \
                    {"error": f"failed (exit {p.returncode}; its output is above)"}
            except subprocess.TimeoutExpired:
                results[row] = {"error": f"timed out after {a.timeout:.0f} s"}
            except ValueError:
                results[row] = {"error": "no result written"}
    table(results, a, s)
    ok = all("error" not in r for r in results.values())
    if a.expect_decreasing:  # every row not skipped trained, each step's loss below the one before
        for row, r in ((row, r) for row, r in results.items() if "skipped" not in r):
            ls = r.get("losses", [])
            down = all(b < c for b, c in zip(ls[1:], ls))
            print(f"[{row}] losses {'decrease' if down else 'DO NOT decrease'}: {ls}" if ls else
                  f"[{row}] trained no step: {r.get('skipped') or r.get('error')}")
            ok = ok and down and bool(ls)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
