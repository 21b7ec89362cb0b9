"""initialize() leaves torch's global random stream where it found it: at stages 0-3, for a
model built plainly, under deepspeed.zero.Init, and on the meta device, through both
zerort.initialize and deepspeed.initialize. For each case it saves whether the CPU (and,
where present, CUDA) random state after initialize() equals the state before, and whether
the numbers a script draws next (its data) equal those it draws with no initialize() at all.
Writes OUT.rank<R>.pt.

    torchrun --standalone --nproc_per_node W rng_worker.py OUT
"""
import sys

import torch
import torch.nn as nn
import transformers

import zerort
import zerort.integrations.deepspeed as deepspeed


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=37, n_positions=8)
    return transformers.GPT2LMHeadModel(cfg)


def mlp():
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.LayerNorm(13), nn.Linear(13, 5))


def states():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return [torch.get_rng_state(), *cuda]


def build(make, how, stage):
    if how == "zero.Init":
        with deepspeed.zero.Init(config_dict_or_path=config(stage)):  # built in bf16, as DeepSpeed builds it
            return make()
    if how == "meta":
        with torch.device("meta"):
            return make()
    return make()


def config(stage):
    return {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "train_micro_batch_size_per_gpu": 1}


def main(out):
    results, rank = {}, 0
    for make in (gpt2, mlp):
        for how in ("plain", "zero.Init", "meta"):
            for stage in (0, 1, 2, 3):
                for entry in ("zerort", "deepspeed"):
                    if how != "plain" and stage != 3 and entry == "zerort":
                        continue  # meta builds are made real by stage 3; stages 0-2 are covered through deepspeed
                    torch.manual_seed(7)
                    model = build(make, how, stage)
                    before = states()
                    expected_data = torch.randn(5)  # what the script draws with no initialize()
                    torch.set_rng_state(before[0])
                    if entry == "zerort":
                        engine = zerort.initialize(model, config(stage))
                    else:
                        engine, *_ = deepspeed.initialize(model=model, config=config(stage))
                    after = states()
                    unchanged = len(after) == len(before) and all(map(torch.equal, after, before))
                    results[(make.__name__, how, stage, entry)] = {
                        "unchanged": unchanged,
                        "same_data": torch.equal(torch.randn(5), expected_data)}
                    rank = engine.rank
                    engine.destroy()
    torch.save(results, f"{out}.rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
