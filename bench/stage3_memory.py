"""Stage 3 side by side: zerort stages 2 and 3 (prefetch 0 and 1), PyTorch FSDP2 and, when
it is installed, DeepSpeed ZeRO-3 (default prefetch and prefetch off), all measured by the
same instrument: zerort's counting CPU allocator (zerort.accounting.memory.Phases), installed in every
rank before the model is created.

    .venv/bin/python bench/stage3_memory.py                          # both models, every runtime
    .venv/bin/python bench/stage3_memory.py --models linear8 --runtimes zerort3p1 fsdp2
    .venv/bin/python bench/stage3_memory.py --ds-python /tmp/dsvenv/bin/python   # DeepSpeed rows (default: .venv-ds)

Models: `linear8` = 8 x nn.Linear(4096, 4096, bias=False) (134M parameters, 32 MiB of bf16
weight per layer; input 4 x 4096, cross-entropy over the 4096 outputs) and `50m`, the 49.5M
GPT of bench/e2e_worker.py (2 x 128 tokens per rank per step). W = 2: every (model, runtime)
is its own `torchrun --standalone --nproc_per_node 2` launch (bench/e2e.py's helpers), gloo
for every runtime's collectives, OMP_NUM_THREADS=1 per rank. Same seed, batches, AdamW and
clipping as bench/e2e.py. FSDP2 shards each layer / block, then the root, with
MixedPrecisionPolicy(bf16 params, fp32 reduce); DDP (GPT only, for reference) runs under
bf16 autocast. DeepSpeed runs from its own venv (--ds-python; DS_ACCELERATOR=cpu, gloo):
ZeRO-3, bf16, torch's AdamW (`torch_adam`), its defaults except reduce_bucket_size = 2^24
elements (zerort's bucket: DeepSpeed's default of 5e8 allocates a 954 MiB bf16 buffer on
every rank whatever the model); `ds3p0` also sets stage3_prefetch_bucket_size to 0. Its
first launch JIT-builds the deepspeed_shm_comm op (about a minute, cached after).

Columns (per rank, the larger of the two ranks; MiB = 2^20 bytes; all from the allocator,
counted from a baseline taken after the data is loaded and before the model is created):
- forward growth: the most the allocator held during the last step's forward above what it
  held when the forward began (gathered units, activations saved for backward, buffers);
- step peak: the most held at any moment of any step, above the baseline;
- init peak: the most held while the model was built and the runtime set up;
- at rest: what stays allocated after the last step (model states and whatever else the
  runtime keeps between steps), and that divided by the parameter count (bytes/param);
- step ms: the slowest rank's time for one step (forward, backward, reduction, clipping,
  optimizer), median and p90 over steps 2..N.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import e2e  # noqa: E402

MIB = 1 << 20
ORDER = ["ddp", "fsdp2", "ds3", "ds3p0", "zerort2", "zerort3p0", "zerort3p1", "zerort3meta"]
LABELS = {"ddp": "DDP (autocast bf16)", "fsdp2": "FSDP2 (bf16 params, fp32 reduce)",
          "ds3": "DeepSpeed ZeRO-3", "ds3p0": "DeepSpeed ZeRO-3, prefetch 0",
          "zerort2": "zerort stage 2", "zerort3p0": "zerort stage 3, prefetch 0",
          "zerort3p1": "zerort stage 3, prefetch 1", "zerort3meta": "zerort stage 3, prefetch 1, from meta"}
DEFAULT_RUNTIMES = {"linear8": ["fsdp2", "ds3", "ds3p0", "zerort2", "zerort3p0", "zerort3p1", "zerort3meta"],
                    "50m": ["ddp", "fsdp2", "ds3", "ds3p0", "zerort2", "zerort3p0", "zerort3p1"],
                    "tiny": ["fsdp2", "zerort2", "zerort3p1"]}
STEPS = {"linear8": 10, "50m": 20, "tiny": 6}


# ---- one rank (under torchrun) ------------------------------------------------------------

def build(model_name):
    """(model, the blocks FSDP2 shards, micro-batch, batch(step, rank) -> (x, y))."""
    import torch

    import e2e_worker
    from gpt import GPT, batch, stdlib_bytes

    if model_name == "linear8":
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(8)])

        def data(step, rank, micro=4):
            g = torch.Generator().manual_seed(step * 1009 + rank)
            return torch.randn(micro, 4096, generator=g), torch.randint(0, 4096, (micro,), generator=g)

        return model, list(model), 4, data
    kwargs, micro = e2e_worker.MODELS[model_name]
    if getattr(build, "text", None) is None:
        build.text = stdlib_bytes()
    text = build.text
    model = GPT(**kwargs)
    return model, list(model.blocks), micro, lambda step, rank: batch(text, step, rank, 0, micro, kwargs["seq"])


def make(kind, model_name):
    """Builds the model (on the meta device for zerort3meta) and the runtime around it."""
    import torch

    import e2e_worker

    if kind == "zerort3meta":
        with torch.device("meta"):
            model, blocks, micro, data = build(model_name)
    else:
        model, blocks, micro, data = build(model_name)
    numel = sum(p.numel() for p in set(model.parameters()))
    if kind.startswith("zerort"):
        stage = int(kind[6])
        extra = {"stage3": {"prefetch": 0 if kind == "zerort3p0" else 1}} if stage == 3 else None
        rt = e2e_worker.ZerortRuntime(stage, model, extra)
    elif kind.startswith("ds3"):
        rt = e2e_worker.DeepSpeedRuntime(3, model, micro, prefetch=kind == "ds3")
    else:
        rt = e2e_worker.TorchRuntime(kind, model, blocks)
    return rt, numel, micro, data


def worker(out, model_name, kind, steps):
    import torch
    import torch.distributed as dist

    import e2e_worker
    from gpt import stdlib_bytes
    from zerort.accounting.memory import Phases, allocated, install_counting_allocator

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    install_counting_allocator()  # before anything below allocates
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    res = {"error": None}
    try:
        if model_name != "linear8":
            build.text = stdlib_bytes()
        base = allocated()[0]
        ph = Phases("cpu")
        with ph("init"):
            torch.manual_seed(0)
            rt, numel, micro, data = make(kind, model_name)
        plain_forward = rt.forward
        step_ph = [None]

        def forward(x):  # train_step calls self.forward: the forward phase of this step
            with step_ph[0]("forward"):
                return plain_forward(x)

        rt.forward = forward
        times, growth, peaks, losses = [], [], [], []
        for step in range(steps):
            x, y = data(step, rank)
            step_ph[0] = p = Phases("cpu")
            t0 = time.perf_counter()
            with p("step"):
                loss, _ = rt.train_step(x, y, last=False)
            dt = time.perf_counter() - t0
            times.append(e2e_worker.reduce([dt], dist.ReduceOp.MAX)[0])
            losses.append(e2e_worker.reduce([loss], dist.ReduceOp.SUM)[0] / dist.get_world_size())
            growth.append(p.result["forward"].growth)
            peaks.append(p.result["step"].peak - base)
        rest = allocated()[0] - base
        res.update(numel=numel, step_s=times, losses=losses, forward_growth=growth, step_peak=peaks,
                   init_peak=ph.result["init"].peak - base, at_rest=rest, baseline=base)
        if kind.startswith("zerort"):
            r = rt.engine.memory_report().to_dict()  # a collective
            res["report_total"] = r["total_measured"]
            res["report_gathered"] = r["categories"]["gathered_units"]["measured"]
            res["units"] = len([n for n in rt.engine.unit_names if n != "persistent"])
    except Exception as e:  # keep the row, with the reason
        res = {"error": f"{type(e).__name__}: {e}"}
        print(f"[rank {rank}] {kind} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, res)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"results": {kind: {"ranks": ranks}}}, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as bench/e2e_worker.py: no interpreter shutdown with gloo threads alive


# ---- the launcher ---------------------------------------------------------------------------

def summarize(r):
    ranks = r["ranks"]
    err = next((x["error"] for x in ranks if x.get("error")), None)
    if err:
        return {"error": err}
    times = ranks[0]["step_s"][1:]  # step 1 warms up; every rank holds the slowest rank's times
    big = lambda key: max(x[key] for x in ranks)
    s = {"numel": ranks[0]["numel"], "n": len(times), "median": statistics.median(times), "p90": e2e.pct(times, 0.9),
         "growth": max(x["forward_growth"][-1] for x in ranks), "peak": max(max(x["step_peak"]) for x in ranks),
         "init": big("init_peak"), "rest": big("at_rest"), "loss": ranks[0]["losses"][-1]}
    if "report_total" in ranks[0]:
        s.update(report_total=big("report_total"), report_gathered=big("report_gathered"), units=ranks[0]["units"])
    return s


def table(model, steps, results):
    ok = {k: summarize(r) if "ranks" in r else {"error": r["error"]} for k, r in results.items()}
    first = next((s for s in ok.values() if "error" not in s), None)
    head = (f"model {model}: {first['numel'] / 1e6:.2f}M parameters, W=2, {steps} steps (times: steps 2..{steps})"
            if first else f"model {model}: every runtime failed")
    lines = [head, "| runtime | forward growth MiB | step peak MiB | init peak MiB | at rest MiB | at rest B/param "
                   "| step ms median | p90 | loss at step N |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for k in ORDER:
        if k not in ok:
            continue
        s = ok[k]
        if "error" in s:
            lines.append(f"| {LABELS[k]} | failed: see below | | | | | | | |")
            notes.append(f"{LABELS[k]}: {s['error'][:400]}")
            continue
        lines.append(f"| {LABELS[k]} | {s['growth'] / MIB:.1f} | {s['peak'] / MIB:.0f} | {s['init'] / MIB:.0f} "
                     f"| {s['rest'] / MIB:.1f} | {s['rest'] / s['numel']:.2f} | {1e3 * s['median']:.0f} "
                     f"| {1e3 * s['p90']:.0f} | {s['loss']:.4f} |")
        if "report_total" in s:
            notes.append(f"{LABELS[k]}: {s['units']} units; memory_report() model states {s['report_total'] / MIB:.1f} "
                         f"MiB, of which gathered units (peak) {s['report_gathered'] / MIB:.1f} MiB")
    return "\n".join(lines + [""] + notes)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=3, metavar=("OUT", "MODEL", "RUNTIME"), help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=["linear8", "50m"], choices=sorted(STEPS))
    ap.add_argument("--runtimes", nargs="+", choices=ORDER, help="default: every runtime that applies to the model")
    ap.add_argument("--steps", type=int, help="steps per run (default: linear8 10, 50m 20)")
    ap.add_argument("--ds-python",
                    default=os.environ.get("DS_PYTHON", e2e.DS_PYTHON if os.path.exists(e2e.DS_PYTHON) else None),
                    help="a Python with deepspeed installed against this torch (without it the ds3 rows are skipped)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    ap.add_argument("--json", help="also write every run's raw results here")
    a = ap.parse_args()
    if a.worker:
        out, model, kind = a.worker
        return worker(out, model, kind, a.steps)
    load = os.getloadavg()[0]
    print(f"stage 3 memory, W=2 (torchrun + gloo), {os.cpu_count()} cores, OMP_NUM_THREADS=1 per rank; "
          f"load average {load:.1f} at start", flush=True)
    every = {}
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models:
            steps = a.steps or STEPS[model]
            every[model] = {}
            for k in a.runtimes or DEFAULT_RUNTIMES[model]:
                if k.startswith("ds3") and not a.ds_python:
                    every[model][k] = {"error": "skipped: no --ds-python (a Python with deepspeed)"}
                    continue
                out = os.path.join(tmp, f"{model}_{k}.json")
                python = a.ds_python if k.startswith("ds3") else None
                cmd = e2e.torchrun(2, python) + [os.path.abspath(__file__), "--worker", out, model, k,
                                                 "--steps", str(steps)]
                t0 = time.monotonic()
                every[model].update(e2e.run_job(cmd, out, [k], timeout=a.timeout, env={"DS_ACCELERATOR": "cpu"},
                                                min_available=1 << 30))
                print(f"  {model} {k}: {time.monotonic() - t0:.0f} s", flush=True)
            print("\n" + table(model, steps, every[model]) + "\n", flush=True)
    print(f"total {time.monotonic() - t_all:.0f} s; load average {os.getloadavg()[0]:.1f} at the end")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(every, f)


if __name__ == "__main__":
    sys.exit(main())
