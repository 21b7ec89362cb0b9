"""The nvme tier of the optimizer state beside the in-memory one, on HuggingFace models from small
configs: the same training run twice (offload_optimizer.device "none" and "nvme"), at each
stage and state dtype the cases name, and a checkpoint saved from one tier loaded into the
other. Small chunks (chunk_numel) make each rank's state many chunks, so the pipeline and the
record edges are crossed.

    torchrun --nproc_per_node W nvme_offload_worker.py OUT NVME_DIR CASES.json

CASES.json: a list of {"name", "model", "stage", "state_dtype", "params", "grads"}; "params" true also
puts stage 3's parameters on NVMe (offload_param) in the nvme run, "grads" true the FP32 gradient
shard (offload_optimizer.gradient_in_file), "ram" a fraction of master, m and v kept in RAM
(offload_optimizer.ram_fraction), "devgrad" true the FP32 gradient with the model
(offload_optimizer.gradient_on_device: the same memory on a CPU model, stepped from host pieces).
Rank 0 writes OUT.json (losses, tier stats, memory report text per run) and OUT.pt (the masters and
moments)."""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from engine_models import batch, hf_model, loss_fn  # noqa: E402

import zerort  # noqa: E402
from zerort.integrations.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

STEPS, ACCUMULATION = 4, 2


def config(case, tier, nvme_dir, work=None):
    optimizer, extra = {"device": tier}, {}
    if tier == "nvme":
        optimizer.update(nvme_path=nvme_dir, chunk_numel=1000, buffer_count=3,
                         gradient_in_file=bool(case.get("grads")), ram_fraction=case.get("ram", 0.0),
                         gradient_on_device=bool(case.get("devgrad")))
        if work:  # the monitor's CSV, with the I/O columns of the nvme tier
            extra["monitor"] = {"csv": True, "output_path": work, "job_name": case["name"]}
    offload = {"optimizer": optimizer}
    if tier == "nvme" and case.get("params"):
        offload["param"] = {"device": "nvme", "nvme_path": nvme_dir}
    return {**extra, "stage": case["stage"], "precision": "bf16", "optimizer": {"lr": 3e-3, "weight_decay": 0.01,
                                                                       "state_dtype": case["state_dtype"]},
            "gradient_clipping": 1.0, "gradient_accumulation_steps": ACCUMULATION,
            "reduce_bucket_numel": 700, "offload": offload}


def train(engine, name, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        for micro in range(ACCUMULATION):
            x, y = batch(name, step, engine.rank, micro)
            loss = loss_fn(name, engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def states(engine):
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"master:{name}"] = safe_get_full_fp32_param(p).clone()
        out[f"exp_avg:{name}"] = safe_get_full_optimizer_state(p, "exp_avg").clone()
        out[f"exp_avg_sq:{name}"] = safe_get_full_optimizer_state(p, "exp_avg_sq").clone()
    return out


def run_case(case, nvme_dir, work, result, tensors):
    for tier in ("none", "nvme"):
        torch.manual_seed(1234)
        engine = zerort.initialize(hf_model(case["model"]), config(case, tier, nvme_dir, work))
        key = f"{case['name']}:{tier}"
        at_start = dict(engine.runtime.state_tier_stats)
        losses = train(engine, case["model"], STEPS)
        stats = dict(engine.runtime.state_tier_stats)
        for k in ("bytes_read", "bytes_written"):
            stats[f"step_{k}"] = stats[k] - at_start[k]
        files = sorted(os.listdir(nvme_dir))
        engine.save_checkpoint(os.path.join(work, key.replace(":", "-")), tag="t")
        report = engine.memory_report()
        result[key] = {"losses": losses, "stats": stats, "files": files, "report": report.table(),
                       "grad_ram": report.measured["grad_shard"],
                       "against_estimate": {k: (report.measured[k], report.estimate[k]) for k in
                                            ("grad_shard", "state_pool", "master")},
                       "file_estimate": (report.tier or {}).get("file_estimate"),
                       "param_stats": dict(engine.runtime.param_tier_stats)}
        tensors[key] = states(engine)
        comm = engine.comm
        engine.destroy()
        comm.barrier()  # every rank's engine is gone
        result[key]["files_after_destroy"] = sorted(os.listdir(nvme_dir))
    # Resume across tiers: each run's checkpoint into the other tier, two more steps.
    for saved, into in (("none", "nvme"), ("nvme", "none")):
        torch.manual_seed(99)  # other starting values: the load must replace them all
        engine = zerort.initialize(hf_model(case["model"]), config(case, into, nvme_dir))
        engine.load_checkpoint(os.path.join(work, f"{case['name']}-{saved}"), tag="t")
        key = f"{case['name']}:{saved}->{into}"
        result[key] = {"losses": train(engine, case["model"], 2, first=STEPS)}
        tensors[key] = states(engine)
        engine.destroy()


def main(out, nvme_dir, cases_path):
    with open(cases_path) as f:
        cases = json.load(f)
    result, tensors = {}, {}
    for case in cases:
        run_case(case, nvme_dir, os.path.dirname(out), result, tensors)
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(tensors, out + ".pt")
        with open(out + ".json", "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
