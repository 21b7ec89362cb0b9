"""A DeepSpeed training script; the zerort line is the import (`import deepspeed` before).

    torchrun --standalone --nproc_per_node 2 examples/train_deepspeed.py --deepspeed_config examples/ds_config.json
    mpirun -np 2 python examples/train_deepspeed.py --deepspeed_config examples/ds_config.json

The small byte-level GPT of train_gpt.py, with the usual param groups (no weight decay on
biases and norms), the config's WarmupDecayLR, and a checkpoint with
client_state saved at the end and loaded back.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zerort.integrations.deepspeed as deepspeed  # noqa: E402
from gpt import GPT, stdlib_bytes  # noqa: E402


class Windows(torch.utils.data.Dataset):
    """Fixed windows of seq + 1 bytes: input and next-byte target."""

    def __init__(self, data, seq, count):
        self.data, self.seq = data, seq
        self.starts = torch.randint(0, data.numel() - seq - 1, (count,), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = int(self.starts[i])
        return self.data[s:s + self.seq], self.data[s + 1:s + self.seq + 1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--save-dir", default="/tmp/zerort-ds-example")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT(layers=4, d=128, seq=64)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    data = Windows(stdlib_bytes(), 64, 4096)
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model, model_parameters=groups,
                                                                training_data=data)
    for x, y in loader:
        logits = engine(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        engine.backward(loss)
        engine.step()
        if engine.was_step_applied() and engine.global_rank == 0:
            print(f"update {engine.global_steps:3d}  loss {loss.item():.4f}  next lr {engine.get_lr()[0]:.2e}  "
                  f"grad_norm {engine.get_global_grad_norm():.3f}", flush=True)
        if engine.global_steps == args.steps and engine.was_step_applied():
            break
    path = engine.save_checkpoint(args.save_dir, client_state={"updates": engine.global_steps})
    path, client_state = engine.load_checkpoint(args.save_dir)
    if engine.global_rank == 0:
        print(f"saved and loaded {path}: client_state {client_state}, {engine.global_samples} samples")


if __name__ == "__main__":
    main()
