"""One rank of tests/python/test_hybrid_shard.py's refusals, under torchrun with 2 ranks: each
case builds (and where it gets that far, trains) an engine with shard_size or stage 3's
secondary shards (stage3.secondary_shard_size), and records the
error's type and text. Writes OUT_PREFIX.rankR.json.

    hybrid_worker.py OUT_PREFIX NVME_DIR
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import zerort  # noqa: E402
from engine_models import CONFIG, batch, loss_fn, make_model  # noqa: E402


def train(engine, comm, steps, gas=1, skip_rank=None, reduce_now_at=None):
    for step in range(steps):
        for micro in range(gas):
            x, y = batch("mlp", step, comm.rank, micro)
            if not (skip_rank == comm.rank and micro == gas - 1):
                engine.backward(loss_fn("mlp", engine(x), y))
            if reduce_now_at == micro:
                engine.runtime.reduce_now()
            engine.step()


def case(comm, nvme_dir, name):
    cfg = dict(CONFIG, stage=2, precision="bf16", shard_size=1)
    if name == "not_a_divisor":
        cfg["shard_size"] = 3
    elif name == "stage0":
        cfg["stage"] = 0
    elif name == "offload":
        cfg["offload"] = {"optimizer": {"device": "nvme", "nvme_path": nvme_dir}}
    elif name in ("reduce_now_mid_window", "skipped_backward"):
        cfg["gradient_accumulation_steps"] = 2
    elif name == "hpz_at_stage2":
        cfg = {k: v for k, v in cfg.items() if k != "shard_size"}
        cfg["stage3"] = {"secondary_shard_size": 2}
    elif name == "hpz_beyond_the_group":  # groups of 2 for hpZ inside shard groups of 1
        cfg = dict(cfg, stage=3, stage3={"secondary_shard_size": 2})
    engine = zerort.initialize(make_model("mlp"), cfg, comm=comm)
    try:
        if name == "reduce_now_mid_window":
            train(engine, comm, 1, gas=2, reduce_now_at=0)
        elif name == "skipped_backward":
            train(engine, comm, 1, gas=2, skip_rank=1)
    finally:
        engine.destroy()


def main():
    comm = zerort.comm.init("auto", timeout_s=60)
    out = {}
    for name in ("not_a_divisor", "stage0", "offload", "reduce_now_mid_window", "skipped_backward", "hpz_at_stage2",
                 "hpz_beyond_the_group"):
        try:
            case(comm, sys.argv[2], name)
            out[name] = None
        except zerort.Error as e:
            out[name] = [type(e).__name__, str(e)]
    with open(f"{sys.argv[1]}.rank{comm.rank}.json", "w") as f:
        json.dump(out, f, indent=1)
    print(f"HYBRID WORKER OK rank {comm.rank}/{comm.size}", flush=True)


if __name__ == "__main__":
    main()
