"""A DeepSpeed-style MiCS script (our own; what DeepSpeed's tests/small_model_debugging/
test_mics_config.py needs): each rank seeds differently, builds its model under
deepspeed.zero.MiCS_Init, and trains a few steps at stage 3 with mics_shard_size from the
command line (rank 0's initial values must win on every rank). Rank 0 writes its losses and
the final weights to OUT.

    torchrun --standalone --nproc_per_node 4 mics_worker.py OUT SHARD_SIZE
"""
import os
import sys

import torch

import zerort.integrations.deepspeed as deepspeed

HIDDEN, SAMPLES, STEPS = 32, 64, 6


def main():
    out, shard = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(2222 + int(os.environ["RANK"]))  # different on every rank, as the DeepSpeed script
    config = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 20, "mics_shard_size": shard,
                                    "mics_hierarchical_params_gather": False,
                                    "stage3_model_persistence_threshold": 10}}
    with deepspeed.zero.MiCS_Init(config_dict_or_path=config):
        model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(SAMPLES, HIDDEN, generator=g), torch.randint(0, HIDDEN, (SAMPLES,), generator=g)
    micro, rank, world = engine.train_micro_batch_size_per_gpu(), engine.global_rank, engine.world_size
    losses = []
    for step in range(STEPS):
        lo = (step * world + rank) * micro
        loss = torch.nn.functional.cross_entropy(engine(x[lo:lo + micro]), y[lo:lo + micro])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if rank == 0:
        torch.save({"losses": losses, "weights": weights, "shard_size": engine.runtime.shard_size}, out)


if __name__ == "__main__":
    main()
