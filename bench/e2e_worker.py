"""One rank of the end-to-end comparison (bench/e2e.py launches it under torchrun).

    torchrun --standalone --nproc_per_node 2 bench/e2e_worker.py OUT.json \\
        --model demo --steps 30 --runtimes ddp fsdp2 zerort1 zerort2 zerort3

Every runtime trains examples/gpt.py's GPT from the same seed on the same batches
(gpt.batch: random windows of standard-library text, different per step and rank), with
AdamW (the same lr, betas, eps, weight decay), gradient clipping at 1.0, bf16 compute:
- zerort1/2/3: zerort.initialize at that stage, precision bf16 (comm: gloo under torchrun);
  zerort1-overlap/zerort2-overlap: the same with overlap_param_gather; zerort2-mpi: stage 2 launched by
  mpirun (e2e.py does), where comm.backend auto is zerort's MPI backend (torch's gloo group carries the figures);
- ddp: DistributedDataParallel(gradient_as_bucket_view=True), torch.autocast(bf16) on CPU,
  FP32 torch.optim.AdamW, clip_grad_norm_;
- fsdp2: fully_shard on every block, then the root, with
  MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), torch.optim.AdamW, clip_grad_norm_;
- fsdp2-hsdp: the same on a 2-D mesh (replicate across nodes, shard within one: HSDP), the
  node's size from torchrun's LOCAL_WORLD_SIZE;
- ds2/ds3: DeepSpeed ZeRO-2/3, bf16, torch's AdamW inside its optimizer, clipping in its config
  (run from a Python that has deepspeed: e2e.py --ds-python).
The runtimes in one launch run one after another in the same processes (so peak RSS is
meaningful only for a launch of one runtime). Rank 0 writes OUT.json: per runtime the mean
loss over ranks at every step, every step's time (the slowest rank's), each rank's peak
RSS and measured model-state bytes, the loss on a held-out batch after the last step, and
the error if the runtime could not run.
"""
import argparse
import datetime
import json
import os
import resource
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import GPT, batch, stdlib_bytes  # noqa: E402

MODELS = {  # name: GPT kwargs, sequences per rank per step
    "tiny": (dict(layers=2, d=64, heads=4, seq=64), 8),
    "demo": (dict(layers=6, d=256, heads=8, seq=128), 8),
    "50m": (dict(layers=10, d=640, heads=10, seq=128), 2),
    "50m-b8": (dict(layers=10, d=640, heads=10, seq=128), 8),  # bench/offload.py: 4x the tokens per step
}
OPT = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 1.0
RUNTIMES = ("ddp", "fsdp2", "fsdp2-hsdp", "ds2", "ds3", "zerort1", "zerort2", "zerort3", "zerort1-overlap",
            "zerort2-overlap", "zerort2-mpi")


