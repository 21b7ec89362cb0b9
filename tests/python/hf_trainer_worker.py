"""A Trainer script on zerort.integrations.hf.Trainer, and the stock transformers.Trainer it must match.

    torchrun --nproc_per_node 2 hf_trainer_worker.py zerort OUT WORK   (W = 2)
    python hf_trainer_worker.py stock OUT WORK                          (W = 1: the reference,
                                                                        then a resume of W = 2's checkpoint)

Both sides see the same samples in every window: the data are read in order (a sequential
sampler on both), the global batch is 8 (W = 2: 2 per device x accumulation 2; W = 1: 2 x 4).
Rank 0 writes OUT.json (logged values, checks) and OUT.pt (weights)."""
import glob
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from engine_models import HF_SEQ, HF_VOCAB, hf_model  # noqa: E402

import transformers  # noqa: E402

import zerort  # noqa: E402
import zerort.integrations.hf  # noqa: E402

SAMPLES, GLOBAL_BATCH, PER_DEVICE = 80, 8, 2  # 10 steps of 8
MODELS = ("gpt2", "llama")
PARITY_STEPS, STAGES = 6, (1, 2, 3)
RESUME_MODEL, RESUME_STAGE, SAVE_AT, STEPS = "llama", 3, 5, 10
MODEL_CLASS = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}


