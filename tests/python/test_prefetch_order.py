"""Stage 3 prefetches in the order the forward ran the units, not the order they were
registered (issue 28 item 5, Note [recorded unit order] in zerort.engine.stage3).

The model (prefetch_order_worker.py) registers its three Linear layers as [c, a, b], so its
Engine units are c = 0, a = 1, b = 2, and calls them a, b, c. Trained under mpirun at W = 2
for 3 steps at stage 0 and at stage 3 with prefetch 1, on the same data:
- the stage-3 parameters equal the stage-0 ones bitwise (no clipping: the stages agree to the
  bit, as test_engine_parity's test_stages_0_1_2_3_bitwise_without_clipping);
- the recorded order is the call order, [1, 2, 0];
- from the second step on (the first forward is the one that records), each forward
  prefetches the unit after the running one in call order (a -> b, b -> c) and each
  backward the one before it (c -> b, b -> a): registration order would have prefetched
  c -> a and a -> b in the forward.
"""
import os

import pytest
import torch

import zerort
from zerort._testing.launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "prefetch_order_worker.py")
A, B, C = 1, 2, 0  # Engine unit of each layer: registration order c, a, b


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not zerort._C.with_mpi:
        pytest.skip("this build has no MPI; the test runs under mpirun")
    prefix = str(tmp_path_factory.mktemp("prefetch_order") / "out")
    launch("mpirun", 2, WORKER, prefix, timeout=300)
    return [torch.load(f"{prefix}.rank{r}.pt") for r in range(2)]


def test_stage3_with_the_recorded_order_equals_stage0_bitwise(ranks):
    for r in ranks:
        zero, three = r["0"]["params"], r["3"]["params"]
        assert zero.keys() == three.keys()
        for k in zero:
            assert torch.equal(zero[k], three[k]), k


def test_prefetch_follows_the_call_order(ranks):
    for r in ranks:
        s3 = r["3"]
        assert s3["units"] == 3
        assert s3["order"] == [A, B, C]
        for asked in s3["asked"][1:]:
            assert [u for phase, u in asked if phase == "forward"] == [B, C]
            assert [u for phase, u in asked if phase == "backward"] == [B, A]
