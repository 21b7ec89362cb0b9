"""The overlapped step (C++ Note [overlapped step], runtime/step_overlap.h): with the optimizer
state off memory, step() decides and returns while a worker thread updates the units in the
next forward's order, each released to the forward once updated. On a CPU model, the 'cpu'
tier (its mover a memcpy) and the 'nvme' tier must give the in-memory run's bits, losses,
masters and moments, at stages 1-3, W = 1 and 2, with clipping that bites, gradient
accumulation 2, a model whose units have odd, different sizes, and (fp16) a step whose
gradients overflow, which must update no unit. The ordering: with the engine's hook that holds
the last unit's update open until the forward's first wait, the forward starts (waits for its
first unit) while units are still to be done, in both tiers, the nvme file streamed in the
forward's order (overlap_worker.py records what it saw)."""
import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from zerort._testing.launch import launch  # noqa: E402

# grad_on_device: both tiers keep the FP32 gradient with the model (C++ Note [gradient on the device])
CASES = [{"name": "s1", "stage": 1, "precision": "bf16", "hold": True, "grad_on_device": True},
         {"name": "s1-fp16", "stage": 1, "precision": "fp16"},
         {"name": "s2", "stage": 2, "precision": "bf16", "hold": True},
         {"name": "s2-fp16", "stage": 2, "precision": "fp16", "ram": 1.0},  # the nvme records all in RAM
         {"name": "s3", "stage": 3, "precision": "bf16", "hold": True},
         {"name": "s3-fp16", "stage": 3, "precision": "fp16", "grad_on_device": True}]
OVERFLOW_STEP = 2  # overlap_worker's


def run(tmp_path, world, device="cpu", cases=CASES):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    with open(tmp_path / "cases.json", "w") as f:
        json.dump(cases, f)
    launcher = "alone" if world == 1 else "torchrun"
    launch(launcher, world, os.path.join(HERE, "overlap_worker.py"), tmp_path / "out", nvme, tmp_path / "cases.json",
           device, timeout=600)
    with open(tmp_path / "out.json") as f:
        return json.load(f), torch.load(tmp_path / "out.pt")


def check_bits(result, tensors, cases):
    for case in cases:
        name = case["name"]
        ram = result[f"{name}:none"]
        assert ram["tier"] == "memory" and not ram["overlapped"], ram
        for tier in ("cpu", "nvme"):
            off = result[f"{name}:{tier}"]
            assert off["tier"] == tier and off["overlapped"], (name, tier, off)
            assert (off["ram_bytes"] > 0) == (tier == "nvme" and "ram" in case), (name, tier, off["ram_bytes"])
            assert off["gradient_on_device"] == case.get("grad_on_device", False), (name, tier)
            assert off["losses"] == ram["losses"], (name, tier)
            mine, theirs = tensors[f"{name}:{tier}"], tensors[f"{name}:none"]
            assert mine.keys() == theirs.keys()
            differ = [k for k in mine if not torch.equal(mine[k], theirs[k])]
            assert not differ, (name, tier, differ)
            assert off["skipped"] == ram["skipped"], (name, tier)
            if case["precision"] == "fp16":  # the overflow step: skipped, and no unit changed
                assert off["skipped"][OVERFLOW_STEP] and off["skipped"].count(True) == 1, off["skipped"]
                assert off["skipped_unchanged"] is True, (name, tier)
            # One figure per applied-or-skipped boundary: what the forward waited for the update.
            assert len(off["wait_ms"]) == len(off["skipped"]) and all(w >= 0 for w in off["wait_ms"])


def check_order(result, cases):
    for case in cases:
        if not case.get("hold"):
            continue
        for tier in ("cpu", "nvme"):
            reports = result[f"{case['name']}:{tier}"]["reports"]
            assert reports, (case, tier)
            for r in reports:  # the forward's first wait came while the last unit was still to be done
                assert r["first_wait_seen"] and not r["hold_timed_out"], (case["name"], tier, r)
                assert r["done_at_first_wait"] < r["units"], (case["name"], tier, r)


@pytest.mark.parametrize("world", [1, 2])
def test_overlapped_step_equals_memory_run_bitwise(tmp_path, world):
    result, tensors = run(tmp_path, world)
    check_bits(result, tensors, CASES)
    check_order(result, CASES)


def test_overlap_step_off_keeps_the_step_whole(tmp_path):
    """offload_optimizer.overlap_step false: the 'nvme' tier updates inside step(), the report
    stays empty, the bits are the same."""
    import zerort
    from overlap_worker import Stack

    model = Stack()
    engine = zerort.initialize(model=model, config={
        "stage": 2, "precision": "bf16", "offload": {"optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path), "overlap_step": False}}})
    assert not engine.runtime.overlaps_step
    x = torch.randn(3, 13)
    engine.backward(engine(x).float().pow(2).mean())
    s = engine.step()
    assert "update_wait_ms" not in s and engine.runtime.overlap_report["units"] == 0
    engine.destroy()


def test_update_order_is_checked():
    import zerort
    from overlap_worker import Stack

    offload = {"optimizer": {"device": "cpu", "overlap_step": True}}  # a CPU model's cpu tier overlaps when asked
    engine = zerort.initialize(model=Stack(), config={"stage": 3, "precision": "bf16", "offload": offload})
    impl = engine.runtime
    assert impl.overlaps_step and impl.update_order[:3] == [0, 1, 2]  # stage 3: the units' forward order
    impl.set_update_order([2, 0])
    assert impl.update_order[:2] == [2, 0] and sorted(impl.update_order) == list(range(impl.num_buckets))
    with pytest.raises(zerort.errors.Error, match="named twice"):
        impl.set_update_order([1, 1])
    engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("grad_on_device", [False, True])
def test_the_cpu_tier_of_a_cpu_model_is_counted_to_the_byte(stage, grad_on_device):
    """overlap_step true runs a CPU model's offload cpu as the Engine's 'cpu' tier (Note [state tiers]):
    its master and moments in host memory and the reduces' FP32 scratch beside the gradient; with
    gradient_on_device no scratch, and the host piece the gradient goes down through (C++ Note [gradient on
    the device]). The memory report counts each (the engine's counters) and the estimate agrees to the
    byte, allocator included."""
    import zerort

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(5)])
    offload = {"optimizer": {"device": "cpu", "overlap_step": True, "gradient_on_device": grad_on_device,
                             "chunk_numel": 3000}}
    engine = zerort.initialize(model=model, config={"stage": stage, "precision": "bf16", "offload": offload,
                                                    "reduce_bucket_numel": 20_000})
    stats = engine.runtime.state_tier_stats
    assert stats["tier"] == "cpu" and stats["gradient_on_device"] == grad_on_device
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 96)).float().pow(2).mean())
        engine.step()
    report = engine.memory_report()
    for k in ("lp_params", "master", "adam_m", "adam_v", "grad_shard", "state_pool"):
        assert report.measured[k] == report.estimate[k], (k, report.measured[k], report.estimate[k])
        assert (report.measured[k] > 0) == (k != "state_pool" or grad_on_device), k
    numel = sum(p.numel() for p in model.parameters())  # W = 1: the shard is the model, padded
    assert report.measured["state_pool"] == (4 * 3000 if grad_on_device else 0)
    assert report.measured["grad_shard"] >= 4 * numel
    held = report.allocator["held"]
    assert held["measured"] == held["estimate"], held
    if grad_on_device:
        assert "the host piece a gradient on the device goes down" in report.table()
    engine.destroy()
