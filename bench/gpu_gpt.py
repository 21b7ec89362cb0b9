"""Step time of a bf16 GPT of about 350M parameters on one GPU: plain PyTorch (bf16 autocast,
FP32 weights, torch.optim.AdamW(fused=True)), zerort stages 0-3 at W = 1 over NCCL, FSDP2 (bf16
parameters, FP32 reduce, fused AdamW, clipping) and zerort staged W = 2 (two ranks on this GPU
over mpi, CUDA buffers staged through host memory), all in one run. Prints a table of the
median and p90 step times and each row's peak GPU memory. scripts/gpu_check.sh runs it.

    python bench/gpu_gpt.py [--steps 16] [--profile DIR]      # the 355M GPT on CUDA
    python bench/gpu_gpt.py --tiny --device cpu               # a tiny GPT on the CPU (no staged row)

--profile DIR: after each row's timed steps, torch.profiler records --profile-steps more and
writes DIR/<row>.json (a Chrome/Perfetto trace) and DIR/<row>.txt (the forward, backward and step
ranges, then the ops by device time): where each row's time goes.
"""
import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import zerort  # noqa: E402
from gpt import GPT  # noqa: E402

SHAPES = {"350m": dict(layers=24, d=1024, heads=16, seq=1024, vocab=50304),
          "tiny": dict(layers=2, d=64, heads=4, seq=64, vocab=256)}
PARTS = ("forward", "backward", "step")  # the profiler ranges of every row's step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, args, device):
    """Median and p90 seconds of args.steps steps after args.warmup."""
    for _ in range(args.warmup):
        step()
    sync(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), statistics.quantiles(times, n=10, method="inclusive")[-1]


def profile(step, args, device, name):
    """--profile: args.profile_steps steps under torch.profiler, written to args.profile."""
    if not args.profile:
        return
    from torch.profiler import ProfilerActivity, profile as torch_profile
    os.makedirs(args.profile, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        for _ in range(args.profile_steps):
            step()
        sync(device)
    prof.export_chrome_trace(os.path.join(args.profile, f"{slug}.json"))
    events = prof.key_averages()
    dev_ms = lambda e: getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3 / args.profile_steps
    lines = [f"{name}: per step, over {args.profile_steps} profiled steps"]
    for e in events:
        if e.key in PARTS:
            lines.append(f"  {e.key}: host {e.cpu_time_total / 1e3 / args.profile_steps:.1f} ms, "
                         f"device {dev_ms(e):.1f} ms")
    print("\n".join(lines), flush=True)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(os.path.join(args.profile, f"{slug}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n\n" + events.table(sort_by=key, row_limit=40) + "\n")


def parted(forward, backward, update):
    """One training step in the profiler's named ranges."""
    def step():
        with torch.profiler.record_function("forward"):
            loss = forward()
        with torch.profiler.record_function("backward"):
            backward(loss)
        with torch.profiler.record_function("step"):
            update()
    return step


def data(args, device, rank=0):
    shape = SHAPES[args.size]
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randint(0, shape["vocab"], (args.batch, shape["seq"]), device=device, generator=g)
    return x, torch.roll(x, -1, 1)


def loss_of(logits, y):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))


def new_model(args, device):
    torch.manual_seed(0)
    return GPT(**SHAPES[args.size]).to(device)


