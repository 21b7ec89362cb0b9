"""config autocast (DeepSpeed's torch_autocast) against plain torch.autocast, at W ranks.

    torchrun --nproc_per_node W autocast_worker.py OUT

- "fp32-sN" (N = 0..3): FP32 parameters (bf16 and fp16 off) and torch.autocast(bf16) around
  the forward, configured in DeepSpeed's form. The reference is plain torch on every rank: the
  same starting model, each rank's batch run under torch.autocast, the gradients summed over
  the W batches and divided by W, then torch.optim.AdamW. Per step: the engine's loss against
  the reference's loss on this rank's batch; at the end, the gathered FP32 masters against the
  reference's parameters (the largest absolute difference of each, and whether equal).
- "bf16-s2": bf16 compute with autocast, configured in zerort's form (autocast "bf16"): the
  engine's first loss (its bf16 working copy, a model that takes the loss inside its forward)
  against the plain bf16 model under torch.autocast, and against the same without autocast.

Sizes are odd (13 -> 7 -> 5 and biases: 138 parameters), so no shard is a multiple of W.
Rank 0 writes OUT.json."""
import copy
import json
import os
import sys

import torch

import zerort

STEPS, LR = 4, 3e-3
DIMS = (13, 7, 5)


class Net(torch.nn.Module):
    """Linear, GELU, Linear; the loss (cross-entropy, in FP32 under autocast) inside forward."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(DIMS[0], DIMS[1])
        self.b = torch.nn.Linear(DIMS[1], DIMS[2])

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.b(torch.nn.functional.gelu(self.a(x))), y)


def data(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(9, DIMS[0], generator=g), torch.randint(0, DIMS[2], (9,), generator=g)


def ds_config(stage):
    return {"train_micro_batch_size_per_gpu": 9, "zero_optimization": {"stage": stage, "reduce_bucket_size": 50},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "torch_autocast": {"enabled": True, "dtype": "bfloat16",
                               "lower_precision_safe_modules": ["torch.nn.Linear"]}}


def reference(model, world):
    """Plain torch at W ranks, on one process: the losses of every rank's batch per step, and
    the parameters after STEPS AdamW updates."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        row = []
        for r in range(world):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ref(*data(step, r))
            loss.backward()
            row.append(loss.item())
        for p in ref.parameters():
            p.grad /= world
        opt.step()
        losses.append(row)
    return losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


def plain_loss(rank):
    """This rank's first loss in FP32 without autocast: autocast must change it."""
    torch.manual_seed(7)
    with torch.no_grad():
        return Net()(*data(0, rank)).item()


def fp32_case(stage, rank, world):
    torch.manual_seed(7)
    model = Net()
    want_losses, want_params = reference(model, world)
    engine = zerort.initialize(model, ds_config(stage))
    accessors = [engine.torch_autocast_enabled(), str(engine.torch_autocast_dtype())]
    got = []
    for step in range(STEPS):
        loss = engine(*data(step, rank))
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    masters = engine.full_state_dict(master=True)  # a collective
    diffs = {n: (masters[n].float() - want_params[n]).abs().max().item() for n in want_params}
    steps = lambda t: t.float().view(torch.int32).long()  # same signs: the distance in FP32 steps
    ulps = {n: (steps(masters[n]) - steps(want_params[n])).abs().max().item() for n in want_params}
    engine.destroy()
    return {"losses": got, "want_losses": [row[rank] for row in want_losses],
            "loss_dtype": str(loss.dtype), "accessors": accessors, "params_equal": all(d == 0 for d in diffs.values()),
            "max_param_diff": max(diffs.values()), "max_param_ulps": max(ulps.values()),
            "same_signs": all(bool(((masters[n] < 0) == (want_params[n] < 0)).all()) for n in want_params),
            "first_loss_without_autocast": plain_loss(rank)}


def bf16_case(rank):
    torch.manual_seed(7)
    model = Net()
    plain = copy.deepcopy(model).to(torch.bfloat16)
    x, y = data(0, rank)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = plain(x.to(torch.bfloat16), y).item()
        without = plain(x.to(torch.bfloat16), y).item()
    engine = zerort.initialize(model, {"stage": 2, "precision": "bf16", "autocast": "bf16"})
    with torch.no_grad():
        got = engine(x, y).item()
    engine.destroy()
    return {"loss": got, "want": want, "without_autocast": without}


def main():
    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = {f"fp32-s{s}": fp32_case(s, rank, world) for s in range(4)}
    result["bf16-s2"] = bf16_case(rank)
    if rank == 0:
        with open(out + ".json", "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