class Samples(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, HF_VOCAB, (n, HF_SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def in_order(trainer_class):
    """trainer_class reading the training data in order (the same windows at any W)."""
    class InOrder(trainer_class):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)
    return InOrder


def arguments(work, world, steps, **kw):
    values = dict(output_dir=work, use_cpu=True, per_device_train_batch_size=PER_DEVICE,
                  per_device_eval_batch_size=PER_DEVICE,
                  gradient_accumulation_steps=GLOBAL_BATCH // (PER_DEVICE * world),
                  max_steps=steps, learning_rate=2e-3, weight_decay=0.1, warmup_steps=2, lr_scheduler_type="linear",
                  max_grad_norm=0.5, logging_steps=1, report_to=[], save_strategy="no", seed=7, disable_tqdm=True)
    return transformers.TrainingArguments(**{**values, **kw})


def both_sides(world, trainer_class, work, config_for):
    """The scenarios both sides run with the same arguments (config_for(stage) -> the
    zerort_config keywords, {} for the stock Trainer): several epochs whose last window is
    short, a ReduceLROnPlateau schedule, and load_best_model_at_end with checkpoint
    rotation, predict() and evaluate()."""
    out = {}
    for name, stage in (("gpt2", 0), ("llama", 2)):  # 44 samples: each epoch ends with a half window
        t = in_order(trainer_class)(model=fresh(name), train_dataset=Samples(44, 0), **config_for(stage),
                                    args=arguments(f"{work}/epochs-{name}", world, -1, num_train_epochs=2))
        t.train()
        out[f"epochs:{name}:{stage}"] = logged(t)
    t = in_order(trainer_class)(model=fresh("llama"), train_dataset=Samples(SAMPLES, 0), eval_dataset=Samples(8, 1),
                                **config_for(2), args=arguments(
                                    f"{work}/plateau", world, 8, lr_scheduler_type="reduce_lr_on_plateau",
                                    lr_scheduler_kwargs={"patience": 0, "factor": 0.5}, eval_strategy="steps",
                                    eval_steps=1, learning_rate=5e-2, warmup_steps=0, save_strategy="steps",
                                    save_steps=4))
    t.train()
    out["plateau"] = logged(t)
    best_dir = f"{work}/best"
    t = in_order(trainer_class)(model=fresh("llama"), train_dataset=Samples(SAMPLES, 0), eval_dataset=Samples(10, 1),
                                **config_for(3), args=arguments(
                                    best_dir, world, STEPS, eval_strategy="steps", eval_steps=2,
                                    save_strategy="steps", save_steps=2, save_total_limit=2, learning_rate=2e-2,
                                    load_best_model_at_end=True, metric_for_best_model="eval_loss"))
    before = t.evaluate()["eval_loss"]
    predicted = t.predict(Samples(6, 2))
    t.train()
    out["best"] = {"eval_before": before, "predict_loss": predicted.metrics["test_loss"],
                   "predict_sum": float(torch.as_tensor(predicted.predictions).double().sum()),
                   "log": logged(t), "best": os.path.basename(t.state.best_model_checkpoint),
                   "best_metric": t.state.best_metric, "eval_after": t.evaluate()["eval_loss"],
                   "left": sorted(os.path.basename(d) for d in glob.glob(f"{best_dir}/checkpoint-*"))}
    return out


def logged(trainer):
    """The training steps' logged loss, grad_norm and learning_rate."""
    return [{k: h[k] for k in ("step", "loss", "grad_norm", "learning_rate")}
            for h in trainer.state.log_history if "loss" in h]


def zerort_trainer(model, work, world, steps, config, **kw):
    return in_order(zerort.integrations.hf.Trainer)(model=model, args=arguments(work, world, steps, **kw),
                                       train_dataset=Samples(SAMPLES, 0), eval_dataset=Samples(8, 1),
                                       zerort_config=config)


def config(stage, monitor=None):
    """DeepSpeed's form with HuggingFace's "auto" values, as a Trainer user writes it."""
    c = {"zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"},
         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
         "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    if monitor:
        c["csv_monitor"] = {"enabled": True, "output_path": monitor, "job_name": "trainer"}
        c["tensorboard"] = {"enabled": True, "output_path": monitor, "job_name": "trainer"}
    return c


def fresh(name):
    torch.manual_seed(1234)
    return hf_model(name)


def master(trainer):
    return trainer.engine.full_state_dict(master=True)


def zerort_side(out, work):
    rank = int(os.environ.get("RANK", 0))
    result, weights = {"parity": {}}, {}
    result.update(both_sides(2, zerort.integrations.hf.Trainer, work, lambda stage: {"zerort_config": config(stage)}))
    # fp16 from 2**24: the first steps overflow and are skipped; the schedule moves on applied steps only
    t = zerort_trainer(fresh("llama"), f"{work}/fp16", 2, STEPS + 6, {"zero_optimization": {"stage": 2},
                       "fp16": {"enabled": "auto", "initial_scale_power": 24}}, fp16=True)
    t.train()
    result["fp16"] = [{**h, "grad_norm": h["grad_norm"] if math.isfinite(h["grad_norm"]) else None}
                      for h in logged(t)]
    result["fp16_skipped"] = t.engine.skipped_steps
    for name in MODELS:  # stages 1-3 against the stock Trainer
        for stage in STAGES:
            t = zerort_trainer(fresh(name), f"{work}/p-{name}-{stage}", 2, PARITY_STEPS, config(stage))
            t.train()
            result["parity"][f"{name}:{stage}"] = logged(t)
    t = zerort_trainer(fresh("llama"), f"{work}/p-llama-bf16", 2, PARITY_STEPS, config(3), bf16=True)
    t.train()
    result["bf16"] = logged(t)
    # Straight to 10 with checkpoints every 5 steps, then a second run resumed from step 5.
    t = zerort_trainer(fresh(RESUME_MODEL), f"{work}/straight", 2, STEPS, config(RESUME_STAGE, f"{work}/runs"),
                       save_strategy="steps", save_steps=SAVE_AT, save_total_limit=2)
    t.train()
    result["straight"], weights["straight"] = logged(t), master(t)
    r = zerort_trainer(fresh(RESUME_MODEL), f"{work}/resumed", 2, STEPS, config(RESUME_STAGE),
                       save_strategy="steps", save_steps=SAVE_AT)
    r.train(resume_from_checkpoint=f"{work}/straight/checkpoint-{SAVE_AT}")
    result["resumed"], weights["resumed"] = logged(r), master(r)
    # save_model() -> from_pretrained: the FP32 master exactly; then the same folder read unit by unit.
    t.save_model(f"{work}/final")
    result["eval_loss"] = t.evaluate()["eval_loss"]  # stage 3: the engine's hooks gather each unit
    prompt = torch.arange(2, 8).view(1, -1)
    with t.engine.gathered_parameters():
        result["generated"] = t.model.generate(prompt, max_new_tokens=5, do_sample=False).tolist()
    lazy = zerort.integrations.hf.from_pretrained(MODEL_CLASS[RESUME_MODEL], f"{work}/final")
    result["lazy_meta"] = all(p.is_meta for p in lazy.parameters())
    lz = zerort_trainer(lazy, f"{work}/lazy", 2, STEPS, config(3))
    lz.evaluate()
    weights["lazy"] = master(lz)
    # GPT2's tied head through save_model at stage 2.
    no_weights = config(2)  # DeepSpeed's switch off: checkpoints hold zerort's shards, no safetensors
    no_weights["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    g = zerort_trainer(fresh("gpt2"), f"{work}/gpt2", 2, 2, no_weights, save_strategy="steps", save_steps=1)
    g.train()
    result["no_weights_checkpoint"] = sorted(os.listdir(f"{work}/gpt2/checkpoint-1"))
    g.save_model(f"{work}/gpt2-final")  # asked for by name: written
    weights["gpt2"] = master(g)
    if rank == 0:
        torch.save(weights, out + ".pt")
        with open(out + ".json", "w") as f:
            json.dump(result, f)


def stock_side(out, work):
    """W = 1: the stock Trainer's values, the saved models read back, and a W = 1 resume of
    W = 2's checkpoint."""
    result = {"parity": {}}
    result.update(both_sides(1, transformers.Trainer, f"{work}/stock", lambda stage: {}))
    for name in MODELS:
        t = in_order(transformers.Trainer)(model=fresh(name), args=arguments(f"{work}/s-{name}", 1, PARITY_STEPS),
                                           train_dataset=Samples(SAMPLES, 0))
        t.train()
        result["parity"][name] = logged(t)
    final = MODEL_CLASS[RESUME_MODEL].from_pretrained(f"{work}/final")
    weights = {"final": {k: v.detach() for k, v in final.state_dict().items()}}
    result["final_dtype"] = str(final.dtype)
    ev = transformers.Trainer(model=final, args=arguments(f"{work}/e", 1, 1), eval_dataset=Samples(8, 1))
    result["eval_loss"] = ev.evaluate()["eval_loss"]
    with torch.no_grad():
        result["generated"] = final.generate(torch.arange(2, 8).view(1, -1), max_new_tokens=5,
                                             do_sample=False).tolist()
    gpt2 = transformers.GPT2LMHeadModel.from_pretrained(f"{work}/gpt2-final")
    weights["gpt2"] = {k: v.detach() for k, v in gpt2.state_dict().items()}
    result["gpt2_tied"] = gpt2.lm_head.weight is gpt2.transformer.wte.weight
    r = zerort_trainer(fresh(RESUME_MODEL), f"{work}/resumed-w1", 1, STEPS, config(RESUME_STAGE - 1))  # another stage
    r.train(resume_from_checkpoint=f"{work}/straight/checkpoint-{SAVE_AT}")
    result["resumed_w1"] = logged(r)
    torch.save(weights, out + ".pt")
    with open(out + ".json", "w") as f:
        json.dump(result, f)


def without_use_cpu(out, work):
    """Several ranks on a machine without a GPU and without use_cpu=True: accelerate sees one
    rank per process, and the Trainer must stop, not train W separate models."""
    args = arguments(work, 1, 1, use_cpu=False)
    in_order(zerort.integrations.hf.Trainer)(model=fresh("gpt2"), args=args, train_dataset=Samples(SAMPLES, 0),
                                zerort_config=config(1)).train()


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    modes = {"zerort": zerort_side, "stock": stock_side, "without_use_cpu": without_use_cpu}
    modes[sys.argv[1]](sys.argv[2], sys.argv[3])