def storage_bytes(tensors):
    """Bytes of the distinct storages behind these tensors (DTensors: their local part)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def torch_state_bytes(model, opt):
    params = list(model.parameters())
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return storage_bytes(params + [p.grad for p in params] + states)


class TorchRuntime:
    """DDP with autocast, or FSDP2 with a mixed-precision policy; FP32 AdamW on top."""

    def __init__(self, kind, model, blocks=None):
        """blocks: the modules FSDP2 shards one by one before the root (default: model.blocks)."""
        self.kind = kind
        if kind == "ddp":
            self.model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            world, per_node = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
            mesh = init_device_mesh("cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard")) \
                if kind == "fsdp2-hsdp" else init_device_mesh("cpu", (world,))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for blk in (model.blocks if blocks is None else blocks):
                fully_shard(blk, mesh=mesh, mp_policy=mp)
            self.model = fully_shard(model, mesh=mesh, mp_policy=mp)
        self.opt = torch.optim.AdamW(self.model.parameters(), **OPT)

    def forward(self, x):
        if self.kind == "ddp":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(x)
        return self.model(x)

    def train_step(self, x, y, last):
        loss = loss_fn(self.forward(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        state = torch_state_bytes(self.model, self.opt) if last else None  # grads still held
        self.opt.zero_grad(set_to_none=True)
        return loss.item(), state

    def settle(self):
        pass


class ZerortRuntime:
    def __init__(self, stage, model, extra=None):
        """extra: more config keys (e.g. {"stage3": {"prefetch": 0}})."""
        import zerort

        self.engine = zerort.initialize(model, {
            "stage": stage, "precision": "bf16", "gradient_clipping": CLIP,
            "optimizer": {"lr": OPT["lr"], "betas": list(OPT["betas"]), "eps": OPT["eps"],
                          "weight_decay": OPT["weight_decay"]},
            "comm": {"backend": "auto", "timeout_s": 300}, **(extra or {})})

    def forward(self, x):
        return self.engine(x)

    def settle(self):
        """Nothing left in flight (overlap_param_gather's gathers)."""
        with self.engine.gathered_parameters():
            pass

    def train_step(self, x, y, last):
        loss = loss_fn(self.forward(x), y)
        self.engine.backward(loss)
        self.engine.step()
        state = self.engine.memory_report().to_dict()["total_measured"] if last else None  # a collective
        return loss.item(), state


class DeepSpeedRuntime:
    """DeepSpeed ZeRO-2 or ZeRO-3 in bf16 with torch's AdamW (no compiled ops: DS_BUILD_OPS=0),
    clipping in its config, its CPU accelerator (DS_ACCELERATOR=cpu) over gloo."""

    def __init__(self, stage, model, micro, prefetch=True, extra=None):
        """extra: more zero_optimization keys (e.g. {"offload_optimizer": {"device": "nvme", ...}})."""
        import deepspeed

        zero = {"stage": stage, "reduce_bucket_size": 1 << 24}  # zerort's bucket; DS's 5e8 is a 954 MiB buffer
        if stage == 3 and not prefetch:
            zero["stage3_prefetch_bucket_size"] = 0
        zero.update(extra or {})
        cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
               "gradient_clipping": CLIP, "zero_optimization": zero, "steps_per_print": 1 << 30,
               "optimizer": {"type": "AdamW",
                             "params": {"lr": OPT["lr"], "betas": list(OPT["betas"]), "eps": OPT["eps"],
                                        "weight_decay": OPT["weight_decay"], "torch_adam": True}}}
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def forward(self, x):
        return self.engine(x.to(torch.bfloat16) if x.is_floating_point() else x)

    def settle(self):
        pass

    def train_step(self, x, y, last):
        loss = loss_fn(self.forward(x), y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item(), ds_state_bytes(self.engine) if last else None


def ds_state_bytes(engine):
    """What DeepSpeed's optimizer holds for this rank after a step: the bf16 parameters (ZeRO-3:
    each one's ds_tensor partition), its FP32 master partitions, Adam's m and v, and the
    gradient partitions it keeps (ZeRO-2 frees them after the step; ZeRO-3 keeps its flat
    fp32 gradient partition)."""
    opt = engine.optimizer
    held = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        held += [t for t in getattr(opt, name, None) or [] if isinstance(t, torch.Tensor)]
    inner = opt.optimizer
    held += [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    flat = getattr(opt, "grad_partitions_flat_buffer", None)
    if isinstance(flat, torch.Tensor):
        held.append(flat)
    return storage_bytes(held)


def loss_fn(logits, y):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))


def make_runtime(kind, model, micro, zerort_extra=None, ds_extra=None):
    if kind.startswith("zerort"):  # zerortS; -overlap: overlap_param_gather on; -mpi: launched by mpirun
        stage, _, variant = kind[len("zerort"):].partition("-")
        extra = dict(zerort_extra or {}, **({"overlap_param_gather": True} if variant == "overlap" else {}))
        return ZerortRuntime(int(stage), model, extra)
    if kind.startswith("ds"):
        return DeepSpeedRuntime(int(kind[-1]), model, micro, extra=ds_extra)
    return TorchRuntime(kind, model)


