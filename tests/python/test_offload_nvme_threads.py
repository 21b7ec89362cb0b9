"""The NVMe tier on its portable I/O backend (C++ Note [IoQueue backends], io/io_backend.h): a
pool of threads doing O_DIRECT pread/pwrite, forced with ZERORT_IO_BACKEND=threads, gives the
bits of the io_uring run: nvme_offload_worker.py at W = 2, with the optimizer states, the FP32
gradient and stage 3's parameters on NVMe, run once on each backend (the worker's checkpoints
between the tiers too). Each run is also equal to
the memory tier, and rank 0's banner names the backend. Where io_uring is not built or not
allowed, "auto" is threads too: the run against the memory tier still counts, and the test
then says it skipped the comparison with io_uring.
"""
import os
import sys

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_offload_nvme import run, same  # noqa: E402

# One case reaches every file and request of the tier: master, m and v, the FP32 gradient in the
# file (reads and writes by the reduces), stage 3's parameter shards (read by the gathers).
CASES = [{"name": "gpt2-s3", "model": "gpt2", "stage": 3, "state_dtype": "bf16", "params": True, "grads": True}]


def test_the_thread_backend_gives_io_urings_bits(tmp_path):
    runs = {}
    for backend in ("auto", "threads"):
        (tmp_path / backend).mkdir()
        runs[backend] = run(tmp_path / backend, 2, CASES, env={"ZERORT_IO_BACKEND": backend})
    auto, auto_tensors, _, auto_launch = runs["auto"]
    threads, tensors, _, launched = runs["threads"]
    for case in CASES:
        name = case["name"]
        disk = threads[f"{name}:nvme"]
        files = [disk["stats"], disk["param_stats"]]
        assert disk["stats"]["gradient_bytes"] > 0 and disk["param_stats"]["tier"] == "nvme", files
        assert all(s["io_backend"] == "threads" and s["io_backend_why"] == "ZERORT_IO_BACKEND=threads"
                   for s in files), files
        assert disk["losses"] == threads[f"{name}:none"]["losses"], name
        assert same(tensors[f"{name}:nvme"], tensors[f"{name}:none"]), name
        for key in (f"{name}:nvme", f"{name}:nvme->none", f"{name}:none->nvme"):
            assert threads[key]["losses"] == auto[key]["losses"], key
            assert same(tensors[key], auto_tensors[key]), key
    assert "NVMe I/O through threads (ZERORT_IO_BACKEND=threads)" in launched.output, launched.output[-2000:]
    other = auto[f"{CASES[0]['name']}:nvme"]["stats"]
    assert f"NVMe I/O through {other['io_backend']}" in auto_launch.output, auto_launch.output[-2000:]
    if other["io_backend"] != "io_uring":
        pytest.skip(f"io_uring is not available here ({other['io_backend_why']}): the thread backend was checked "
                    "against the memory tier only")
