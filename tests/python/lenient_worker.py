"""One rank of test_ds_lenient.py: engine_models' tiny transformer trained through
zerort.integrations.deepspeed.initialize under each DeepSpeed config of a JSON file, for
STEPS optimizer steps on the same data; rank 0 prints "== NAME" before each initialize (its
banner follows) and saves every run's FP32 masters. A config without an optimizer section
gets the optimizer DeepSpeed-Chat passes: DeepSpeedCPUAdam with offload_optimizer "cpu",
else FusedAdam.

    torchrun --nproc_per_node 2 lenient_worker.py OUT.pt CONFIGS.json
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

import zerort.integrations.deepspeed as deepspeed  # noqa: E402
from engine_models import batch, loss_fn, make_model  # noqa: E402

STEPS = 2


def run(name, config, rank):
    if rank == 0:
        print(f"== {name}", flush=True)
    model, optimizer = make_model("tiny"), None
    if "optimizer" not in config:
        offload = config["zero_optimization"].get("offload_optimizer", {}).get("device") == "cpu"
        adam = deepspeed.ops.adam.DeepSpeedCPUAdam if offload else deepspeed.ops.adam.FusedAdam
        optimizer = adam(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    for i in range(STEPS * accumulation):
        x, y = batch("tiny", i, rank, 0, size=micro)
        engine.backward(loss_fn("tiny", engine(x), y))
        engine.step()
    masters = engine.full_state_dict(master=True)
    engine.destroy()
    return masters


def main(out, configs_path):
    with open(configs_path) as f:
        configs = json.load(f)
    rank = int(os.environ.get("RANK", 0))
    masters = {name: run(name, config, rank) for name, config in configs.items()}
    if rank == 0:
        torch.save(masters, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
