"""The offload tiers on a CUDA model (W = 1, NCCL): offload_optimizer "cpu" and "nvme" (stage 3:
with offload_param "nvme" too) step on the CPU's cores, overlapped with the next forward unit by
unit (C++ Note [overlapped step]), and must equal the GPU-resident run bit for bit at stages 1-3,
with clipping that bites, gradient accumulation 2, odd unit sizes and (fp16) a skipped overflow
step that updates no unit (tests/python/overlap_worker.py with "cuda"; its CPU twin is
tests/python/test_offload_overlap.py)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from test_offload_overlap import CASES, check_bits, check_order, run  # noqa: E402


def test_cpu_and_nvme_tiers_on_a_gpu_equal_the_gpu_resident_run_bitwise(tmp_path):
    result, tensors = run(tmp_path, 1, device="cuda")
    for case in CASES:
        for tier in ("none", "cpu", "nvme"):
            r = result[f"{case['name']}:{tier}"]
            print(f"[gpu offload overlap {case['name']} {tier}] losses {r['losses'][:2]}... waited ms "
                  f"{[round(w, 2) for w in r['wait_ms']]}")
    check_bits(result, tensors, CASES)
    check_order(result, CASES)
