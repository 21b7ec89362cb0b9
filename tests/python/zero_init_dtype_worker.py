"""deepspeed.zero.Init builds in its config's dtype, as DeepSpeed's does: each rank builds a
model of torch modules and a raw Parameter (Linear, Embedding with a padding row, LayerNorm,
torch.randn, trunc_normal_) and a HuggingFace GPT-2 under zero.Init with a bf16 config and
with an fp16 one, wraps it at stages 1 and 3, and compares the gathered FP32 master, bit for
bit, with a reference made here: the same code from the same seed with torch's constructors
turned into that dtype by this file's own patch (in_dtype), then .float(). Also the random
stream after construction, against the reference's and the FP32 build's (the same draws),
and which parameters kept a copy of their values rather than a replayable recipe. Writes OUT.rank<R>.pt.

    torchrun --standalone --nproc_per_node W zero_init_dtype_worker.py OUT
"""
import contextlib
import sys

import torch
import torch.nn as nn
from zero_init_worker import gpt2  # its GPT-2 (a tiny config)

import zerort.integrations.deepspeed as deepspeed
from zerort.engine.meta_init import RECIPE

NAMES = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")


@contextlib.contextmanager
def in_dtype(dtype):
    """torch's constructors above give their floating results in dtype (made as asked, then
    converted in place), and torch.Tensor(sizes) too: what DeepSpeed's zero.Init is documented
    to do, written for this test."""
    saved = {n: getattr(torch, n) for n in NAMES}

    def converting(make):
        def call(*args, **kwargs):
            t = make(*args, **kwargs)
            if t.is_floating_point():
                t.data = t.data.to(dtype)
            return t
        return call

    legacy = torch.Tensor.__new__

    def new(cls, *args, **kwargs):
        t = legacy(cls, *args, **kwargs)
        return t.to(dtype) if cls is torch.Tensor and t.is_floating_point() else t

    for n in NAMES:
        setattr(torch, n, converting(saved[n]))
    torch.Tensor.__new__ = new
    try:
        yield
    finally:
        for n in NAMES:
            setattr(torch, n, saved[n])
        del torch.Tensor.__new__


class Typed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=3)
        self.raw = nn.Parameter(torch.randn(16, 5))
        self.legacy = nn.Parameter(torch.Tensor(7, 3).uniform_(-1, 1))  # torch.Tensor(sizes), then drawn
        self.lin = nn.Linear(16, 33)  # 33: not divisible by W
        self.ln = nn.LayerNorm(33)
        self.head = nn.Linear(33, 50, bias=False)
        nn.init.trunc_normal_(self.head.weight, std=0.02)

    def forward(self, x):
        return self.head(self.ln(self.lin(self.emb(x) + self.raw.sum(1))))


def main(out):
    results = {}
    for build in (Typed, gpt2):
        for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            torch.manual_seed(1234)
            with in_dtype(dtype):
                reference_model = build()
            reference = {k: v.float() for k, v in reference_model.state_dict().items()}
            dtypes = {p.dtype for p in reference_model.parameters()}
            after_reference = torch.rand(4)
            torch.manual_seed(1234)
            plain = build().state_dict()  # FP32: the reference must differ from it, or the test shows nothing
            after_plain = torch.rand(4)
            for stage in (1, 3):
                config = {"zero_optimization": {"stage": stage}, key: {"enabled": True},
                          "optimizer": {"type": "AdamW"}}
                torch.manual_seed(1234)
                with deepspeed.zero.Init(config_dict_or_path=config):
                    model = build()
                built = {p.dtype for p in model.parameters()}
                copied = [n for n, p in model.named_parameters() if getattr(p, RECIPE).start[0] == "values"]
                after = torch.rand(4)
                engine, *_ = deepspeed.initialize(model=model, config=config)
                got = engine.full_state_dict(master=True)
                results[(build.__name__, key, stage)] = {
                    "reference_dtypes": dtypes, "built_dtypes": built,
                    "reference_differs_from_fp32": any(not torch.equal(reference[k], plain[k].float())
                                                       for k in reference),
                    "differ": [k for k in reference if got[k].dtype != torch.float32
                               or not torch.equal(got[k].view(torch.int32), reference[k].view(torch.int32))],
                    "keys": sorted(reference) == sorted(got), "copied": copied,
                    "rng_after": torch.equal(after, after_reference), "rng_as_fp32": torch.equal(after, after_plain)}
                rank = engine.rank
                engine.destroy()
    torch.save(results, f"{out}.rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
