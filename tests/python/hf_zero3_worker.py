"""One rank of test_hf_zero3_loading.py (torchrun, W = 2): HuggingFace's ZeRO-3 loading path
on zerort's DeepSpeed drop-in, as a script under the launcher meets it. `import deepspeed` is
zerort's (the alias the launcher installs); for each saved model in DIR,

- AutoModelForCausalLM.from_pretrained under HfDeepSpeedConfig(stage 3): transformers builds
  it inside deepspeed.zero.Init and loads it through GatheredParameters(modifier_rank=0);
  what each rank then holds (its pieces), and the gathered weights;
- resize_token_embeddings to the same size (DeepSpeed-Chat's call under ZeRO-3), then
  deepspeed.initialize at stage 3 and STEPS updates, the losses and the final master;
- the same steps on zerort's own path (a plain from_pretrained, no HfDeepSpeedConfig);
- for gpt2 also under a bf16 config ("gpt2@bf16"), where zero.Init builds in bf16 and so holds
  the checkpoint rounded to bf16, as DeepSpeed's does; zerort's own path starts from the
  checkpoint rounded so;
- from_config under ZeRO-3 (transformers' initialize_weights_zero3), trained;
- a resize to a larger vocabulary, which zerort refuses (its message);
- torch.arange's dtype under zero.Init(bf16), with and without transformers'
  prevent_arange_dtype_change entered first.

Writes OUT.rank<r>.pt.

    torchrun --standalone --nproc_per_node 2 hf_zero3_worker.py OUT DIR
"""
import gc
import os
import sys

import torch

from zerort.engine.meta_init import RECIPE

deepspeed = transformers = HfDeepSpeedConfig = is_deepspeed_zero3_enabled = None  # main() imports them

STEPS, MICRO, SEQ = 3, 2, 8
CONFIG = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": MICRO,
          "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.01}}}
BF16 = {**CONFIG, "bf16": {"enabled": True}}  # zero.Init builds in bf16: the checkpoint is held rounded to it


def batches(vocab, rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, vocab, (MICRO, SEQ), generator=g) for _ in range(STEPS)]


def train(model, vocab, rank, config=CONFIG):
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.train()
    losses = []
    for ids in batches(vocab, rank):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    master = engine.full_state_dict(master=True)
    engine.destroy()
    return losses, master


def load_zero3(path, rank, config=CONFIG):
    r = {}
    dschf = HfDeepSpeedConfig(config)  # noqa: F841  (alive while from_pretrained runs, as in DeepSpeed-Chat)
    assert is_deepspeed_zero3_enabled()
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    params = dict(model.named_parameters())
    r["meta"] = all(p.is_meta for p in params.values())
    r["held"] = {n: getattr(p, RECIPE).piece.numel() for n, p in params.items()}
    r["numel"] = {n: p.numel() for n, p in params.items()}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        r["gathered"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    vocab = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(vocab)  # same size: under ZeRO-3 transformers still makes a new embedding
    r["tied"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    r["losses"], r["master"] = train(model, vocab, rank, config)
    return r


def main(out, folder):
    global deepspeed, transformers, HfDeepSpeedConfig, is_deepspeed_zero3_enabled
    from zerort.integrations.deepspeed import alias

    alias.install()  # before transformers looks for deepspeed, as the launcher does
    import deepspeed  # zerort's
    import transformers
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    results = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        r = load_zero3(path, rank)
        gc.collect()  # the HfDeepSpeedConfig is gone: ZeRO-3 loading is off again
        assert not is_deepspeed_zero3_enabled()
        plain = transformers.AutoModelForCausalLM.from_pretrained(path)
        r["plain_losses"], r["plain_master"] = train(plain, plain.get_input_embeddings().weight.shape[0], rank)
        results[name] = r
        if name == "gpt2":  # under a bf16 config; zerort's own path starts from the same bf16-rounded values
            r = load_zero3(path, rank, BF16)
            gc.collect()
            plain = transformers.AutoModelForCausalLM.from_pretrained(path)
            with torch.no_grad():
                for p in plain.parameters():
                    p.copy_(p.bfloat16())
            r["plain_losses"], r["plain_master"] = train(plain, plain.get_input_embeddings().weight.shape[0], rank,
                                                         BF16)
            results["gpt2@bf16"] = r
    dschf = HfDeepSpeedConfig(CONFIG)  # noqa: F841
    path = os.path.join(folder, sorted(os.listdir(folder))[0])
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    results["from_config"] = {"meta": all(p.is_meta for p in model.parameters()),
                              "held": sum(getattr(p, RECIPE).piece.numel() for p in model.parameters()),
                              "numel": sum(p.numel() for p in model.parameters())}
    results["from_config"]["losses"], _ = train(model, model.get_input_embeddings().weight.shape[0], rank)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    try:
        model.resize_token_embeddings(model.get_input_embeddings().weight.shape[0] + 8)
        results["grow"] = None
    except Exception as e:  # noqa: BLE001  (the message is the result)
        results["grow"] = f"{type(e).__name__}: {e}"
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    with deepspeed.zero.Init(config_dict_or_path=BF16):
        results["arange"] = {"init": torch.arange(0.0, 2.0).dtype}
    with prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=BF16):  # from_pretrained's order
        results["arange"].update(swapped=torch.arange(0.0, 2.0).dtype, ones=torch.ones(2).dtype)
    torch.save(results, f"{out}.rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
