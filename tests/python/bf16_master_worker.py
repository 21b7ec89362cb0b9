"""bf16 master weights and gradients through the DeepSpeed facade, W = 2 under torchrun
(test_bf16_master.py). For each stage 1-3: a small HuggingFace GPT-2 trained STEPS steps with
DeepSpeed's config form of bf16_full.json, each rank on its own batches; then a checkpoint saved
and loaded into a fresh engine. Rank 0 writes OUT.pt: the losses of both ranks, the master (bf16
bits, widened), m and v, the memory report's rows, and whether the reload was bit for bit.

    torchrun --standalone --nproc_per_node 2 bf16_master_worker.py OUT WORKDIR
"""
import copy
import os
import sys

import torch
import transformers

import zerort.integrations.deepspeed as deepspeed

STEPS, W, SEQ, VOCAB, BATCH = 6, 2, 16, 128, 4


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def batch(step, rank):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 * step + rank))


def config(stage):
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e4},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.01}}}


def states(engine):
    """{name: (master, m, v)} of every parameter, whole, widened to FP32 (a collective)."""
    from zerort.integrations.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {n: (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg").float(),
                safe_get_full_optimizer_state(p, "exp_avg_sq").float())
            for n, p in engine.module.named_parameters()}


def run_stage(stage, base, workdir):
    engine, *_ = deepspeed.initialize(model=copy.deepcopy(base), model_parameters=None, config=config(stage))
    rank = engine.global_rank
    losses = []
    for step in range(STEPS):
        t = batch(step, rank)
        loss = engine(input_ids=t, labels=t).loss
        engine.backward(loss)
        engine.step()
        mine = torch.tensor([loss.item()], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(W)]
        torch.distributed.all_gather(every, mine)
        losses.append([float(x) for x in every])
    rows = engine.memory_report().to_dict()["categories"]
    before = states(engine)
    path = os.path.join(workdir, f"stage{stage}")
    engine.save_checkpoint(path)
    again, *_ = deepspeed.initialize(model=copy.deepcopy(base), model_parameters=None, config=config(stage))
    again.load_checkpoint(path)
    after = states(again)
    same = all(torch.equal(a, b) for n in before for a, b in zip(before[n], after[n]))
    dtypes = {str(engine._impl.master(0).dtype), str(engine._impl.exp_avg(0).dtype)}
    return {"losses": losses, "rows": {k: (v["measured"], v["estimate"]) for k, v in rows.items()},
            "master_numel": sum(engine._impl.master(g).numel() for g in range(engine._impl.num_groups)),
            "states": {n: tuple(t.clone() for t in s) for n, s in before.items()}, "reload_bitwise": same,
            "dtypes": dtypes}


def main(out, workdir):
    deepspeed.init_distributed()
    base = gpt2()
    results = {stage: run_stage(stage, base, workdir) for stage in (1, 2, 3)}
    if torch.distributed.get_rank() == 0:
        torch.save(results, f"{out}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
