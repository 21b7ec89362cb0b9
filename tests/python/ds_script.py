"""A training script written against DeepSpeed's API; its one zerort line is the import.

    torchrun --standalone --nproc_per_node 2 ds_script.py OUT WORKDIR 1,2,3
    mpirun -np 2 python ds_script.py OUT WORKDIR 1,2,3

A small GPT-2 (HuggingFace, tied embeddings) trained with the usual two param groups (no
weight decay on biases and norms), a WarmupDecayLR from the config, gradient accumulation
2, clipping 1.0 and DeepSpeed's training_data loader. At update SAVE_AT it saves a
checkpoint with client_state; after the run a second engine loads it and trains the rest
again. Rank 0 writes what it saw to OUT.stage<S>.pt for test_deepspeed_script.py, which
runs the same training in plain PyTorch. (Several stages in one launch keep the test
short; a user's script would run one.)
"""
import os
import sys

import torch
import transformers

import zerort.integrations.deepspeed as deepspeed

SAVE_AT = 3  # updates
SAMPLES, SEQ, VOCAB = 48, 8, 96


def model_and_data():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ)))
    return model, data


def param_groups(model, weight_decay):
    """No decay on biases and norm weights: the split every HuggingFace recipe makes."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def config(stage):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 2,
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e5, "stage3_param_persistence_threshold": 100},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2,
                                                          "warmup_num_steps": 3, "total_num_steps": 8,
                                                          "warmup_type": "linear"}},
    }


def train(engine, loader, workdir, skip=0, save=True, full_grads=None):
    """Micro-steps from the loader (the first `skip` left out); returns the lr and the
    gradient norm of every update. full_grads: a list that gets the norm of the gradients
    deepspeed.utils.safe_get_full_grad gives before every update."""
    lrs, norms = [], []
    engine.train()
    for i, (ids,) in enumerate(loader):
        if i < skip:
            continue
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary:
            lrs.append(engine.get_lr())
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        if boundary and full_grads is not None:
            grads = [deepspeed.utils.safe_get_full_grad(p) for p in engine.module.parameters()]
            full_grads.append(float(sum(g.double().square().sum() for g in grads).sqrt()))
        engine.step()
        assert engine.was_step_applied() == boundary
        if boundary:
            norms.append(engine.get_global_grad_norm())
            if save and engine.global_steps == SAVE_AT:
                engine.save_checkpoint(workdir, client_state={"updates": engine.global_steps, "note": "mid-run"})
    return lrs, norms


def main(out, workdir, stages):
    for stage in stages:
        model, data = model_and_data()
        engine, optimizer, loader, scheduler = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, 0.1), training_data=data, config=config(stage))
        assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler
        full_grads = []
        lrs, norms = train(engine, loader, os.path.join(workdir, f"stage{stage}"), full_grads=full_grads)
        record = {"master": engine.full_state_dict(master=True), "lrs": lrs, "norms": norms, "full_grads": full_grads,
                  "global_steps": engine.global_steps, "global_samples": engine.global_samples,
                  "skipped_steps": engine.skipped_steps,
                  "forwarded": engine.get_input_embeddings().num_embeddings,  # the module's method
                  "groups": [len(g["params"]) for g in optimizer.param_groups]}
        # Resume: a fresh engine loads the mid-run checkpoint and trains the rest again.
        model, data = model_and_data()
        engine, optimizer, loader, scheduler = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, 0.1), training_data=data, config=config(stage))
        path, client_state = engine.load_checkpoint(os.path.join(workdir, f"stage{stage}"))
        record.update(resumed_path=path, client_state=client_state, resumed_at=engine.global_steps,
                      resumed_lr=engine.get_lr())
        lrs, _ = train(engine, loader, None, skip=SAVE_AT * 2, save=False)
        record.update(resumed_lrs=lrs, resumed_master=engine.full_state_dict(master=True))
        engine.save_16bit_model(os.path.join(workdir, f"stage{stage}"), "model16.bin")
        if engine.global_rank == 0:
            record["saved16"] = torch.load(os.path.join(workdir, f"stage{stage}", "model16.bin"))
            torch.save(record, f"{out}.stage{stage}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")])
