"""Offload of the optimizer state, measured in one run (figures in docs/BENCHMARKS.md):

1. The disk's own direct-I/O bandwidth where the states go (fio: write, read, and a reader
   and a writer at once, io_uring, O_DIRECT, the aio defaults' 1 MiB requests 8 deep; dd
   where fio is missing), beside the nvme tier's streaming rate on the same directory: one
   pass of NvmeStateStore::update() that computes nothing (build/runtime/nvme_state_bench,
   its "I/O alone" figure), as a fraction of the disk's rate for the same mix, on each I/O
   backend: io_uring and the pool of threads (ZERORT_IO_BACKEND; C++ Note [IoQueue backends]).
   --io-only stops here.
2. The training step with the FP32 master and Adam's moments in RAM, under
   offload_optimizer.device "cpu" (a CPU model's states are in host memory already: See Note
   [offload tiers]) and "nvme" (at stage 3 also with offload_param "nvme": nvme+params; and split,
   --ram-fractions of the records kept in RAM: nvme+ramF), at
   each stage asked: examples/gpt.py's GPT under
   bench/e2e_worker.py (torchrun, W = 2, gloo, OMP_NUM_THREADS=1 per rank), the same model,
   data and seed, so every step's loss must be the same to the bit in all three. Median and
   p90 over the steps after the first 2 (the slowest rank's time per step), the ratio to the
   in-RAM step of the same stage, and the nvme tier's I/O per step: bytes moved, seconds
   spent waiting for them (I/O the pipeline did not hide behind AdamW), and the rate.
3. DeepSpeed 0.19.8 beside it, when .venv-ds is there (make bench-ds; its async_io op is
   built on first use against libaio-dev): ZeRO-3 without offload and with
   offload_optimizer.device "nvme" (its aio defaults), the same model, data and seed, under
   its CPU accelerator. DeepSpeed moves a sub-group to NVMe only when it holds at least 1 MiB
   (its MIN_AIO_BYTES), so the model must be demo-sized or larger.

    .venv/bin/python bench/offload.py                                  # model 50m, stages 1-3, 20 steps
    .venv/bin/python bench/offload.py --model demo --stages 2 --steps 20 --nvme-path /mnt/nvme
    .venv/bin/python bench/offload.py --io-only --disk-mib 512 --stream-million 32   # part 1 alone
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import e2e  # noqa: E402

MIB = 1 << 20
STREAM_BENCH = os.path.join(ROOT, "build", "runtime", "nvme_state_bench")
STREAM_MILLION = 128  # elements of the streaming pass's state: 1.5 GB of master, m and v
IO_BACKENDS = ("io_uring", "threads")  # the streaming rows, one per backend


def disk_bandwidth(directory, mib, queue_depth=8, block=MIB):
    """The disk's own direct-I/O rates in directory, in bytes/s: {"tool", "write", "read",
    "both"}, "both" being a reader and a writer at once on two files (the tier's mix: each
    step reads and writes every byte of the state). fio (io_uring, O_DIRECT, queue_depth
    requests of `block` bytes per job, the aio defaults) where it is installed; else dd
    (O_DIRECT, 1 MiB blocks, one request at a time, no "both")."""
    paths = [os.path.join(directory, f"zerort-offload-bench.{k}") for k in "rw"]
    try:
        if shutil.which("fio") is None:
            rates = {"tool": "dd (O_DIRECT, 1 MiB blocks, queue depth 1)"}
            for name, args in (("write", [f"of={paths[0]}", "if=/dev/zero", "oflag=direct"]),
                               ("read", [f"if={paths[0]}", "of=/dev/null", "iflag=direct"])):
                t0 = time.perf_counter()
                subprocess.run(["dd", *args, "bs=1M", f"count={mib}"], check=True, capture_output=True)
                rates[name] = mib * MIB / (time.perf_counter() - t0)
            return rates
        common = ["fio", "--output-format=json", "--direct=1", "--ioengine=io_uring", f"--bs={block}",
                  f"--iodepth={queue_depth}", f"--size={mib}M"]
        jobs = lambda *specs: json.loads(subprocess.run(common + [a for spec in specs for a in spec], check=True,
                                                        capture_output=True, text=True).stdout)["jobs"]
        rate = lambda j, kind: j[kind]["bw_bytes"]
        w = jobs(["--name=w", f"--filename={paths[0]}", "--rw=write"])[0]
        r = jobs(["--name=r", f"--filename={paths[0]}", "--rw=read"])[0]
        both = jobs(["--name=r", f"--filename={paths[0]}", "--rw=read"],
                    ["--name=w", f"--filename={paths[1]}", "--rw=write"])
        return {"tool": f"fio (io_uring, O_DIRECT, {block // 1024} KiB blocks, queue depth {queue_depth})",
                "write": rate(w, "write"), "read": rate(r, "read"),
                "both": sum(rate(j, "read") + rate(j, "write") for j in both)}
    finally:
        for p in paths:
            if os.path.exists(p):
                os.remove(p)


def stream_rate(directory, million, buffers, backend):
    """Bytes/s (read + write) of one nvme_state_bench pass without compute on the I/O backend
    named (an error's text instead when that backend cannot run here)."""
    p = subprocess.run([STREAM_BENCH, directory, str(million), str(buffers)], capture_output=True, text=True,
                       env={**os.environ, "ZERORT_IO_BACKEND": backend})
    if p.returncode != 0:
        return (p.stderr or p.stdout).strip().splitlines()[-1] if (p.stderr or p.stdout).strip() else "failed"
    out = p.stdout
    m = re.search(r"I/O alone ([\d.]+) s", out)
    state = re.search(r"([\d.]+) GB of master", out)
    if not m or not state:
        raise RuntimeError(f"nvme_state_bench printed no I/O figure:\n{out}")
    return 2 * float(state.group(1)) * 1e9 / float(m.group(1))


def offload(tier, path, buffer_count):
    """tier: none, cpu, nvme, nvme+grads (the FP32 gradient shard in the file too), nvme+params
    (stage 3's parameter shards on NVMe too), nvme+params+grads, or nvme+ramF (ram_fraction F: that
    part of the records kept in RAM)."""
    device, *more = tier.split("+")
    o = {"device": device}
    if device == "nvme":
        o.update(nvme_path=path, buffer_count=buffer_count, gradient_in_file="grads" in more)
        o.update({"ram_fraction": float(m[3:]) for m in more if m.startswith("ram")})
    param = {"param": {"device": "nvme", "nvme_path": path}} if "params" in more else {}
    return {"offload": {"optimizer": o, **param}}


def rows(a):
    """(stage, tier, buffer_count) of each run: RAM, cpu, then nvme with each pool size, also with
    the gradient in the file (at stage 3 also with the parameters on NVMe), and split between RAM
    and the file at each --ram-fractions."""
    nvme = ["nvme", "nvme+grads"]
    return [(s, t, b) for s in a.stages
            for t, counts in (("none", [0]), ("cpu", [0]), *((t, a.buffer_counts) for t in nvme),
                              *((f"nvme+params{t[4:]}", a.buffer_counts) for t in nvme if s == 3),
                              *((f"nvme+ram{f:g}", a.buffer_counts) for f in a.ram_fractions))
            for b in counts]


def timed(r):
    return r["step_s"][e2e.WARMUP:] or r["step_s"]


def io_per_step(r):
    """(MiB read + written, seconds waited) per timed step, on rank 0."""
    io = r["tier_io"]
    a, b = io[e2e.WARMUP - 1] if len(io) > e2e.WARMUP else [0, 0, 0], io[-1]
    n = len(io) - e2e.WARMUP if len(io) > e2e.WARMUP else len(io)
    return (b[0] + b[1] - a[0] - a[1]) / MIB / n, (b[2] - a[2]) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "demo", "50m", "50m-b8"], default="50m",
                    help="50m-b8: the 50m GPT with 8 sequences per rank per step (4x 50m's)")
    ap.add_argument("--stages", type=int, nargs="+", choices=[1, 2, 3], default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nvme-path", help="the folder for the state files (default: a new one under the build's disk)")
    ap.add_argument("--disk-mib", type=int, default=2048, help="the size of the disk benchmark's files")
    ap.add_argument("--buffer-counts", type=int, nargs="+", default=[4],
                    help="offload_optimizer.buffer_count of the nvme rows (one row each; DeepSpeed's default 4)")
    ap.add_argument("--no-deepspeed", action="store_true", help="leave out DeepSpeed's rows")
    ap.add_argument("--ram-fractions", type=float, nargs="*", default=[0.5],
                    help="nvme rows with that part of the records kept in RAM (offload_optimizer.ram_fraction)")
    ap.add_argument("--io-only", action="store_true", help="the disk and the streaming rows only (part 1)")
    ap.add_argument("--stream-million", type=int, default=STREAM_MILLION,
                    help="million elements of the streaming pass's state (12 bytes each)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.io_only:
        a.stages = []
    if a.steps < e2e.WARMUP + 16:
        ap.error(f"--steps must be at least {e2e.WARMUP + 16}: medians over 16 or more timed steps")
    base = a.nvme_path or tempfile.mkdtemp(prefix="offload-bench-", dir=os.path.join(ROOT, "build"))
    print(f"offload bench: model {a.model}, W=2, stages {a.stages}, {a.steps} steps; states under {base}; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    out = {"disk": {}, "runs": {}}
    try:
        out["disk"] = disk_bandwidth(base, a.disk_mib)
        if os.path.exists(STREAM_BENCH):
            out["disk"]["stream"] = {b: stream_rate(base, a.stream_million, 4, b) for b in IO_BACKENDS}
        with tempfile.TemporaryDirectory() as tmp:
            for stage, tier, buffers in rows(a):
                files = os.path.join(base, f"stage{stage}-{tier}-{buffers}")
                os.makedirs(files, exist_ok=True)
                res = e2e.launch(a.model, [f"zerort{stage}"], a.steps, os.path.join(tmp, "out.json"),
                                 zerort_config=json.dumps(offload(tier, files, buffers)))[f"zerort{stage}"]
                res["left_files"] = os.listdir(files)
                out["runs"][f"{stage}:{tier}:{buffers}"] = res
                state = "failed: " + res["error"][:200] if res.get("error") else \
                    f"median {1e3 * statistics.median(timed(res)):.0f} ms"
                print(f"  stage {stage}, offload_optimizer {tier}{f', {buffers} buffers' if buffers else ''}: "
                      f"{state}", flush=True)
            if not a.io_only and not a.no_deepspeed and os.path.exists(e2e.DS_PYTHON):
                for tier in ("none", "nvme"):
                    files = os.path.join(base, f"deepspeed-{tier}")
                    os.makedirs(files, exist_ok=True)
                    zero = {"offload_optimizer": {"device": "nvme", "nvme_path": files}} if tier == "nvme" else None
                    res = e2e.launch(a.model, ["ds3"], a.steps, os.path.join(tmp, "out.json"), python=e2e.DS_PYTHON,
                                     ds_zero=zero)["ds3"]
                    out["runs"][f"ds3:{tier}"] = res
                    print(f"  DeepSpeed ZeRO-3, offload_optimizer {tier}: " + (
                        "failed: " + res["error"][:200] if res.get("error") else
                        f"median {1e3 * statistics.median(timed(res)):.0f} ms"), flush=True)
    finally:
        if not a.nvme_path:
            shutil.rmtree(base, ignore_errors=True)
    report(a, out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)
    return 0


def report(a, out):
    d = out["disk"]
    print(f"\ndisk, {d['tool']}, {a.disk_mib} MiB files: write {d['write'] / 1e9:.2f} GB/s, read "
          f"{d['read'] / 1e9:.2f} GB/s" + (f", a reader and a writer at once {d['both'] / 1e9:.2f} GB/s" if 'both' in d
                                           else ""))
    both = d.get("both") or 2 / (1 / d["write"] + 1 / d["read"])  # dd: one after the other
    if "stream" in d:
        print(f"\nnvme tier streaming (nvme_state_bench, {a.stream_million}M elements, 4 buffers, no compute), "
              "read+write at once:\n\n| I/O path | GB/s | of the disk's |\n|---|---:|---:|")
        print(f"| {d['tool']}, a reader and a writer | {both / 1e9:.2f} | 100% |")
        for backend, rate in d["stream"].items():
            print(f"| nvme tier, {backend} | {rate / 1e9:.2f} | {100 * rate / both:.0f}% |" if isinstance(rate, float)
                  else f"| nvme tier, {backend} | failed: {rate[:150]} | |")
    if a.io_only:
        return
    print("\n| stage | offload_optimizer | pool MiB | step ms (median) | p90 | vs RAM | losses equal RAM's "
          "| I/O MiB/step | I/O wait ms/step | state files left |")
    print("|---:|---|---:|---:|---:|---:|---|---:|---:|---|")
    for stage, tier, buffers in rows(a):
        ram = out["runs"].get(f"{stage}:none:0", {})
        r = out["runs"][f"{stage}:{tier}:{buffers}"]
        name = f"{tier}, {buffers} buffers" if buffers else tier
        if r.get("error"):
            print(f"| {stage} | {name} | | failed: {r['error'][:150]} | | | | | | |")
            continue
        med, p90 = statistics.median(timed(r)), e2e.pct(timed(r), 0.9)
        vs = f"{med / statistics.median(timed(ram)):.2f}" if not ram.get("error") else "n/a"
        same = "yes" if not ram.get("error") and r["losses"] == ram["losses"] else "NO"
        mib, wait = io_per_step(r) if tier.startswith("nvme") else (0, 0)
        pool = (r.get("tier") or {}).get("pool_bytes", 0) / MIB
        print(f"| {stage} | {name} | {pool:.0f} | {1e3 * med:.0f} | {1e3 * p90:.0f} | {vs} | {same} | {mib:.0f} "
              f"| {1e3 * wait:.0f} | {len(r['left_files'])} |")
    ds = [out["runs"].get(f"ds3:{t}") for t in ("none", "nvme")]
    if all(ds) and not any(r.get("error") for r in ds):
        (ram, nvme), ours = ds, out["runs"].get(f"3:nvme:{a.buffer_counts[0]}")
        med = [statistics.median(timed(r)) for r in ds]
        print(f"\nDeepSpeed 0.19.8 ZeRO-3, same model and data: RAM {1e3 * med[0]:.0f} ms (p90 "
              f"{1e3 * e2e.pct(timed(ram), 0.9):.0f}), offload_optimizer nvme {1e3 * med[1]:.0f} ms (p90 "
              f"{1e3 * e2e.pct(timed(nvme), 0.9):.0f}): {med[1] / med[0]:.2f}x its RAM step; losses equal: "
              f"{'yes' if ram['losses'] == nvme['losses'] else 'NO'}" +
              (f"; zerort stage 3 nvme / DeepSpeed ZeRO-3 nvme: {statistics.median(timed(ours)) / med[1]:.2f}"
               if ours and not ours.get("error") else ""))
    elif any(ds):
        failed = [f"{t}: {r.get('error') or 'ok'}"[:300] for t, r in zip(("none", "nvme"), ds) if r]
        print("\nDeepSpeed rows: " + "; ".join(failed))


if __name__ == "__main__":
    sys.exit(main())
