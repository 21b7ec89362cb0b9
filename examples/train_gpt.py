"""The main job: a small byte-level GPT trained with zerort on Python standard library text.

    mpirun -np 2 python examples/train_gpt.py          # MPI backend
    torchrun --nproc_per_node 2 examples/train_gpt.py  # gloo backend
    python examples/train_gpt.py --launcher-free       # one process, world size 1
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zerort  # noqa: E402
from gpt import GPT, batch, stdlib_bytes  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--launcher-free", action="store_true", help="one process, world size 1")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-batch per rank")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--metrics-dir", metavar="DIR", help="write DIR/train_gpt/metrics.csv and TensorBoard events "
                    "(zerort.monitoring.monitor); draw them with python -m zerort.monitoring.plot DIR/train_gpt")
    args = ap.parse_args()

    torch.set_num_threads(max(1, torch.get_num_threads()))
    config = {
        "stage": args.stage, "precision": args.precision, "gradient_clipping": 1.0,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "lr_schedule": lambda step: args.lr * min(1.0, step / 10),  # 10-step warmup
        "comm": {"backend": "inprocess" if args.launcher_free else "auto", "timeout_s": 300},
    }
    if args.metrics_dir:
        config["monitor"] = {"csv": True, "tensorboard": True, "output_path": args.metrics_dir, "job_name": "train_gpt"}
    torch.manual_seed(0)
    model = GPT(layers=args.layers, d=args.d_model, seq=args.seq)
    n_params = sum(p.numel() for p in set(model.parameters()))  # before stage 3 shards them
    engine = zerort.initialize(model, config)
    data = stdlib_bytes()
    rank, world = engine.rank, engine.world_size
    if rank == 0:
        print(f"train_gpt: {n_params / 1e6:.2f}M parameters ({args.layers} layers, d={args.d_model}), "
              f"{data.numel() / 1e6:.1f} MB of stdlib text, W={world} [{engine.comm.backend}], "
              f"ZeRO stage {args.stage}, {args.precision}, micro-batch {args.batch}x{args.seq}, "
              f"grad-accum {args.grad_accum}", flush=True)
    first = last = None
    for step in range(args.steps):
        t0 = time.perf_counter()
        total = 0.0
        for micro in range(args.grad_accum):
            x, y = batch(data, step, rank, micro, args.batch, args.seq)
            logits = engine(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
            engine.backward(loss)
            engine.step()
            total += loss.item() / args.grad_accum
        mean = torch.tensor([total], dtype=torch.float64)
        engine.comm.all_reduce(mean)
        mean = mean.item() / world
        dt = time.perf_counter() - t0
        first = mean if first is None else first
        last = mean
        s = engine.stats
        if rank == 0:
            tokens = world * args.grad_accum * args.batch * args.seq
            print(f"step {step + 1:3d}  loss {mean:.4f}  scale {s['loss_scale']:g}  grad_norm {s['grad_norm']:.3f}"
                  f"  {'SKIPPED' if s['skipped'] else 'ok     '}  {tokens / dt:8.0f} tok/s", flush=True)
    report = engine.memory_report()  # a collective: every rank
    if rank == 0:
        print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps")
        print(report.table())


if __name__ == "__main__":
    main()
