"""Stream order on a GPU (C++ Note [stream order], comm/stream_order.h), stages 0-3, W = 1 over
NCCL and W = 2 staged over mpi (both ranks on one GPU); the worker is gpu_stream_worker.py.

Note [allowed syncs in a step]
One steady-state step (forward, backward, step) runs under torch's sync debug mode "error", so
any synchronizing torch call in it (an .item(), a blocking copy) fails the test. The engine's
own host waits are counted by reason (Note [allowed host waits]); a step allows exactly:
- step_decision: 1, the unscale pass's non-finite count and squared norm read by the host (one
  pass over the whole FP32 gradient); over NCCL at W > 1 one more, the decision's exchange;
- user_call: 0 (no state dict, checkpoint or GatheredParameters in a step);
- staged_copy: 0 over NCCL; staged, at most 3 per collective the engine hands to the backend
  (the input down, an accumulated FP32 shard down and back up: comm/staged_communicator.cpp).
At W = 1 the engine hands no collective to the backend at all (Note [W = 1 is local]). Not
measured here (one GPU holds one NCCL rank): stage 3 at W > 1 checks each collective across the
ranks first (Note [checked calls], comm/communicator.h), one small exchange the host waits for.
"""
import os

import pytest
import torch

from zerort._testing.launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "gpu_stream_worker.py")


def run(tmp_path, mode, world=1):
    import zerort

    out = str(tmp_path / mode)
    if world == 1:
        p = launch("alone", 1, WORKER, out, mode, timeout=300, env={"PYTHONFAULTHANDLER": "1"})
        assert "GPU STREAM WORKER OK" in p.stdout
    else:
        if not zerort._C.with_mpi:
            pytest.skip("this build has no MPI; the staged W = 2 case runs under mpirun")
        launch("mpirun", world, WORKER, out, "--staged", mode, timeout=300)
    return [torch.load(f"{out}.rank{r}.pt") for r in range(world)]


def test_w1_step_has_only_the_allowed_host_waits(tmp_path):
    (ranks,) = run(tmp_path, "syncs")
    for stage, r in ranks.items():
        assert r["local_only"], stage
        assert r["skipped"] == 0, stage
        assert r["backend_calls"] == 0, (stage, r)  # Note [W = 1 is local]
        assert r["host_waits"] == {"step_decision": 1, "user_call": 0, "staged_copy": 0}, (stage, r)


def test_staged_w2_step_has_only_the_allowed_host_waits(tmp_path):
    ranks = run(tmp_path, "syncs", world=2)
    for rank in ranks:
        for stage, r in rank.items():
            assert not r["local_only"], stage
            waits = r["host_waits"]
            assert waits["step_decision"] == 1 and waits["user_call"] == 0, (stage, r)
            assert 0 < waits["staged_copy"] <= 3 * r["backend_calls"], (stage, r)


def same_bits(result):
    ref = result["default"]
    for run, what in (("again", "the default stream twice: kernels not deterministic, so the side run proves "
                                "nothing"), ("side", "the side stream's run differs from the default stream's")):
        other = result[run]
        assert other["losses"] == ref["losses"], (what, ref["losses"], other["losses"])
        for k in ref["master"]:
            assert torch.equal(other["master"][k], ref["master"][k]), (what, k)


def test_w1_model_on_a_side_stream_gives_the_default_streams_bits(tmp_path):
    (ranks,) = run(tmp_path, "side")
    for stage, result in ranks.items():
        print(f"stage {stage}: losses {result['side']['losses']}")
        same_bits(result)


def test_staged_w2_model_on_a_side_stream_gives_the_default_streams_bits(tmp_path):
    for rank in run(tmp_path, "side", world=2):
        for result in rank.values():
            same_bits(result)
