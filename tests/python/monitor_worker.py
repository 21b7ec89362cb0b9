"""One rank of test_monitor.py: a small LM trained with the monitor on (DeepSpeed's
csv_monitor and tensorboard keys), an overflow at update 3; rank 0 writes what the engine
reported after every update to OUT.json."""
import json
import sys

import torch
import torch.nn as nn

import zerort.integrations.deepspeed as deepspeed


def main(out, run_dir):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Flatten(), nn.Linear(16 * 6, 32))
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
              "fp16": {"enabled": True, "initial_scale_power": 6, "hysteresis": 1},
              "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
              "csv_monitor": {"enabled": True, "output_path": run_dir, "job_name": "job"},
              "tensorboard": {"enabled": True, "output_path": run_dir, "job_name": "job"}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    seen = []
    for micro in range(12):
        g = torch.Generator().manual_seed(100 * engine.global_rank + micro)
        x, y = torch.randint(0, 32, (3, 6), generator=g), torch.randint(0, 32, (3,), generator=g)
        loss = nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss * float("inf") if micro == 4 else loss)
        s = engine.step()
        if s["boundary"]:
            seen.append({"step": engine.global_steps, "lr": engine.get_lr(), "loss_scale": s["loss_scale"],
                         "grad_norm": s["grad_norm"], "skipped": s["skipped"], "nonfinite": s["nonfinite"],
                         "skipped_steps": engine.skipped_steps})
    if engine.global_rank == 0:
        with open(out, "w") as f:
            json.dump(seen, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
