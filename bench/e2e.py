"""End-to-end: the same model, data, seed and step count under zerort stages 1-3, PyTorch
DDP and FSDP2, and DeepSpeed ZeRO-2 and ZeRO-3 when a Python with deepspeed is at hand
(--ds-python, default .venv-ds from make bench-ds), at W = 2 on CPU.

    .venv/bin/python bench/e2e.py                       (make bench-e2e; a few minutes)
    .venv/bin/python bench/e2e.py --models demo --steps 20 --plot /tmp/curves.png

Each (model, runtime) is its own `torchrun --standalone --nproc_per_node 2` launch of
bench/e2e_worker.py (gloo for torch's collectives and for zerort's, OMP_NUM_THREADS=1 per
rank), so peak RSS belongs to that runtime alone. Models (examples/gpt.py's GPT): `demo`
(6 layers, d=256, 8x128 tokens per rank per step) and `50m` (10 layers, d=640, 2x128).
One table per model: median, p90 and max step time over steps 3..N (the slowest rank's time
per step; the first two are left out: DDP's are 3-5x its others),
tokens/s, peak RSS per rank, measured model-state bytes per rank, the mean training loss
at step N and the loss on a held-out batch after N steps; ratios are against DDP in the
same run. A runtime that fails keeps its row, with its error.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "e2e_worker.py")
ORDER = ["ddp", "fsdp2", "ds2", "ds3", "zerort1", "zerort2", "zerort2-overlap", "zerort3", "zerort2-mpi"]
LABELS = {"ddp": "DDP (autocast bf16, FP32 AdamW)", "fsdp2": "FSDP2 (bf16 params, fp32 reduce)",
          "ds2": "DeepSpeed ZeRO-2 (bf16)", "ds3": "DeepSpeed ZeRO-3 (bf16)",
          "zerort1": "zerort stage 1", "zerort2": "zerort stage 2", "zerort3": "zerort stage 3",
          "zerort2-overlap": "zerort stage 2, overlap_param_gather",
          "zerort2-mpi": "zerort stage 2 under mpirun (MPI)"}
STEPS = {"tiny": 50, "demo": 50, "50m": 18}
WARMUP = 2  # steps left out of the timing figures (DDP's first two are 3-5x its others)
DS_PYTHON = os.path.join(ROOT, ".venv-ds", "bin", "python")  # make bench-ds installs it
MIB = 1 << 20


def torchrun(nproc, python=None):
    """The torchrun command line for nproc ranks on this machine (python: another
    interpreter's `-m torch.distributed.run`, for a venv without a torchrun script)."""
    if python:
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", str(nproc)]


def mpirun(nproc):
    return ["mpirun", "--oversubscribe", "-np", str(nproc), "-x", "OMP_NUM_THREADS", sys.executable]


def _descendants(pid):
    """pid and every process below it (mpirun puts its ranks in process groups of their own)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]  # depth-first walk of the process tree
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, []))
    return out


def _tree_rss(pid):
    """Total RSS in bytes of pid and its descendants."""
    total = 0
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total


def _kill_tree(pid):
    """SIGKILL to pid and its descendants; returns once they are gone (10 s at most), so
    that their memory is free before the next launch."""
    procs = _descendants(pid)
    for p in reversed(procs):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in procs[1:]):
        time.sleep(0.1)


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def run_job(cmd, out, runtimes, timeout=1800, env=None, min_available=None, max_rss=None):
    """Runs one launch (its own session); returns the results it wrote to `out`, or
    one error row per runtime when it fails. Guard: when the machine's MemAvailable falls
    below min_available bytes, or the launch's processes together pass max_rss bytes, the
    whole launch is killed at once (a rank that runs the machine out of memory may take it
    down) and its rows say so. Every row also gets `launch_rss`, the high-water mark of the
    total RSS of the launch's process tree, and `min_available`, the lowest MemAvailable
    seen (both sampled every 0.5 s)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               **(env or {}))
    with tempfile.TemporaryFile("w+") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        t0, killed, high, low = time.monotonic(), None, 0, None
        while p.poll() is None:
            time.sleep(0.5)
            rss = _tree_rss(p.pid)
            high = max(high, rss)
            avail = _mem_available()
            low = avail if low is None else min(low, avail if avail is not None else low)
            if min_available and avail is not None and avail < min_available:
                killed = (f"killed by the memory guard: MemAvailable {avail / MIB:.0f} MiB < "
                          f"{min_available / MIB:.0f} MiB")
            elif max_rss and rss > max_rss:
                killed = f"killed by the memory guard: launch RSS {rss / MIB:.0f} MiB > {max_rss / MIB:.0f} MiB"
            elif time.monotonic() - t0 > timeout:
                killed = f"killed after the {timeout} s timeout"
            if killed:
                _kill_tree(p.pid)
                p.wait()
                break
        log.seek(0)
        text = log.read()
    if not killed and p.returncode == 0 and os.path.exists(out):
        with open(out) as f:
            results = json.load(f)["results"]
        for r in results.values():
            r["launch_rss"], r["min_available"] = high, low
        return results
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    why = [ln for ln in lines if any(w in ln for w in ("Error", "error:", "Signal", "terminate", "Abort", "Killed"))]
    why = list(dict.fromkeys(why))[:3] or lines[-3:]
    head = killed or f"launch failed (exit {p.returncode})"
    return {r: {"error": f"{head}: " + " | ".join(why), "launch_rss": high, "min_available": low} for r in runtimes}


