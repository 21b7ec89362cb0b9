"""HuggingFace's DeepSpeed test configs (CPU offload on, "auto" values) on a CPU GPT2, each run
twice: as it is and with its offload sections removed, under zerort.integrations.hf.Trainer
and under zerort.integrations.deepspeed.initialize (3 optimizer steps each).

    torchrun --nproc_per_node 2 hf_offload_worker.py OUT CONFIGS.json

CONFIGS.json maps a name to a config: a JSON file path (the Trainer reads the file as it is)
or a dict. Rank 0 writes OUT.json (losses, memory report texts) and OUT.pt (the masters)."""
import copy
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from engine_models import hf_model  # noqa: E402
from hf_trainer_worker import Samples, arguments, in_order, logged  # noqa: E402

import transformers  # noqa: E402

import zerort.integrations.deepspeed as deepspeed  # noqa: E402
import zerort.integrations.hf  # noqa: E402

STEPS, WORLD = 3, 2
# HuggingFace's values for an "auto" key under arguments(work, 2, STEPS) on the model
# hf_model("gpt2") (hidden size 32), for deepspeed.initialize, which fills nothing.
AUTO = {"fp16.enabled": False, "bf16.enabled": False, "optimizer.params.lr": 2e-3,
        "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.1,
        "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 2e-3,
        "scheduler.params.warmup_num_steps": 2, "zero_optimization.reduce_bucket_size": 32 * 32,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * 32 * 32),
        "zero_optimization.stage3_param_persistence_threshold": 10 * 32, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}


def without_offload(cfg):
    cfg = copy.deepcopy(cfg)
    for key in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"].pop(key, None)
    return cfg


def filled(cfg, prefix=""):
    """cfg with each "auto" value replaced by AUTO's (a KeyError names one AUTO lacks)."""
    return {k: filled(v, f"{prefix}{k}.") if isinstance(v, dict) else AUTO[prefix + k] if v == "auto" else v
            for k, v in cfg.items()}


def fresh():
    torch.manual_seed(1234)
    return hf_model("gpt2")


def trainer_run(config, work):
    t = in_order(zerort.integrations.hf.Trainer)(model=fresh(), args=arguments(work, WORLD, STEPS),
                                                 train_dataset=Samples(40, 0), zerort_config=config)
    t.train()
    return logged(t), t.engine


def deepspeed_run(config):
    engine, _, _, _ = deepspeed.initialize(model=fresh(), config=filled(config))
    data, rank, losses = Samples(40, 0).ids, engine.global_rank, []
    micro, accumulation = AUTO["train_micro_batch_size_per_gpu"], AUTO["gradient_accumulation_steps"]
    for i in range(STEPS * accumulation):
        start = (i * WORLD + rank) * micro
        ids = data[start:start + micro]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine


def main(out, configs_path):
    with open(configs_path) as f:
        configs = json.load(f)
    result, masters = {}, {}
    work = os.path.dirname(out)
    for name, given in configs.items():
        raw = given
        if isinstance(given, str):
            with open(given) as f:
                raw = json.load(f)
        for variant, config in (("as_is", given), ("no_offload", without_offload(raw))):
            losses, engine = trainer_run(config, f"{work}/{name}-{variant}")
            result[f"trainer:{name}:{variant}"] = {"losses": losses, "report": engine.memory_report().table(),
                                                   "offload": engine.config.offload.optimizer.device}
            masters[f"trainer:{name}:{variant}"] = engine.full_state_dict(master=True)
            losses, engine = deepspeed_run(raw if variant == "as_is" else config)
            result[f"deepspeed:{name}:{variant}"] = {"losses": losses, "report": engine.memory_report().table(),
                                                     "stage": engine.config.stage}
            masters[f"deepspeed:{name}:{variant}"] = engine.full_state_dict(master=True)
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(masters, out + ".pt")
        with open(out + ".json", "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    main(sys.argv[1], sys.argv[2])
