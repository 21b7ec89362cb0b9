"""The largest GPT that trains on this machine at W = 4: zerort stage 3 (started from the
meta device), in RAM, with its optimizer states on NVMe (offload_optimizer.device "nvme",
the files under --nvme-path), with its bf16 parameter shards there too (zerort3-nvme-params:
offload_param.device "nvme") and with its FP32 gradient shard there as well (zerort3-nvme-all:
offload_optimizer.gradient_in_file), beside PyTorch DDP and FSDP2 (which build the whole FP32 model
on every rank).

    .venv/bin/python bench/largest_gpt.py --estimate-only          # the memory table, no runs
    .venv/bin/python bench/largest_gpt.py                          # estimate, then run the largest that fit
    .venv/bin/python bench/largest_gpt.py --run zerort3:1920 ddp:960 --steps 3
    .venv/bin/python bench/largest_gpt.py --runtimes zerort3-nvme --nvme-path /mnt/nvme

Model: examples/gpt.py's GPT, 24 layers (--layers), width d scanned (heads d/64), vocabulary
256 bytes, sequence 128, micro-batch 1 per rank (--seq, --micro), AdamW and clipping as in
bench/e2e.py, bf16 compute. zerort runs under `mpirun --oversubscribe -np 4` (its MPI
backend); DDP and FSDP2 under `torchrun --standalone --nproc_per_node 4` (gloo), as in
bench/e2e_worker.py (DDP: autocast bf16 and FP32 weights; FSDP2: fully_shard per block and
root, bf16 params, fp32 reduce). zerort's model is built under torch.device("meta") and made
real unit by unit inside zerort.initialize, initialized like GPT's own init (normal, std
0.02, the residual projections scaled by 1/sqrt(2 layers)).

First an estimate per width and runtime of the bytes one rank needs (model states, the
transient buffers, activations) against what this machine has free now (MemAvailable less a
margin, shared by the 4 ranks, each also paying a fixed cost outside the allocator); then,
unless --run names the runs, the largest width predicted to fit is run for each runtime, and
when a run is stopped by the memory guard, the next smaller one. The guard (bench/e2e.py's
run_job) kills a launch whose machine falls below --min-available bytes free.

Table: parameters; the allocator's peak per rank (largest rank) during the model's creation
and initialize, and over the steps; the launch's total RSS (sampled) and the lowest
MemAvailable seen; every step's time (the slowest rank's).
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import e2e  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20
W = 4
WIDTHS = [768, 896, 960, 1024, 1280, 1536, 1792, 1920, 2048, 2176, 2304, 2560, 2816, 3072, 3328]
RUNTIMES = ["ddp", "fsdp2", "zerort3", "zerort3-nvme", "zerort3-nvme-params", "zerort3-nvme-all"]
LABELS = {"ddp": "DDP (autocast bf16, FP32 AdamW)", "fsdp2": "FSDP2 (bf16 params, fp32 reduce)",
          "zerort3": "zerort stage 3 (from meta)", "zerort3-nvme": "zerort stage 3, optimizer states on NVMe",
          "zerort3-nvme-params": "zerort stage 3, optimizer states and parameters on NVMe",
          "zerort3-nvme-all": "zerort stage 3, optimizer states, FP32 gradient and parameters on NVMe"}
RANK_FIXED = 200 * MIB  # per rank, outside the allocator: torch's and MPI's private pages (shared libraries count once)


def gpt_kwargs(d, layers, seq):
    return dict(layers=layers, d=d, heads=d // 64, seq=seq)


def make_gpt(d, layers, seq, meta):
    """examples/gpt.py's GPT; on the meta device with an _init_weights that zerort's meta
    initialization calls per module (GPT's own init, module by module)."""
    import torch

    import e2e_worker  # noqa: F401  (puts examples/ on sys.path)
    from gpt import GPT

    class MetaGPT(GPT):
        def __init__(self, **kw):
            super().__init__(**kw)
            self._scaled = {id(m) for b in self.blocks for m in (b.proj, b.out)}

        def _init_weights(self, m):
            if isinstance(m, torch.nn.Linear):
                std = 0.02 / (math.sqrt(2 * len(self.blocks)) if id(m) in self._scaled else 1)
                torch.nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    torch.nn.init.zeros_(m.bias)
            elif isinstance(m, torch.nn.Embedding):
                torch.nn.init.normal_(m.weight, std=0.02)
            else:
                m.reset_parameters()

    if meta:
        with torch.device("meta"):
            return MetaGPT(**gpt_kwargs(d, layers, seq))
    return GPT(**gpt_kwargs(d, layers, seq))


# ---- estimates --------------------------------------------------------------------------------

def estimate(kind, d, layers, seq, micro):
    """(parameters, bytes one rank needs at its peak) for this runtime."""
    from zerort.accounting.memory import estimate_memory, gpt_numel

    n = gpt_numel(layers, d, 256, seq)
    block = 12 * d * d + 13 * d
    act = 34 * seq * micro * d * layers  # bf16 activations saved for backward (Korthikanti et al.)
    if kind.startswith("zerort3"):  # our exact layout (units, pack buffer, scratch, pool) plus activations
        from zerort.accounting.memory import NvmeTier

        nvme = NvmeTier(params=kind != "zerort3-nvme", gradients=kind == "zerort3-nvme-all") \
            if kind.startswith("zerort3-nvme") else None
        states = estimate_memory(make_gpt(d, layers, seq, meta=True), W, 3, "bf16", nvme=nvme)["exact"]["total"]
        # init: the shards (on NVMe: the gradient and, unless on NVMe too, the low-precision
        # shards only) and 2 FP32 units
        init = (16 if not nvme else (0 if nvme.gradients else 4) + (0 if nvme.params else 2)) * n // W + 2 * 4 * block
        return n, max(states + act, init)
    if kind == "ddp":  # FP32 weights, grads (bucket views), m, v; autocast's bf16 copies of the weights
        return n, 16 * n + 2 * n + act
    # FSDP2: the whole FP32 model at creation; then 16/W per parameter plus two gathered bf16
    # blocks and one block's unsharded FP32 gradient for the reduce-scatter
    return n, max(4 * n + 4 * block, 16 * n // W + 2 * 2 * block + 2 * 4 * block + act)


def fits(need, available, margin):
    return W * (need + RANK_FIXED) <= available - margin


# ---- one rank -----------------------------------------------------------------------------------

def worker(out, kind, d, layers, seq, micro, steps, nvme_path=None):
    import torch

    import e2e_worker
    from gpt import batch, stdlib_bytes
    from zerort.accounting.memory import Phases, allocated, install_counting_allocator

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    install_counting_allocator()
    text = stdlib_bytes()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    if kind.startswith("zerort3"):
        def gather(values):  # every rank's values (floats), rank by rank, over the engine's communicator
            t = torch.tensor(values, dtype=torch.float64)
            o = torch.zeros(W * t.numel(), dtype=torch.float64)
            rt.engine.comm.all_gather(t, o)
            return o.view(W, -1).tolist()
    else:
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))

        def gather(values):
            o = [None] * W
            dist.all_gather_object(o, list(values))
            return o
    res = {"error": None}
    try:
        base = allocated()[0]
        ph = Phases("cpu")
        t0 = time.perf_counter()
        with ph("init"):
            torch.manual_seed(0)
            model = make_gpt(d, layers, seq, meta=kind.startswith("zerort3"))
            numel = sum(p.numel() for p in set(model.parameters()))
            if kind.startswith("zerort3"):
                extra = {"comm": {"backend": "auto", "timeout_s": 1800}}
                if kind.startswith("zerort3-nvme"):
                    extra["offload"] = {"optimizer": {"device": "nvme", "nvme_path": nvme_path,
                                                      "gradient_in_file": kind == "zerort3-nvme-all"}}
                if kind in ("zerort3-nvme-params", "zerort3-nvme-all"):
                    extra["offload"]["param"] = {"device": "nvme", "nvme_path": nvme_path}
                rt = e2e_worker.ZerortRuntime(3, model, extra)
                units = len([n for n in rt.engine.unit_names if n != "persistent"])
            else:
                rt = e2e_worker.TorchRuntime(kind, model)
                units = None
        init_s = time.perf_counter() - t0
        times, peaks, losses = [], [], []
        for step in range(steps):
            x, y = batch(text, step, rank, 0, micro, seq)
            p = Phases("cpu")
            t0 = time.perf_counter()
            with p("step"):
                loss, _ = rt.train_step(x, y, last=False)
            times.append(time.perf_counter() - t0)
            peaks.append(p.result["step"].peak - base)
            losses.append(loss)
            print(f"[rank {rank}] step {step + 1}: {times[-1]:.1f} s, loss {loss:.4f}", flush=True)
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        files = rt.engine.runtime.state_tier_stats["file_bytes"] if kind.startswith("zerort3") else 0
        mine = [numel, ph.result["init"].peak - base, max(peaks), rss, init_s, files] + times + losses
        every = gather(mine)
        k = steps
        res.update(numel=numel, units=units, init_peak=[r[1] for r in every], step_peak=[r[2] for r in every],
                   rss=[r[3] for r in every], init_s=max(r[4] for r in every), files=sum(r[5] for r in every),
                   step_s=[max(r[6 + i] for r in every) for i in range(k)],
                   loss=[statistics.mean(r[6 + k + i] for r in every) for i in range(k)])
    except Exception as e:
        res = {"error": f"{type(e).__name__}: {e}"}
        print(f"[rank {rank}] {kind} d={d} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"results": {kind: res}}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    rc = 0 if not res.get("error") else 1
    if kind.startswith("zerort3"):  # under mpirun: a normal exit, so that zerort closes the engine and finalizes MPI
        return rc
    os._exit(rc)  # torchrun: as bench/e2e_worker.py, no interpreter shutdown with gloo threads alive


# ---- the launcher -------------------------------------------------------------------------------

def launch(kind, d, a, tmp):
    out = os.path.join(tmp, f"{kind}_{d}.json")
    args = [os.path.abspath(__file__), "--worker", out, kind, str(d), "--layers", str(a.layers), "--seq", str(a.seq),
            "--micro", str(a.micro), "--steps", str(a.steps), "--nvme-path", a.nvme_path or tmp]
    cmd = (e2e.mpirun(W) if kind.startswith("zerort3") else e2e.torchrun(W)) + args
    t0 = time.monotonic()
    r = e2e.run_job(cmd, out, [kind], timeout=a.timeout, min_available=a.min_available)[kind]
    r["wall_s"] = time.monotonic() - t0
    print(f"  {kind} d={d}: {'ok' if not r.get('error') else r['error'][:300]} ({r['wall_s']:.0f} s)", flush=True)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=3, metavar=("OUT", "RUNTIME", "D"), help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--widths", type=int, nargs="+", default=WIDTHS)
    ap.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=RUNTIMES)
    ap.add_argument("--run", nargs="+", metavar="RUNTIME:D", help="run exactly these (no search)")
    ap.add_argument("--estimate-only", action="store_true")
    ap.add_argument("--margin", type=float, default=1.5, help="GiB of MemAvailable the estimate leaves free")
    ap.add_argument("--min-available", type=int, default=700 * MIB,
                    help="the guard kills a launch when MemAvailable falls below this many bytes")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    ap.add_argument("--nvme-path", help="zerort3-nvme(-params): the folder for the files (default: a temporary one)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.worker:
        out, kind, d = a.worker
        return worker(out, kind, int(d), a.layers, a.seq, a.micro, a.steps, a.nvme_path)
    avail = e2e._mem_available()
    margin = int(a.margin * GIB)
    print(f"largest GPT, W={W}, {a.layers} layers, vocab 256, seq {a.seq}, micro-batch {a.micro}, {a.steps} steps; "
          f"{os.cpu_count()} cores, MemAvailable {avail / GIB:.1f} GiB (margin {a.margin} GiB, "
          f"{RANK_FIXED // MIB} MiB per rank outside the allocator); load average {os.getloadavg()[0]:.1f}", flush=True)
    est = {(k, d): estimate(k, d, a.layers, a.seq, a.micro) for k in a.runtimes for d in a.widths}
    print("\nestimate: GiB one rank needs at its peak (* = 4 ranks fit now)")
    print("| d | parameters | " + " | ".join(LABELS[k] for k in a.runtimes) + " |")
    print("|---:|---:|" + "---:|" * len(a.runtimes))
    for d in a.widths:
        n = est[(a.runtimes[0], d)][0]
        cells = [f"{est[(k, d)][1] / GIB:.2f}{' *' if fits(est[(k, d)][1], avail, margin) else ''}" for k in a.runtimes]
        print(f"| {d} | {n / 1e6:.0f}M | " + " | ".join(cells) + " |")
    if a.estimate_only:
        return 0
    results, t_all = {}, time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        if a.run:
            for item in a.run:
                k, d = item.split(":")
                results[(k, int(d))] = launch(k, int(d), a, tmp)
        else:
            for k in a.runtimes:
                for d in sorted((d for d in a.widths if fits(est[(k, d)][1], avail, margin)), reverse=True)[:2]:
                    r = results[(k, d)] = launch(k, d, a, tmp)
                    if not r.get("error") or "memory guard" not in r["error"]:
                        break  # done, or failed for a reason a smaller model would not fix
    print(f"\nruns ({time.monotonic() - t_all:.0f} s): allocator peaks per rank (largest rank), launch RSS summed "
          "over ranks (sampled; shared library pages count once per rank)")
    print("| runtime | d | parameters | units | init s | init peak GiB | step peak GiB | launch RSS GiB "
          "| min MemAvailable GiB | NVMe files GiB | step s (each) | loss (each) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for (k, d), r in results.items():
        n = est.get((k, d), estimate(k, d, a.layers, a.seq, a.micro))[0]
        avail_s = f"{r['min_available'] / GIB:.1f}" if r.get("min_available") else ""
        if r.get("error"):
            print(f"| {LABELS[k]} | {d} | {n / 1e6:.0f}M | | | | | {r['launch_rss'] / GIB:.1f} | {avail_s} | "
                  f"| failed: {r['error'][:200]} | |")
            continue
        print(f"| {LABELS[k]} | {d} | {r['numel'] / 1e6:.0f}M | {r['units'] if r['units'] is not None else ''} "
              f"| {r['init_s']:.0f} | {max(r['init_peak']) / GIB:.2f} | {max(r['step_peak']) / GIB:.2f} "
              f"| {r['launch_rss'] / GIB:.1f} | {avail_s} | {r['files'] / GIB:.1f} "
              f"| {', '.join(f'{t:.1f}' for t in r['step_s'])} "
              f"| {', '.join(f'{x:.3f}' for x in r['loss'])} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({f"{k}:{d}": r for (k, d), r in results.items()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