def launch(model, runtimes, steps, out, python=None, zerort_config=None, ds_zero=None):
    """Runs the worker under torchrun (python: another interpreter's, for DeepSpeed), or under
    mpirun for the "-mpi" runtimes (zerort on its MPI backend, Open MPI's shared memory); returns
    its results, or one error row per runtime when the launch itself fails. ds_zero: more
    DeepSpeed zero_optimization keys (a dict, or its JSON)."""
    launcher = mpirun(2) if all(k.endswith("-mpi") for k in runtimes) else torchrun(2, python)
    cmd = launcher + [WORKER, out, "--model", model, "--steps", str(steps), "--runtimes", *runtimes]
    if zerort_config:
        cmd += ["--zerort-config", zerort_config]
    if ds_zero:
        cmd += ["--ds-zero", ds_zero if isinstance(ds_zero, str) else json.dumps(ds_zero)]
    return run_job(cmd, out, runtimes, env={"DS_ACCELERATOR": "cpu"} if python else None)


def pct(values, q):
    """The q-quantile (nearest rank) of values."""
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def summarize(res):
    """The table's numbers for one runtime's results: step times over steps WARMUP+1..N."""
    times = res["step_s"][WARMUP:] or res["step_s"]
    t = statistics.median(times)
    return {"step_ms": 1e3 * t, "p90_ms": 1e3 * pct(times, 0.9), "max_ms": 1e3 * max(times), "timed": len(times),
            "tokens_s": res["tokens_per_step"] / t, "rss": max(res["peak_rss"]),
            "state": max(res["state_bytes"]), "loss": res["losses"][-1], "held_out": res["held_out_loss"]}


