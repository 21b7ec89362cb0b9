"""One rank of the checkpoint tests (under mpirun, or alone with the in-process backend).

    ckpt_worker.py MODE DIR MODEL STAGE [STEPS]
    MODE: train  - STEPS steps from scratch, then save DIR/final.pt (full master) and a checkpoint
          resume - load the checkpoint in DIR, STEPS more steps, save DIR/final.pt
          reshard - load the checkpoint in DIR/src, save DIR/full.pt (state right after loading),
                    one more step, save a new checkpoint in DIR/dst
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

import zerort  # noqa: E402
from engine_models import CONFIG, batch, loss_fn, make_model  # noqa: E402


def train(engine, name, first, steps):
    for step in range(first, first + steps):
        x, y = batch(name, step, engine.rank, 0)
        engine.backward(loss_fn(name, engine(x), y))
        engine.step()


def main():
    mode, directory, name, stage = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    comm = zerort.comm.init("auto", timeout_s=120)
    engine = zerort.initialize(make_model(name), dict(CONFIG, stage=stage, precision="fp16"), comm=comm)
    if mode == "train":
        train(engine, name, 0, steps)
        engine.save_checkpoint(os.path.join(directory, "ckpt"))
    elif mode == "resume":
        engine.load_checkpoint(os.path.join(directory, "ckpt"))
        train(engine, name, engine.global_step, steps)
    elif mode == "reshard":
        engine.load_checkpoint(os.path.join(directory, "src"))
        full = engine.full_state_dict(master=True)
        if comm.rank == 0:
            torch.save(full, os.path.join(directory, "full.pt"))
        engine.save_checkpoint(os.path.join(directory, "dst"))
        train(engine, name, engine.global_step, 1)  # training goes on
    full = engine.full_state_dict(master=True)
    if comm.rank == 0 and mode != "reshard":
        torch.save({"master": full, "global_step": engine.global_step, "scale": engine.loss_scale},
                   os.path.join(directory, f"{mode}.pt"))
    print(f"CKPT WORKER OK rank {comm.rank}/{comm.size}", flush=True)


if __name__ == "__main__":
    main()
