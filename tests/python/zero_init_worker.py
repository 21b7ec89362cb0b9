"""deepspeed.zero.Init keeps the model's own initialization: each rank builds a HuggingFace
GPT-2 and a model of torch modules and raw Parameters (trunc_normal_, orthogonal_, a
padding row, zeros, ones, randn) under zero.Init, wraps it at stage 3 (and stage 1), and
compares the gathered FP32 master with the same code built without zero.Init from the same
seed, bit for bit; and the random stream after construction. Writes OUT.rank<R>.pt.

    torchrun --standalone --nproc_per_node W zero_init_worker.py OUT
"""
import sys

import torch
import torch.nn as nn
import transformers

import zerort.integrations.deepspeed as deepspeed


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=3)
        self.pos = nn.Parameter(torch.zeros(1, 8, 16))
        self.scale = nn.Parameter(torch.randn(16) * 0.02)  # computed from another tensor: its values are kept
        self.ones = nn.Parameter(torch.ones(16))
        self.lin = nn.Linear(16, 33)  # 33: not divisible by W
        self.ln = nn.LayerNorm(33)
        self.head = nn.Linear(33, 50, bias=False)
        nn.init.trunc_normal_(self.head.weight, std=0.02)
        nn.init.orthogonal_(self.lin.weight)

    def forward(self, x):
        h = self.emb(x) + self.pos[:, :x.shape[1]] * self.scale * self.ones
        return self.head(self.ln(self.lin(h)))


def gpt2():
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=67, n_positions=8)
    return transformers.GPT2LMHeadModel(cfg)


def main(out):
    results = {}
    for build in (Mixed, gpt2):
        torch.manual_seed(1234)
        plain = {k: v.clone() for k, v in build().state_dict().items()}
        after_plain = torch.rand(4)
        for stage in (1, 3):
            torch.manual_seed(1234)
            with deepspeed.zero.Init(dtype=torch.float32):  # the plain build's dtype (the default is fp16)
                model = build()
            after = torch.rand(4)
            engine, *_ = deepspeed.initialize(model=model, config={"zero_optimization": {"stage": stage},
                                                                   "optimizer": {"type": "AdamW"}})
            got = engine.full_state_dict(master=True)
            results[(build.__name__, stage)] = {
                "meta_before": True, "differ": [k for k in plain if not torch.equal(got[k], plain[k])],
                "keys": sorted(plain) == sorted(got), "rng_after": torch.equal(after, after_plain)}
            engine.destroy()
    torch.save(results, f"{out}.rank{engine.rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
