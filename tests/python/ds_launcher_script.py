"""A DeepSpeed training script as users write them: `import deepspeed` and four more
deepspeed.* modules, init_distributed() then torch.distributed, DeepSpeed's launcher
argument --local_rank, a FusedAdam with a LambdaLR passed to initialize. It runs only under
python -m zerort.integrations.deepspeed.launcher (test_deepspeed_launcher.py), which
resolves the imports to zerort; nothing in it names zerort.

Each rank writes OUT.rank<R>.json: what deepspeed.comm returned, the losses, and its lr.
Rank 0 also trains the same model in plain PyTorch (FP32, torch.optim.AdamW, the same
schedule, the whole global batch) and writes those losses as "reference".
"""
import argparse
import json
import os

import torch
import torch.distributed
import transformers

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import logger, safe_get_full_fp32_param
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

STEPS, MICRO, SEQ, VOCAB = 5, 2, 8, 64


def build():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def batch(step, rank, world):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g)
    return tokens if rank is None else tokens[rank * MICRO:(rank + 1) * MICRO]


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def reference(world):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = schedule(opt)
    losses = []
    for step in range(STEPS):
        tokens = batch(step, None, world)
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = {"torch_rank": torch.distributed.get_rank(), "local_rank_arg": args.local_rank,
            "local_rank": dist.get_local_rank(), "world": world, "is_initialized": dist.is_initialized()}
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    seen["all_reduce"] = t.tolist()
    t = torch.full((2,), float(rank + 10))
    dist.broadcast(t, src=world - 1)
    seen["broadcast"] = t.tolist()
    out = torch.empty(2 * world)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
    seen["all_gather_into_tensor"] = out.tolist()
    mine = torch.empty(2)
    dist.reduce_scatter_tensor(mine, torch.arange(2.0 * world) * (rank + 1))
    seen["reduce_scatter_tensor"] = mine.tolist()
    dist.barrier()
    acc = get_accelerator()
    seen["device"] = acc.device_name(args.local_rank)
    seen["backend_name"] = acc.communication_backend_name()

    model = build()
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.stage}, "bf16": {"enabled": False}}
    engine, _, _, sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=schedule(opt),
                                               config=config)
    losses, lrs = [], []
    for step in range(STEPS):
        tokens = batch(step, rank, world)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        lrs.append(engine.get_lr()[0])
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    logger.info(f"rank {rank} losses {losses}")
    wte = engine.module.transformer.wte.weight
    full = safe_get_full_fp32_param(wte)
    seen["wte_full_shape"] = list(full.shape)
    seen["status_names"] = sorted(s.name for s in ZeroParamStatus)
    ckpt = os.path.join(os.path.dirname(args.out), "ckpt")
    engine.save_checkpoint(ckpt)
    dist.barrier()
    if rank == 0:
        sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
        seen["zero_to_fp32_matches"] = bool(torch.equal(sd["transformer.wte.weight"], full))
        seen["reference"] = reference(world)
    seen.update(losses=losses, lrs=lrs)
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(seen, f)
    dist.log_summary()
    engine.destroy()


if __name__ == "__main__":
    main()
