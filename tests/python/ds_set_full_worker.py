"""deepspeed.utils.safe_set_full_* on a HuggingFace model from a small config, at each stage
and tier the cases name: engine A trains two steps and its masters and Adam moments are read
with safe_get_full_*; engine B, built from another seed, takes them with safe_set_full_*. B
must then read back A's values bit for bit, and its forward on a held-out batch must give A's
loss bit for bit (the working weights follow the master, released stage-3 units included).

    torchrun --nproc_per_node W ds_set_full_worker.py OUT NVME_DIR CASES.json

CASES.json: a list of {"name", "model", "stage", "tier"} (tier: none, nvme, or nvme+params).
Rank 0 writes OUT.json: per case, whether each check held."""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from engine_models import batch, hf_model, loss_fn  # noqa: E402

import zerort  # noqa: E402
from zerort.integrations.deepspeed import utils  # noqa: E402

KEYS = ("master", "exp_avg", "exp_avg_sq")


def config(case, nvme_dir):
    offload = {}
    if case["tier"].startswith("nvme"):
        offload["optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "chunk_numel": 1000}
    if case["tier"] == "nvme+params":
        offload["param"] = {"device": "nvme", "nvme_path": nvme_dir}
    return {"stage": case["stage"], "precision": "bf16", "optimizer": {"lr": 3e-3, "state_dtype": "fp32"},
            "reduce_bucket_numel": 700, "offload": offload}


def full(engine):
    get = lambda p, k: utils.safe_get_full_fp32_param(p) if k == "master" else \
        utils.safe_get_full_optimizer_state(p, k)
    return {(n, k): get(p, k).clone() for n, p in engine.module.named_parameters() for k in KEYS}


def held_out_loss(engine, model):
    x, y = batch(model, 1000, 0, 0)
    with torch.no_grad():
        return loss_fn(model, engine(x), y).item()


def run_case(case, nvme_dir):
    torch.manual_seed(1)
    a = zerort.initialize(hf_model(case["model"]), config(case, nvme_dir))
    for step in range(2):
        x, y = batch(case["model"], step, a.rank, 0)
        a.backward(loss_fn(case["model"], a(x), y))
        a.step()
    want, want_loss = full(a), held_out_loss(a, case["model"])
    a.destroy()
    torch.manual_seed(2)  # other starting values: the sets must replace them all
    b = zerort.initialize(hf_model(case["model"]), config(case, nvme_dir))
    before_loss = held_out_loss(b, case["model"])
    for name, p in b.module.named_parameters():
        utils.safe_set_full_fp32_param(p, want[(name, "master")])
        for k in KEYS[1:]:
            utils.safe_set_full_optimizer_state(p, want[(name, k)], k)
    got, got_loss = full(b), held_out_loss(b, case["model"])
    comm = b.comm
    b.destroy()
    comm.barrier()  # every rank's engine, and so its files, is gone
    return {"values_equal": all(torch.equal(got[k], want[k]) for k in want), "loss_equal": got_loss == want_loss,
            "loss_changed": before_loss != want_loss, "files_left": os.listdir(nvme_dir)}


def main(out, nvme_dir, cases_path):
    with open(cases_path) as f:
        cases = json.load(f)
    result = {case["name"]: run_case(case, nvme_dir) for case in cases}
    if int(os.environ.get("RANK", 0)) == 0:
        with open(out + ".json", "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
