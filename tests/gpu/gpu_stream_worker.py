"""One rank of the stream-order checks (test_gpu_streams.py; C++ Note [stream order] and Note
[allowed host waits], comm/stream_order.h), at stages 0-3 on a small residual MLP:

    gpu_stream_worker.py OUT [--staged] syncs|side

syncs: after warm-up steps, one steady-state step (forward, backward, step) under
torch.cuda.set_sync_debug_mode("error"), so any synchronizing torch call in it raises; saves
the engine's own counted host waits over that step (zerort._C.host_waits) and the collectives
it handed to the backend.
side: the same training on the default stream (twice) and under `with torch.cuda.stream(s):`, with a
sleep kernel queued on the user's stream before each phase so that work not ordered after that
stream would read stale values; saves both runs' losses and FP32 masters.
--staged: over mpi (mpirun) or gloo (torchrun) with CUDA buffers staged through host memory, so
W ranks share one GPU; else NCCL alone (W = 1).
"""
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic GEMMs: runs compare bit for bit

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import zerort  # noqa: E402

D, BLOCKS, BATCH, SEQ = 256, 4, 8, 64
WARMUP = 3
SLEEP_CYCLES = 20_000_000  # about 10 ms of one SM: the user's stream is well behind the host


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 3 * D + 1)  # odd: shards get padding
        self.fc2 = nn.Linear(3 * D + 1, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class ResidualMlp(nn.Module):
    _no_split_modules = ["Block"]  # stage 3's units

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(D, 7)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def batch(step, rank):
    g = torch.Generator().manual_seed(step * 101 + rank)
    return torch.randn(BATCH, SEQ, D, generator=g).cuda(), torch.randn(BATCH, SEQ, 7, generator=g).cuda()


def make_engine(stage, comm):
    torch.manual_seed(0)
    cfg = {"stage": stage, "precision": "bf16", "optimizer": {"lr": 1e-3}, "gradient_clipping": 1.0,
           "reduce_bucket_numel": 200_000}  # several buckets
    return zerort.initialize(ResidualMlp().cuda(), cfg, comm=comm)


def train_step(engine, x, y, sleep=False):
    if sleep:
        torch.cuda._sleep(SLEEP_CYCLES)
    loss = F.mse_loss(engine(x).float(), y)
    if sleep:
        torch.cuda._sleep(SLEEP_CYCLES)
    engine.backward(loss)
    if sleep:
        torch.cuda._sleep(SLEEP_CYCLES)
    engine.step()
    return loss


def count_syncs(stage, comm):
    engine = make_engine(stage, comm)
    batches = [batch(s, comm.rank) for s in range(WARMUP + 1)]
    for x, y in batches[:WARMUP]:
        train_step(engine, x, y)
    torch.cuda.synchronize()
    dev = torch.cuda.current_device()
    before, calls = zerort._C.host_waits(dev), comm.backend_calls
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing torch call in the step raises
    try:
        train_step(engine, *batches[WARMUP])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    after = zerort._C.host_waits(dev)
    torch.cuda.synchronize()
    return {"host_waits": {k: after[k] - before[k] for k in after}, "backend_calls": comm.backend_calls - calls,
            "local_only": engine.runtime.local_only, "skipped": engine.skipped_steps}


def side_stream_bits(stage, comm, steps=4):
    out = {}
    for where in ("default", "again", "side"):  # "again": the default stream twice, the baseline of determinism
        engine = make_engine(stage, comm)
        stream = torch.cuda.Stream() if where == "side" else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())  # the model was built on the default stream (torch's rule)
        losses = []
        with torch.cuda.stream(stream):
            for s in range(steps):
                x, y = batch(s, comm.rank)  # made on this stream
                losses.append(train_step(engine, x, y, sleep=True))
            master = {k: v.float().cpu() for k, v in engine.full_state_dict(master=True).items()}
            losses = [float(v) for v in losses]
        out[where] = {"losses": losses, "master": master}
        del engine
    return out


def main():
    out, args = sys.argv[1], sys.argv[2:]
    staged = args[0] == "--staged"
    mode = args[-1]
    torch.use_deterministic_algorithms(True, warn_only=True)
    if staged:
        comm = zerort.comm.init("auto", timeout_s=120, staged="cuda")
    else:
        comm = zerort.comm.init("nccl", timeout_s=120)
    fn = count_syncs if mode == "syncs" else side_stream_bits
    results = {}
    for stage in range(4):
        results[stage] = fn(stage, comm)
        print(f"stage {stage} {mode}: {results[stage] if mode == 'syncs' else 'done'}", flush=True)
    torch.save(results, f"{out}.rank{comm.rank}.pt")
    print(f"GPU STREAM WORKER OK rank {comm.rank}/{comm.size} {mode}", flush=True)


if __name__ == "__main__":
    main()
