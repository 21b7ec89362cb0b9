"""The shared-memory transport (C++ comm/shm/, comm.intra_node 'shm') in real processes on
one host, against gloo's TCP path (comm.intra_node 'backend'):

- the engine at stages 1, 2 and 3 (and hybrid groups of 2 at W = 4, whose rows go through
  shm while their columns stay gloo) gives the same losses and the same bits of every
  parameter and FP32 master after a few steps;
- a rank killed with SIGKILL mid-run: the others fail within seconds with an error naming it,
  and /dev/shm holds nothing of the job's segment (its name is unlinked at creation);
- a rank that never calls: the caller's CommTimeoutError at comm.timeout_s names the
  collective and the rank that did not arrive."""
import json
import os

import pytest
import torch

from zerort._testing.launch import launch, launch_plain

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shm_transport_worker.py")
CASES = {2: ["gpt2:1:bf16:1:3", "gpt2:2:bf16:1:3", "gpt2:3:bf16:1:3"],
         4: ["gpt2:1:bf16:1:3", "gpt2:2:bf16:2:2", "gpt2:3:bf16:1:3", "gpt2:2:bf16:1:3:shard@2"]}


def zerort_segments():
    return {f for f in os.listdir("/dev/shm") if f.startswith("zerort-shm-")}


def run_parity(world, intra, tmp_path):
    prefix = str(tmp_path / intra)
    launch("torchrun", world, WORKER, "parity", prefix, intra, *CASES[world], timeout=600)
    return torch.load(f"{prefix}.rank0.pt", weights_only=False)


@pytest.mark.parametrize("world", [2, 4])
def test_the_same_bits_as_gloo_at_every_stage(world, tmp_path):
    shm, tcp = run_parity(world, "shm", tmp_path), run_parity(world, "backend", tmp_path)
    assert shm.pop("backend") == "shm" and tcp.pop("backend") == "gloo"
    for case in CASES[world]:
        a, b = shm[case], tcp[case]
        assert a["losses"] == b["losses"], case
        for key in ("params", "master"):
            assert a[key].keys() == b[key].keys(), case
            for name in a[key]:
                assert torch.equal(a[key][name].view(torch.uint8), b[key][name].view(torch.uint8)), (case, key, name)


@pytest.mark.parametrize("world", [2, 4])
def test_a_killed_rank_is_named_within_seconds_and_nothing_is_left(world, tmp_path):
    before = zerort_segments()
    prefix = str(tmp_path / "kill")
    ranks = launch_plain(world, WORKER, "kill", prefix, timeout=120)
    assert ranks[1].returncode == -9, ranks[1].stdout
    results = []
    for r in [0, *range(2, world)]:
        with open(f"{prefix}.rank{r}.json") as f:
            results.append(json.load(f))
    for res in results:
        assert res["backend"] == "shm", res
        e = res["error"]
        assert e is not None and e["type"] == "CommError", res
        assert "rank 1 (pid " in e["message"] and "exited during all_reduce(count=262144" in e["message"], e
        assert res["seconds"] < 10, res  # not comm.timeout_s (600 s)
    # The job's segment was named after rank 0's pid; other jobs' segments live for moments only.
    left = {f for f in zerort_segments() - before if f.startswith(f"zerort-shm-{results[0]['pid']}-")}
    assert not left, left


def test_a_rank_that_never_calls_times_out_naming_the_call(tmp_path):
    prefix = str(tmp_path / "silent")
    launch("torchrun", 2, WORKER, "silent", prefix, timeout=120)
    with open(f"{prefix}.rank0.json") as f:
        res = json.load(f)
    e = res["error"]
    assert e is not None and e["type"] == "CommTimeoutError", res
    assert "all_reduce(count=262144, dtype=f32, op=sum) on rank 0 of 2 [shm] did not finish within 3000 ms: " \
           "rank 1 (pid " in e["message"], e
    assert 2.5 < res["seconds"] < 6, res
