"""A HuggingFace Trainer script; the zerort lines are the import (`from transformers import
Trainer` before) and zerort_config=.

    torchrun --standalone --nproc_per_node 2 examples/train_hf_trainer.py
    accelerate launch --multi_gpu --num_processes 2 examples/train_hf_trainer.py

A small Llama (4 layers, hidden 128, byte vocabulary) learns the standard library's bytes,
with the config in examples/hf_trainer_config.json (DeepSpeed's form, HuggingFace's "auto"
values; ZeRO-3, bf16 from TrainingArguments). It checkpoints every --save-steps, and the
config's monitor writes OUTPUT_DIR/runs/llama/metrics.csv and TensorBoard events there
(python -m zerort.monitoring.plot OUTPUT_DIR/runs/llama draws them). At the end it saves
the model, loads it back with from_pretrained and greedy-decodes a line with the trained
weights gathered.
"""
import argparse
import json
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import stdlib_bytes  # noqa: E402
from zerort.integrations.hf import Trainer  # noqa: E402  (was: from transformers import Trainer)

HERE = os.path.dirname(os.path.abspath(__file__))


class Windows(torch.utils.data.Dataset):
    """Fixed windows of seq bytes; the model shifts the labels itself."""

    def __init__(self, data, seq, count, seed):
        self.data, self.seq = data, seq
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, data.numel() - seq, (count,), generator=g)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = int(self.starts[i])
        ids = self.data[s:s + self.seq]
        return {"input_ids": ids, "labels": ids}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--output-dir", default="/tmp/zerort-hf-example")
    parser.add_argument("--config", default=os.path.join(HERE, "hf_trainer_config.json"))
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint-N in --output-dir")
    a = parser.parse_args()

    transformers.logging.set_verbosity_error()
    transformers.set_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=10, pad_token_id=None, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    data = stdlib_bytes()
    args = transformers.TrainingArguments(
        output_dir=a.output_dir, use_cpu=not torch.cuda.is_available(), bf16=True, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_steps=a.steps, learning_rate=3e-3, weight_decay=0.1, warmup_steps=5,
        lr_scheduler_type="cosine", max_grad_norm=1.0, logging_steps=5, save_steps=a.save_steps, save_total_limit=2,
        report_to=[], disable_tqdm=True, seed=0)
    with open(a.config) as f:
        zerort_config = json.load(f)
    for monitor in ("csv_monitor", "tensorboard"):  # the monitor writes beside the checkpoints
        zerort_config[monitor]["output_path"] = os.path.join(a.output_dir, "runs")
    trainer = Trainer(model=model, args=args, train_dataset=Windows(data, 64, 4096, 0),
                      eval_dataset=Windows(data, 64, 64, 1), zerort_config=zerort_config)
    last = transformers.trainer_utils.get_last_checkpoint(a.output_dir) if a.resume else None
    trainer.train(resume_from_checkpoint=last)
    print_rank0(f"eval {trainer.evaluate()}")
    trainer.save_model(f"{a.output_dir}/final")
    with trainer.engine.gathered_parameters():
        prompt = data[:16].view(1, -1)
        out = trainer.model.generate(prompt, max_new_tokens=24, do_sample=False)[0, 16:]
    print_rank0(f"generated {bytes(out.tolist())!r}")
    if trainer.args.process_index == 0:
        reloaded = transformers.LlamaForCausalLM.from_pretrained(f"{a.output_dir}/final")
        print(f"from_pretrained {a.output_dir}/final: {reloaded.dtype}, "
              f"{sum(p.numel() for p in reloaded.parameters())} parameters")


def print_rank0(line):
    if int(os.environ.get("RANK", 0)) == 0:
        print(line, flush=True)


if __name__ == "__main__":
    main()
