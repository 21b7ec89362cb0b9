"""The overlapped step (C++ Note [overlapped step], runtime/step_overlap.h) beside the in-memory
run: the same training run with offload_optimizer "none", "cpu" and "nvme", on a model whose
units have odd, different sizes, at each case's stage and precision, with clipping that bites,
gradient accumulation 2 and (fp16) one step whose gradients overflow. Rank 0 writes OUT.json
(losses, skipped steps, the overlap reports, the checks) and OUT.pt (masters and moments).

    torchrun --nproc_per_node W overlap_worker.py OUT NVME_DIR CASES.json DEVICE

CASES.json: a list of {"name", "stage", "precision", "hold", "ram", "grad_on_device"} ("ram": the nvme
tier's ram_fraction; "grad_on_device": both tiers keep the FP32 gradient with the model, C++ Note
[gradient on the device]); "hold" runs the overlapped tiers
with the engine's test hook that keeps the last unit's update open until the forward's first
wait (Engine.hold_last_update), and records what the forward saw of the update (ordering).
DEVICE: "cpu", or "cuda" (each rank its own GPU: tests/gpu/test_offload_overlap_gpu.py).
"""
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import zerort
from zerort.integrations.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

STEPS, ACCUMULATION, OVERFLOW_STEP = 5, 2, 2
WIDTHS = (13, 37, 23, 41, 19, 29, 7)  # odd, different sizes: every unit's shard is padded differently


class Block(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(a, b) for a, b in zip(WIDTHS[:-2], WIDTHS[1:-1]))
        self.head = nn.Linear(WIDTHS[-2], WIDTHS[-1])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def config(case, tier, nvme_dir):
    optimizer = {"device": tier, "overlap_step": True}  # a CPU model's 'cpu' tier overlaps only when asked
    if tier != "none" and case.get("grad_on_device"):
        optimizer["gradient_on_device"] = True
    if tier == "nvme":
        optimizer.update(nvme_path=nvme_dir, chunk_numel=1000, buffer_count=3, ram_fraction=case.get("ram", 0.0))
    offload = {"optimizer": optimizer}
    if tier == "nvme" and case["stage"] == 3:
        offload["param"] = {"device": "nvme", "nvme_path": nvme_dir}
    return {"stage": case["stage"], "precision": case["precision"],
            "optimizer": {"lr": 1e-2, "weight_decay": 0.01}, "gradient_clipping": 0.05,
            "gradient_accumulation_steps": ACCUMULATION, "reduce_bucket_numel": 600,
            "loss_scale": {"initial_scale_power": 8}, "stage3": {"persistence_threshold": 0},
            "offload": offload}


def batch(step, rank, micro, device):
    g = torch.Generator().manual_seed(step * 7919 + rank * 104729 + micro * 13)
    return torch.randn(9, WIDTHS[0], generator=g).to(device), torch.randn(9, WIDTHS[-1], generator=g).to(device)


def masters(engine):
    return {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in engine.module.named_parameters()}


def run(case, tier, nvme_dir, device):
    torch.manual_seed(1234)
    model = Stack().to(device)
    engine = zerort.initialize(model=model, config=config(case, tier, nvme_dir))
    overlapped = tier != "none" and engine.runtime.overlaps_step
    # The hook holds the last unit until the forward's first wait: both tiers update in the next
    # forward's order (the nvme file streamed in it: C++ Note [NVMe state store], order).
    hold = overlapped and case.get("hold", False)
    out = {"losses": [], "skipped": [], "reports": [], "overlapped": overlapped, "wait_ms": [],
           "skipped_unchanged": None}
    for step in range(STEPS):
        before = masters(engine) if step == OVERFLOW_STEP and case["precision"] == "fp16" else None
        for micro in range(ACCUMULATION):
            x, y = batch(step, engine.rank, micro, device)
            loss = F.mse_loss(engine(x).float(), y)
            if before is not None and micro == ACCUMULATION - 1:
                loss = loss * float("inf")  # every gradient of this window non-finite: the step is skipped
            if hold and step > 0 and micro == 0:  # the forward just ran beside the last step's update
                out["reports"].append(engine.runtime.overlap_report)
            engine.backward(loss)
            if micro == ACCUMULATION - 1:  # set for the update this step starts; the last has no forward after it
                engine.runtime.hold_last_update(hold and step < STEPS - 1)
            s = engine.step()
            out["losses"].append(loss.item())
        out["skipped"].append(bool(s["skipped"]))
        if "update_wait_ms" in s:
            out["wait_ms"].append(s["update_wait_ms"])
        if before is not None:
            after = masters(engine)
            out["skipped_unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    tensors = masters(engine)
    for n, p in engine.module.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"{key}:{n}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    out["tier"] = engine.runtime.state_tier_stats["tier"]
    out["ram_bytes"] = engine.runtime.state_tier_stats["ram_bytes"]
    out["gradient_on_device"] = engine.runtime.state_tier_stats["gradient_on_device"]
    out["units"] = engine.runtime.num_buckets
    engine.destroy()
    return out, tensors


def main():
    out_path, nvme_dir, cases_path, device = sys.argv[1:5]
    with open(cases_path) as f:
        cases = json.load(f)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    results, tensors = {}, {}
    for case in cases:
        for tier in ("none", "cpu", "nvme"):
            key = f"{case['name']}:{tier}"
            results[key], tensors[key] = run(case, tier, nvme_dir, device)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path + ".json", "w") as f:
            json.dump(results, f)
        torch.save(tensors, out_path + ".pt")


if __name__ == "__main__":
    main()
