"""offload.placement "auto" on a CUDA model (W = 1, NCCL; Note [auto placement]): the device's free memory
measured (torch.cuda.mem_get_info) and capped through ZERORT_OFFLOAD_BUDGETS just at what the target
placement needs, so auto must pass over the GPU-resident one; the run then equals the concrete placement
it resolves to, bit for bit (tests/python/offload_auto_worker.py with "cuda"), the gradient on the device
among them."""
import json
import os

import pytest
import torch

from zerort._testing.launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "..", "python", "offload_auto_worker.py")


def test_the_device_budget_is_measured():
    from zerort.accounting import placement_auto

    free, total = torch.cuda.mem_get_info()
    b = placement_auto.measure(torch.device("cuda"), None)
    assert 0 < b.device <= total and abs(b.device - free) < total // 10  # one rank a GPU here


@pytest.mark.parametrize("stage,target", [(2, "cpu"), (3, "cpu+params"), (3, "nvme"), (1, "cpu dev-grad"),
                                          (3, "nvme dev-grad")])
def test_auto_on_a_gpu_gives_the_bits_of_the_placement_it_resolves_to(tmp_path, stage, target):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    launch("alone", 1, WORKER, tmp_path / "out", nvme, stage, target, "cuda", timeout=300,
           env={"PYTHONFAULTHANDLER": "1"})
    with open(tmp_path / "out.json") as f:
        r = json.load(f)
    print(f"[gpu offload auto stage {stage}] chose {r['chosen']}; needs {r['need'][target]}")
    assert r["chosen"] == target, r["need"]
    assert r["auto_losses"] == r["concrete_losses"] and r["same_states"]
    assert f"placement auto: {target}" in r["report"] and "  device: working" in r["report"]
    assert r["gradient_on_device"] == target.endswith("dev-grad")  # C++ Note [gradient on the device]