def table(model, steps, results):
    ok = {k: summarize(r) for k, r in results.items() if not r.get("error")}
    ref = ok.get("ddp")
    first = next(iter(r for r in results.values() if not r.get("error")), None)
    ratio = lambda k, key: f"{ok[k][key] / ref[key]:.2f}" if ref else "n/a"
    lines = [f"model {model}: {first['numel'] / 1e6:.2f}M parameters, W=2, {first['tokens_per_step']} tokens per step, "
             f"{steps} steps (times: steps {WARMUP + 1}..{steps})" if first else f"model {model}: every runtime failed",
             "| runtime | step ms (median) | p90 | max | p90/median | tokens/s | tokens/s vs DDP | peak RSS MiB/rank "
             "| vs DDP | model states MiB/rank | vs DDP | loss at step N | held-out loss after N |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    errors = []
    for k in ORDER:
        if k not in results:
            continue
        if results[k].get("error"):
            lines.append(f"| {LABELS[k]} | failed: see below | | | | | | | | | | | |")
            errors.append(f"{LABELS[k]}: {results[k]['error']}")
            continue
        s = ok[k]
        lines.append(f"| {LABELS[k]} | {s['step_ms']:.0f} | {s['p90_ms']:.0f} | {s['max_ms']:.0f} "
                     f"| {s['p90_ms'] / s['step_ms']:.2f} | {s['tokens_s']:.0f} | {ratio(k, 'tokens_s')} "
                     f"| {s['rss'] / MIB:.0f} | {ratio(k, 'rss')} | {s['state'] / MIB:.2f} | {ratio(k, 'state')} "
                     f"| {s['loss']:.4f} | {s['held_out']:.4f} |")
    return "\n".join(lines + errors)


def plot(curves, path):
    """curves: {model: {runtime: results}}. Top row: the training loss per step; bottom
    row: each runtime's loss minus DDP's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(curves)
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        runs = {k: r for k, r in curves[model].items() if not r.get("error")}
        ref = runs.get("ddp")
        for k in ORDER:
            if k not in runs:
                continue
            steps = range(1, len(runs[k]["losses"]) + 1)
            axes[0][col].plot(steps, runs[k]["losses"], label=LABELS[k], lw=1.2)
            if ref:
                axes[1][col].plot(steps, [a - b for a, b in zip(runs[k]["losses"], ref["losses"])], label=LABELS[k],
                                  lw=1.2)
        numel = next(iter(runs.values()))["numel"] if runs else 0
        axes[0][col].set_title(f"{model} GPT ({numel / 1e6:.1f}M parameters), W=2, same data and seed")
        axes[0][col].set_ylabel("training loss (mean over ranks)")
        axes[1][col].set_ylabel("loss minus DDP's loss")
        axes[1][col].set_xlabel("step")
        axes[0][col].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["demo", "50m"], choices=sorted(STEPS))
    ap.add_argument("--steps", type=int, help="steps for every model (default: demo 50, 50m 8)")
    ap.add_argument("--runtimes", nargs="+", default=ORDER, choices=ORDER)
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "e2e_loss_curves.png"))
    ap.add_argument("--json", help="also write every run's raw results here")
    ap.add_argument("--zerort-config", help='more zerort config keys, as JSON (e.g. \'{"comm": {"debug": true}}\')')
    ap.add_argument("--ds-python", default=os.environ.get("DS_PYTHON", DS_PYTHON),
                    help="a Python with deepspeed installed against this torch (default: .venv-ds, from make "
                         "bench-ds); without one the DeepSpeed rows say so")
    a = ap.parse_args()
    import torch

    print(f"end-to-end, W=2 (torchrun + gloo), {os.cpu_count()} cores, OMP_NUM_THREADS=1 per rank, "
          f"torch {torch.__version__}; load average {os.getloadavg()[0]:.1f} at start", flush=True)
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models:
            steps = a.steps or STEPS[model]
            curves[model] = {}
            for k in a.runtimes:  # one launch per runtime: its own peak RSS
                if k.startswith("ds") and not os.path.exists(a.ds_python):
                    curves[model][k] = {"error": f"skipped: no DeepSpeed Python at {a.ds_python} (make bench-ds)"}
                    continue
                python = a.ds_python if k.startswith("ds") else None
                curves[model].update(launch(model, [k], steps, os.path.join(tmp, f"{model}_{k}.json"), python,
                                            a.zerort_config))
            print("\n" + table(model, steps, curves[model]), flush=True)
    plot(curves, a.plot)
    print(f"\nwrote {os.path.relpath(a.plot, ROOT)}; load average {os.getloadavg()[0]:.1f} at the end")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(curves, f)


if __name__ == "__main__":
    main()