def net_tx():
    """The bytes this host's network devices other than loopback have sent (its namespace's
    /proc/net/dev), read by the host's local rank 0 only, so a sum over ranks counts each host
    once; 0 on the other ranks. Across hosts (scripts/two_hosts.sh) that is the veth: the bytes
    that cross between the hosts, including ranks that wait on the others' sends."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return 0
    total = 0
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, fields = line.split(":", 1)
            total += int(fields.split()[8]) if name.strip() != "lo" else 0
    return total


def reduce(values, op):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op)
    return t.tolist()


def run(kind, model_name, steps, data, zerort_extra=None, ds_extra=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs, micro = MODELS[model_name]
    torch.manual_seed(0)
    model = GPT(**kwargs)
    numel = sum(p.numel() for p in set(model.parameters()))
    rt = make_runtime(kind, model, micro, zerort_extra, ds_extra)
    losses, state, tier_io = [], None, []
    tier = rt.engine.runtime.state_tier_stats if kind.startswith("zerort") else None
    # A step's time and bytes run from its start to the next one's (the last: until the runtime
    # has settled), so work a step leaves in flight (overlap_param_gather's gathers) counts in it.
    starts, sent = [], []
    for step in range(steps):
        x, y = batch(data, step, rank, 0, micro, kwargs["seq"])
        sent.append(net_tx())
        starts.append(time.perf_counter())
        loss, s = rt.train_step(x, y, last=step == steps - 1)
        if tier is not None:  # the tiers' files (state, parameters): their I/O so far (bytes, seconds waited)
            tier = rt.engine.runtime.state_tier_stats
            files = (tier, rt.engine.runtime.param_tier_stats)
            tier_io.append([sum(t[k] for t in files) for k in ("bytes_read", "bytes_written", "io_wait_seconds")])
        state = s if s is not None else state
        loss_sum, = reduce([loss], dist.ReduceOp.SUM)
        losses.append(loss_sum / world)
    rt.settle()
    sent.append(net_tx())
    starts.append(time.perf_counter())
    times = reduce([b - a for a, b in zip(starts, starts[1:])], dist.ReduceOp.MAX)  # the slowest rank's
    net = [b - a for a, b in zip(sent, sent[1:])]
    x, y = batch(data, 1 << 20, rank, 0, micro, kwargs["seq"])  # held out: no training step uses it
    with torch.no_grad():
        held, = reduce([loss_fn(rt.forward(x), y).item()], dist.ReduceOp.SUM)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    per_rank = torch.tensor([float(rss), float(state)], dtype=torch.float64)
    gathered = [torch.zeros_like(per_rank) for _ in range(world)]
    dist.all_gather(gathered, per_rank)
    net = reduce(net, dist.ReduceOp.SUM) if net else net  # every host's, counted once (Note in net_tx)
    return {"numel": numel, "tokens_per_step": world * micro * kwargs["seq"], "losses": losses, "step_s": times,
            "net_tx": net,
            "held_out_loss": held / world, "peak_rss": [int(g[0]) for g in gathered],
            "state_bytes": [int(g[1]) for g in gathered], "tier": tier, "tier_io": tier_io, "error": None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=list(RUNTIMES))
    ap.add_argument("--zerort-config", type=json.loads, help="more zerort config keys, as JSON")
    ap.add_argument("--ds-zero", type=json.loads, help="more DeepSpeed zero_optimization keys, as JSON")
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    under_mpirun = "OMPI_COMM_WORLD_RANK" in os.environ  # zerort on MPI; torch's gloo group for the figures only
    if under_mpirun:
        os.environ.update(RANK=os.environ["OMPI_COMM_WORLD_RANK"], WORLD_SIZE=os.environ["OMPI_COMM_WORLD_SIZE"],
                          LOCAL_RANK=os.environ["OMPI_COMM_WORLD_LOCAL_RANK"], MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("E2E_MASTER_PORT", "29533"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    data = stdlib_bytes()
    results = {}
    for kind in a.runtimes:
        try:
            results[kind] = run(kind, a.model, a.steps, data, a.zerort_config, a.ds_zero)
        except Exception as e:  # keep the row: say exactly why this runtime cannot run here
            results[kind] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(f"[rank {dist.get_rank()}] {kind} failed:\n{results[kind]['traceback']}", file=sys.stderr)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "world_size": dist.get_world_size(), "steps": a.steps,
                       "torch": torch.__version__, "results": results}, f)
    dist.destroy_process_group()
    # End here, without interpreter shutdown. After DDP or FSDP2 has run, torch still holds
    # the default process group (measured: 10 references left after destroy_process_group
    # and gc.collect()), so gloo's worker threads outlive it. A worker that is still dropping
    # the last collective's tensors (Python's, from reduce()) when the interpreter finalizes
    # asks for the GIL, CPython ends it with pthread_exit, and that unwinding through a C++
    # destructor aborts with "terminate called without an active exception" (seen once in
    # test_loss_curves.py). Every result is written and every zerort engine is gone by now.
    sys.stdout.flush()
    sys.stderr.flush()
    if under_mpirun:  # a normal exit: zerort's atexit finalizes MPI (mpirun fails a rank that skips it)
        return
    os._exit(0)


if __name__ == "__main__":
    main()
