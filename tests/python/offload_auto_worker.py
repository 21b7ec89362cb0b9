"""offload.placement "auto" beside the concrete placement it resolves to: the same training run twice
on an MLP of about a million parameters in six units (big enough that the state outweighs the NVMe
tier's buffers), once with placement auto and once with the offload
settings auto chose written out by hand. The host RAM auto may count is capped
(ZERORT_OFFLOAD_BUDGETS) just at what the TARGET candidate needs, so auto must pass over every
faster one and take it (Note [auto placement]); at W > 1 rank 0's cap is 64 times that, so the
ranks agree only if each takes the least budget over them. Small chunks make each rank's state
many chunks.

    torchrun --nproc_per_node W offload_auto_worker.py OUT NVME_DIR STAGE TARGET [cuda]

TARGET "nvme:K" caps the RAM at nvme's need plus K of its records: auto keeps K records in RAM (the split).

With "cuda" the model is on the GPU (W = 1, NCCL; tests/gpu/test_gpu_offload_auto.py) and the
device's budget is capped too, at what TARGET needs of it.

Rank 0 writes OUT.json: the chosen placement, both runs' losses, whether the masters and
moments are equal bit for bit, and the auto run's memory report."""
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from engine_models import batch, loss_fn  # noqa: E402
from nvme_offload_worker import states  # noqa: E402

import zerort  # noqa: E402
from zerort.accounting import placement, placement_auto  # noqa: E402
from zerort.accounting.memory import model_groups  # noqa: E402
from zerort.config import parse  # noqa: E402

STEPS = 3


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Wide(torch.nn.Module):
    """13 inputs and 7 outputs as engine_models' "mlp" data; 6 blocks of width 401 (units at stage 3)."""

    def __init__(self, width=401, depth=6):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(13, width), torch.nn.Linear(width, 7)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def make_model(_name=None):
    torch.manual_seed(1234)
    return Wide()


def config(stage, nvme_dir, offload):
    tier = {"nvme_path": nvme_dir, "chunk_numel": 4096, "buffer_count": 3}
    offload = json.loads(json.dumps(offload))
    offload.setdefault("optimizer", {}).update(tier)
    return {"stage": stage, "precision": "bf16", "optimizer": {"lr": 3e-3, "weight_decay": 0.01},
            "gradient_clipping": 1.0, "reduce_bucket_numel": 70_000, "offload": offload,
            "stage3": {"unit_modules": ["Block"]}}


def budget_for(need):
    """The free bytes whose usable part (Note [auto placement]) is need."""
    return math.ceil((need + placement.MARGIN_BYTES) / (1 - placement.MARGIN_FRACTION)) + 1


def cap_at(stage, nvme_dir, target, world, cuda):
    """Sets ZERORT_OFFLOAD_BUDGETS so that auto's usable RAM (and on a GPU its device) is what target needs,
    the disk uncapped: every faster candidate needs more of one of them."""
    c = parse(config(stage, nvme_dir, {"placement": "auto"}))
    shape = placement_auto.shape_of(model_groups(make_model(), stage, "bf16", c), c, world)
    target, _, records = target.partition(":")  # "nvme:K": room for K of the file's records more in RAM
    need = {cand.name: {t: sum(b.values()) * (world if t == "ram" else 1)
                        for t, b in placement.tier_bytes(shape, cand, cuda).items()}
            for cand in placement.candidates(stage, cuda)}  # each unsplit
    ram = budget_for(need[target]["ram"] + int(records or 0) * world * shape.nvme.record_bytes(shape.state_bytes))
    if int(os.environ.get("RANK", 0)) == 0 and world > 1:  # alone it would keep the states in RAM: the ranks
        ram *= 64                                          # must agree on the least budget, the last rank's
    os.environ[placement_auto.CAPS_ENV] = f"ram={ram}" + (f",device={budget_for(need[target]['device'])}" if cuda
                                                          else "")
    return need


def train(engine):
    losses = []
    for step in range(STEPS):
        x, y = (t.to(engine.device) for t in batch("mlp", step, engine.rank, 0))
        loss = loss_fn("mlp", engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def run(cfg, device):
    engine = zerort.initialize(make_model().to(device), cfg)
    out = {"losses": train(engine)}
    out["states"] = states(engine)
    out["report"] = engine.memory_report().table()
    out["placement"] = engine.placement
    out["ram_bytes"] = engine.runtime.state_tier_stats.get("ram_bytes", 0)
    out["gradient_on_device"] = engine.runtime.state_tier_stats["gradient_on_device"]
    out["offload"] = engine.config.offload
    comm = engine.comm
    engine.destroy()
    comm.barrier()
    return out


def main(out, nvme_dir, stage, target, device="cpu"):
    stage = int(stage)
    world = int(os.environ.get("WORLD_SIZE", 1))
    need = cap_at(stage, nvme_dir, target, world, device == "cuda")
    auto = run(config(stage, nvme_dir, {"placement": "auto"}), device)
    cand = auto["placement"].candidate
    par = {"device": cand.param, "nvme_path": nvme_dir} if cand.param == "nvme" else {"device": cand.param}
    os.environ.pop(placement_auto.CAPS_ENV)
    concrete = run(config(stage, nvme_dir, {"optimizer": {"device": cand.optimizer, "gradient_in_file":
                                                          cand.gradient_in_file, "ram_fraction": cand.ram_fraction,
                                                          "gradient_on_device": cand.gradient_on_device},
                                            "param": par}), device)
    same = auto["states"].keys() == concrete["states"].keys() and all(
        torch.equal(auto["states"][k], concrete["states"][k]) for k in auto["states"])
    if int(os.environ.get("RANK", 0)) == 0:
        with open(out + ".json", "w") as f:
            json.dump({"chosen": cand.name, "label": cand.label, "ram_bytes": auto["ram_bytes"], "need": need,
                       "auto_losses": auto["losses"],
                       "concrete_losses": concrete["losses"], "same_states": same, "report": auto["report"],
                       "resolved": [auto["offload"].optimizer.device, auto["offload"].param.device,
                                    auto["offload"].optimizer.gradient_in_file],
                       "gradient_on_device": auto["gradient_on_device"]}, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])
