"""The waits of overlap_param_gather at W = 2 (tests/python/test_overlap_gather.py): run under
torchrun as `overlap_waits_worker.py STAGE`; every rank checks, after step(), which buckets'
parameter all-gathers are in flight and which the forward, state_dict() and
gathered_parameters() wait for, and exits 0. (At W = 1 nothing is gathered: C++ Note
[W = 1 is local].)"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from engine_models import CONFIG, batch, loss_fn, make_model  # noqa: E402

import zerort  # noqa: E402


def train_step(engine, step):
    x, y = batch("gpt2", step, engine.comm.rank, 0)
    engine.backward(loss_fn("gpt2", engine(x), y))
    engine.step()
    return x


def main(stage):
    cfg = dict(CONFIG, stage=stage, precision="bf16", reduce_bucket_numel=1999, overlap_param_gather=True)
    engine = zerort.initialize(make_model("gpt2"), cfg)
    impl = engine.runtime
    x = train_step(engine, 0)
    everything = list(range(impl.num_buckets))
    assert impl.param_gathers_in_flight == everything, impl.param_gathers_in_flight  # in bucket order, none waited
    wte = engine.module.transformer.wte
    own = {impl.bucket_of(0, engine.param_index.groups[0].index(wte.weight))}
    assert len(everything) > 2 and len(own) == 1
    wte(x)  # the embedding alone: its own bucket's gather, no other
    assert impl.param_gathers_in_flight == [b for b in everything if b not in own], impl.param_gathers_in_flight
    engine(x)  # the whole forward: the rest
    assert impl.param_gathers_in_flight == []
    train_step(engine, 1)
    assert impl.param_gathers_in_flight == everything
    engine.module.state_dict()  # every module's state_dict() waits for its buckets
    assert impl.param_gathers_in_flight == []
    train_step(engine, 2)
    with engine.gathered_parameters():
        assert impl.param_gathers_in_flight == []
    engine.destroy()
    print(f"rank {zerort.detect_launch_env()['rank']}: the waits hold at stage {stage}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
