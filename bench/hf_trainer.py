"""zerort.integrations.hf.Trainer against the stock transformers.Trainer (DDP through accelerate), in one
launch, on the same model, data and arguments.

    .venv/bin/torchrun --standalone --nproc_per_node 2 bench/hf_trainer.py [--steps 24 --hidden 256]

A Llama (4 layers, the given hidden size, byte vocabulary, sequence 128) with per-device
batch 4 and accumulation 2, FP32, on CPU (use_cpu). The time of one optimizer step is the
wall time between the Trainer's on_step_end callbacks, so it holds what a user waits for:
data, forwards, backwards, the reduction, the clip and the update. Median and p90 over the
steps after 4 warm-up steps, the slowest rank's time per step; rank 0 prints the table.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import transformers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
from train_hf_trainer import Windows  # noqa: E402
from gpt import stdlib_bytes  # noqa: E402

import zerort.integrations.hf  # noqa: E402

WARMUP = 4


class StepTimes(transformers.TrainerCallback):
    def __init__(self):
        self.times, self.last = [], None

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


def pct(xs, q):
    return sorted(xs)[max(0, int(round(q * len(xs))) - 1)]


def run(trainer_class, a, extra):
    transformers.set_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False))
    args = transformers.TrainingArguments(
        output_dir="/tmp/zerort-bench-hf", use_cpu=True, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=a.steps + WARMUP + 1, learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, logging_steps=1000,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
    times = StepTimes()
    trainer = trainer_class(model=model, args=args, train_dataset=Windows(stdlib_bytes(), 128, 4096, 0),
                            callbacks=[times], **extra)
    trainer.train()
    mine = torch.tensor(times.times[WARMUP:], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return mine.tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=256)
    a = parser.parse_args()
    transformers.logging.set_verbosity_error()
    rows = [("stock Trainer (DDP)", run(transformers.Trainer, a, {}))]
    for stage in (1, 2, 3):
        cfg = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": False}}
        trainer = run(zerort.integrations.hf.Trainer, a, {"zerort_config": cfg})
        rows.append((f"zerort.integrations.hf.Trainer, stage {stage}", trainer))
    if dist.get_rank() == 0:
        base = statistics.median(rows[0][1])
        print(f"W = {dist.get_world_size()}, Llama hidden {a.hidden}, 4 layers, seq 128, batch 4 x accumulation 2 "
              f"per rank, fp32, {a.steps} timed steps")
        print("| trainer | step ms (median) | p90 | p90/median | median vs stock |")
        print("|---|---|---|---|---|")
        for name, t in rows:
            m = statistics.median(t)
            print(f"| {name} | {1e3 * m:.1f} | {1e3 * pct(t, 0.9):.1f} | {pct(t, 0.9) / m:.2f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
