"""One rank of test_deepspeed_zero.py (torchrun, W = 2): a HuggingFace GPT-2 built inside
deepspeed.zero.Init, wrapped at stages 1 and 3; deepspeed.zero.GatheredParameters reads
whole weights and carries rank 0's change into every rank's master. Writes OUT.rank<r>.pt."""
import sys

import torch
import transformers

import zerort.integrations.deepspeed as deepspeed


def main(out):
    results = {}
    for stage in (1, 3):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=8,
                                      bos_token_id=0, eos_token_id=0)
        config = {"zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW"}, "bf16": {"enabled": True}}
        with deepspeed.zero.Init(config_dict_or_path=config):  # built in bf16, as DeepSpeed builds it
            model = transformers.GPT2LMHeadModel(cfg)
        r = {"meta": all(p.is_meta for p in model.parameters()),
             "buffers_real": not any(b.is_meta for b in model.buffers())}
        engine, _, _, _ = deepspeed.initialize(model=model, config=config)
        rank = engine.global_rank
        w = model.transformer.h[0].mlp.c_fc.weight
        with deepspeed.zero.GatheredParameters(w):
            r["gathered_shape"] = tuple(w.shape)
            r["gathered_equals_master"] = torch.equal(
                w.float(), engine.full_state_dict(master=True)["transformer.h.0.mlp.c_fc.weight"].bfloat16().float())
        with deepspeed.zero.GatheredParameters([w, model.transformer.ln_f.weight], modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    w.fill_(0.25)
                    model.transformer.ln_f.weight.fill_(2.0)
        master = engine.full_state_dict(master=True)
        r["c_fc_master"] = master["transformer.h.0.mlp.c_fc.weight"].unique().tolist()
        r["ln_f_master"] = master["transformer.ln_f.weight"].unique().tolist()
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        r["loss"] = float(loss)
        results[stage] = r
    torch.save(results, f"{out}.rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
