"""initialize() never moves torch's global random stream (rng_worker.py, torchrun, W = 2).

A script that draws its data with torch.randn after initialize() must train on the data it
draws without zerort: DeepSpeed's FrozenWeights test at stage 3 under zero.Init did not,
because the meta build drew the model's seed from the stream. Every stage, every way of
building (plain, deepspeed.zero.Init, torch.device("meta")) and both entries are checked."""
import os

import pytest
import torch

from zerort._testing.launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))
W = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rng") / "out")
    launch("torchrun", W, os.path.join(HERE, "rng_worker.py"), out, timeout=300)
    return [torch.load(f"{out}.rank{r}.pt") for r in range(W)]


def test_initialize_leaves_the_random_state_and_the_next_draws_alone(ranks):
    for rank, results in enumerate(ranks):
        # 2 models x (plain: 4 stages x 2 entries, zero.Init and meta: stages 0-3 by deepspeed + 3 by zerort)
        assert len(results) == 2 * (8 + 5 + 5), rank
        moved = {case: r for case, r in results.items() if not (r["unchanged"] and r["same_data"])}
        assert moved == {}, (rank, moved)


def test_the_meta_build_still_follows_the_seed(tmp_path):
    """The model's seed comes from the random state without drawing from it: the same seed
    gives the same meta-built model, another seed another one."""
    from zerort.engine.meta_init import _seed_of_random_state

    torch.manual_seed(3)
    a = _seed_of_random_state()
    assert _seed_of_random_state() == a  # reading it twice gives the same seed
    torch.manual_seed(3)
    assert _seed_of_random_state() == a
    torch.manual_seed(4)
    assert _seed_of_random_state() != a
    assert 0 <= a < 2 ** 62