def peak(device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def run_torch(args, device, name):
    model = new_model(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y = data(args, device)

    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return loss_of(model(x), y)

    def update():
        opt.step()
        opt.zero_grad(set_to_none=True)
    step = parted(forward, lambda loss: loss.backward(), update)
    t = timed_steps(step, args, device)
    profile(step, args, device, name)
    return t, peak(device)


def zerort_step(engine, args, device, rank=0):
    x, y = data(args, device, rank)
    return parted(lambda: loss_of(engine(x), y), engine.backward, engine.step)


def run_zerort(stage, comm, args, device, name):
    engine = zerort.initialize(new_model(args, device), {"stage": stage, "precision": "bf16",
                                                         "optimizer": {"lr": 1e-4}, "gradient_clipping": 1.0},
                               comm=comm)
    step = zerort_step(engine, args, device)
    t = timed_steps(step, args, device)
    parts = {k: round(engine.stats.get(k, 0.0), 1) for k in ("forward_ms", "backward_ms", "reduce_ms",
                                                              "optimizer_ms", "gather_ms")}
    print(f"{name}: last step's parts {parts}; {engine.skipped_steps} of {engine.global_step} steps skipped",
          flush=True)
    profile(step, args, device, name)
    return t, peak(device)


def run_fsdp2(args, device, name):
    """FSDP2 at W = 1: each block and the root sharded, bf16 parameters, FP32 gradient reduce."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from zerort._testing.launch import free_port

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    model = new_model(args, device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y = data(args, device)

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    step = parted(lambda: loss_of(model(x), y), lambda loss: loss.backward(), update)
    t = timed_steps(step, args, device)
    profile(step, args, device, name)
    return t, peak(device)


def run_staged(args, device, name):
    """zerort at W = 2 on this one GPU: this script again, two ranks under mpirun (--staged-worker)."""
    from zerort._testing.launch import launch

    if device.type != "cuda":
        raise RuntimeError("the staged W = 2 row stages CUDA buffers: it needs a CUDA device")
    if not zerort._C.with_mpi:
        raise RuntimeError("this build has no MPI; the staged W = 2 row runs under mpirun")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "staged.json")
        argv = ["--staged-worker", out, "--size", args.size, "--batch", str(args.batch), "--stage",
                str(args.staged_stage), "--steps", str(args.staged_steps), "--warmup", str(args.warmup)]
        if args.profile:
            argv += ["--profile", args.profile, "--profile-steps", str(args.profile_steps)]
        launch("mpirun", 2, os.path.abspath(__file__), *argv, timeout=args.staged_timeout)
        with open(out) as f:
            r = json.load(f)
    return (r["median"], r["p90"]), r["peak"]


def staged_worker(args):
    """One rank of the staged W = 2 row; rank 0 writes the times and its peak memory."""
    comm = zerort.comm.init("auto", staged="cuda")
    device = comm.device
    engine = zerort.initialize(new_model(args, device), {"stage": args.stage, "precision": "bf16",
                                                         "optimizer": {"lr": 1e-4}, "gradient_clipping": 1.0},
                               comm=comm)
    step = zerort_step(engine, args, device, comm.rank)
    median, p90 = timed_steps(step, args, device)
    if comm.rank == 0:
        profile(step, args, device, f"zerort stage {args.stage} staged W=2")
    else:
        for _ in range(args.profile_steps if args.profile else 0):
            step()  # every rank runs the collectives of rank 0's profiled steps
    if comm.rank == 0:
        with open(args.staged_worker, "w") as f:
            json.dump({"median": median, "p90": p90, "peak": peak(device)}, f)


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=None, help="micro-batch (default 8, tiny 2)")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per row (median and p90 over them)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_const", const="tiny", dest="size", default="350m",
                    help="a tiny GPT (2 layers, d 64) that runs on a CPU too")
    ap.add_argument("--size", choices=tuple(SHAPES), help=argparse.SUPPRESS)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--profile", metavar="DIR", help="write a torch.profiler trace of each row here")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--rows", default="torch,zerort,fsdp2,staged", help="which rows, comma-separated")
    ap.add_argument("--staged-stage", type=int, default=2, help="the staged W = 2 row's ZeRO stage")
    ap.add_argument("--staged-steps", type=int, default=16)
    ap.add_argument("--staged-timeout", type=int, default=400, help="seconds for the staged row's two ranks")
    ap.add_argument("--staged-worker", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.batch is None:
        args.batch = 2 if args.size == "tiny" else 8
    return args


def rows_of(args, device):
    wanted = set(args.rows.split(","))
    rows = []
    if "torch" in wanted:
        rows.append(("torch (autocast bf16, fused AdamW)", lambda n: run_torch(args, device, n)))
    if "zerort" in wanted:
        comm = zerort.comm.init("nccl" if device.type == "cuda" else "auto")
        rows += [(f"zerort stage {s}", lambda n, s=s: run_zerort(s, comm, args, device, n)) for s in range(4)]
    if "fsdp2" in wanted:
        rows.append(("FSDP2 (bf16 params, fp32 reduce, fused AdamW, clipping)", lambda n: run_fsdp2(args, device, n)))
    if "staged" in wanted:
        rows.append((f"zerort stage {args.staged_stage} staged W=2 (per rank)", lambda n: run_staged(args, device, n)))
    return rows


def main():
    args = parse()
    if args.staged_worker:
        return staged_worker(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"bench/gpu_gpt.py: torch {torch.__version__} sees no CUDA device; run it on a GPU machine, or "
                 "pass --tiny --device cpu for the CPU rows")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    shape = SHAPES[args.size]
    n_params = sum(p.numel() for p in set(GPT(**shape).parameters()))
    tokens = args.batch * shape["seq"]
    results = []
    for name, fn in rows_of(args, device):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            (t, p90), mem = fn(name)
            results.append((name, t, p90, mem, None))
        except Exception as e:  # keep the row, say why
            results.append((name, None, None, None, f"{type(e).__name__}: {str(e)[:300]}"))
        print(results[-1], flush=True)
    base = results[0][1] if results and results[0][0].startswith("torch") else None
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{where}  torch {torch.__version__}  GPT {n_params / 1e6:.1f}M params, micro-batch "
          f"{args.batch}x{shape['seq']}, median and p90 of {args.steps} steps after {args.warmup}"
          f" (staged: {args.staged_steps})")
    print("| runtime | step ms (median) | p90 ms | tokens/s | time vs torch | peak GPU memory GB |")
    print("|---|---|---|---|---|---|")
    for name, t, p90, mem, err in results:
        if err:
            print(f"| {name} | failed: {err} | | | | |")
            continue
        ratio = f"{t / base:.2f}" if base else "-"
        gb = f"{mem / 2**30:.2f}" if mem is not None else "-"
        print(f"| {name} | {1e3 * t:.1f} | {1e3 * p90:.1f} | {tokens / t:,.0f} | {ratio} | {gb} |")
    if any(err for *_, err in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
