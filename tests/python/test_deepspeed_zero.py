"""deepspeed.zero.Init and deepspeed.zero.GatheredParameters under zerort.integrations.deepspeed, at
stages 1 and 3, W = 2 under torchrun (zero_worker.py), with a HuggingFace GPT-2."""
import math
import os

import pytest
import torch

from zerort._testing.launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))
W = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("zero") / "out")
    launch("torchrun", W, os.path.join(HERE, "zero_worker.py"), out, timeout=300)
    return [torch.load(f"{out}.rank{r}.pt") for r in range(W)]


@pytest.mark.parametrize("stage", [1, 3])
def test_init_builds_on_meta_and_gathered_parameters_reads_and_writes(ranks, stage):
    for rank, results in enumerate(ranks):
        r = results[stage]
        assert r["meta"] and r["buffers_real"], (rank, stage)
        assert r["gathered_shape"] == (32, 128) and r["gathered_equals_master"], (rank, stage)
        # Rank 0's change inside GatheredParameters(modifier_rank=0) is every rank's master.
        assert r["c_fc_master"] == [0.25] and r["ln_f_master"] == [2.0], (rank, stage)
        assert math.isfinite(r["loss"])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_zero_init_gives_the_plain_builds_weights_bit_for_bit(world, tmp_path):
    out = str(tmp_path / "out")
    launch("torchrun", world, os.path.join(HERE, "zero_init_worker.py"), out, timeout=300)
    for rank in range(world):
        results = torch.load(f"{out}.rank{rank}.pt")
        assert len(results) == 4
        for (model, stage), r in results.items():
            assert r["keys"] and r["differ"] == [] and r["rng_after"], (rank, model, stage, r)


def test_zero_init_builds_in_the_configs_dtype_as_deepspeed_does(tmp_path):
    """zero_init_dtype_worker.py at W = 2: under a bf16 (fp16) config the gathered FP32 master is
    the same code's build with torch's constructors in bf16 (fp16), bit for bit, replayed rather
    than copied (but torch.Tensor(sizes), whose maker the recording does not see), and the random
    stream after construction is that build's. GPT-2's is the FP32 build's too; trunc_normal_
    draws differently in half precision (torch's own kernels), so the other model's is not."""
    out = str(tmp_path / "out")
    launch("torchrun", W, os.path.join(HERE, "zero_init_dtype_worker.py"), out, timeout=300)
    for rank in range(W):
        results = torch.load(f"{out}.rank{rank}.pt")
        assert len(results) == 2 * 2 * 2
        for (model, key, stage), r in results.items():
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[key]
            case = (rank, model, key, stage, r)
            assert r["reference_dtypes"] == {dtype} and r["built_dtypes"] == {dtype}, case
            assert r["reference_differs_from_fp32"], case  # else the comparison below could not fail
            assert r["keys"] and r["differ"] == [] and r["rng_after"], case
            assert r["copied"] == (["legacy"] if model == "Typed" else []), case
            assert r["rng_as_fp32"] == (model == "gpt2"), case


def test_the_build_dtype_follows_deepspeeds_rules(tmp_path, monkeypatch):
    import json

    import zerort.integrations.deepspeed as deepspeed
    from zerort.integrations.deepspeed.accelerator import get_accelerator
    from zerort.integrations.deepspeed.zero import build_dtype

    bf16, fp16 = {"bf16": {"enabled": True}}, {"fp16": {"enabled": True}}
    assert build_dtype(config_dict_or_path=bf16) == torch.bfloat16
    assert build_dtype(config_dict_or_path={"bfloat16": {"enabled": True}}) == torch.bfloat16  # the old name
    assert build_dtype(config_dict_or_path=fp16) == torch.float16
    assert build_dtype(config_dict_or_path={"zero_optimization": {"stage": 3}}) == torch.float32
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(bf16))
    assert build_dtype(config_dict_or_path=str(path)) == torch.bfloat16
    assert build_dtype(config_dict_or_path=fp16, config=str(path)) == torch.bfloat16  # config= replaces it
    assert build_dtype(dtype=torch.float32, config_dict_or_path=bf16) == torch.float32  # dtype= wins
    with pytest.raises(ValueError, match="bf16.enabled and fp16.enabled"):
        build_dtype(config_dict_or_path={**bf16, **fp16})
    with pytest.raises(ValueError, match="dtype=torch.int64"):
        build_dtype(dtype=torch.int64)
    # No config: a given dtype, else DeepSpeed's default, fp16 where the accelerator takes it, else bf16.
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    assert build_dtype() == torch.float16 and build_dtype(dtype=torch.bfloat16) == torch.bfloat16
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)
    assert build_dtype() == torch.bfloat16
    assert build_dtype(dtype=torch.float32) == torch.float32  # DeepSpeed's precedence drops it here; zerort keeps it
    assert build_dtype(config_dict_or_path=fp16) == torch.float16
    monkeypatch.undo()

    empty, new = torch.empty, torch.Tensor.__dict__.get("__new__")
    with deepspeed.zero.Init(config_dict_or_path=bf16, enabled=False):  # changes nothing
        assert torch.empty is empty and torch.nn.Linear(2, 2).weight.dtype == torch.float32
    with deepspeed.zero.Init(config_dict_or_path=bf16):
        layer = torch.nn.Linear(2, 2)
        assert torch.zeros(2, dtype=torch.float64).dtype == torch.bfloat16  # any floating dtype, as DeepSpeed's
        assert torch.arange(3).dtype == torch.int64 and torch.Tensor(2).dtype == torch.bfloat16
    assert layer.weight.is_meta and layer.weight.dtype == torch.bfloat16
    assert torch.empty is empty and torch.Tensor.__dict__.get("__new__") is new
    assert torch.Tensor(2).dtype == torch.float32


def test_init_refuses_what_zerort_does_not_do():
    import zerort.integrations.deepspeed as deepspeed

    with pytest.raises(ValueError, match="no parameter offload"):
        deepspeed.zero.Init(remote_device="cpu")
    with pytest.raises(ValueError, match="cannot partition a model built already"):
        deepspeed.zero.Init(module=torch.nn.Linear(2, 2))
    with deepspeed.zero.Init(enabled=False):
        assert not torch.nn.Linear(2, 2).weight.is_meta
    with deepspeed.zero.Init():
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.is_meta and not torch.nn.Linear(2, 2).weight.is_meta  # restored on exit
    assert torch.nn.init.orthogonal_.__module__ == "torch.nn.init"  # the recording patches are gone too

    class Copies(torch.nn.Module):  # values copied between parameters: cannot be replayed one by one
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
            with torch.no_grad():
                self.b.weight.copy_(self.a.weight)

    from zerort.errors import UsageError

    with pytest.raises(UsageError, match="writes values computed from another parameter"):
        with deepspeed.zero.Init():
            Copies()
    with deepspeed.zero.Init():
        unwrapped = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 1))
    with pytest.raises(UsageError, match="Linear was built under deepspeed.zero.Init and has not been given to "
                                         "deepspeed.initialize"):
        unwrapped(torch.rand(1, 2))
    with pytest.raises(UsageError, match="generator= of its own"):
        with deepspeed.zero.Init():
            torch.nn.init.normal_(torch.nn.Linear(2, 2).weight, generator=torch.Generator())


def test_gathered_parameters_before_initialize_reads_and_keeps_writes():
    """transformers' ZeRO-3 loading: GatheredParameters(modifier_rank=0) on parameters built under zero.Init,
    before any engine: inside they hold their values (the recorded init), what the block writes is theirs
    after it (initialize makes it the master), and a tied weight stays tied."""
    import transformers

    import zerort.integrations.deepspeed as deepspeed
    from zerort.errors import UsageError

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=8)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(cfg)
    torch.manual_seed(0)
    with deepspeed.zero.Init(dtype=torch.float32):  # the plain build's dtype
        model = transformers.GPT2LMHeadModel(cfg)
    wte, ln = model.transformer.wte.weight, model.transformer.ln_f.weight
    with deepspeed.zero.GatheredParameters({wte, ln}, modifier_rank=None):  # a set: any order
        assert torch.equal(model.transformer.wte.weight, plain.transformer.wte.weight)
        model.transformer.ln_f.weight.data.fill_(3.0)  # modifier_rank None: dropped
    assert wte.is_meta and model.lm_head.weight is wte
    with deepspeed.zero.GatheredParameters([wte], modifier_rank=0):
        model.transformer.wte.weight.data[0].fill_(7.0)
    engine, *_ = deepspeed.initialize(model=model, config={"zero_optimization": {"stage": 3},
                                                           "optimizer": {"type": "AdamW"},
                                                           "zerort": {"comm": {"backend": "inprocess"}}})
    master = engine.full_state_dict(master=True)
    assert torch.equal(master["transformer.wte.weight"][0], torch.full((32,), 7.0))
    assert torch.equal(master["transformer.wte.weight"][1:], plain.transformer.wte.weight[1:])
    assert torch.equal(master["transformer.ln_f.weight"], plain.transformer.ln_f.weight)
    engine.destroy()
    stray = torch.nn.Embedding(4, 2, device="meta")  # made "like" a zero.Init parameter: no values anywhere
    with pytest.raises(UsageError, match=r"shapes \[\(4, 2\)\] are on the meta device but were not built"):
        with deepspeed.zero.GatheredParameters([stray.weight], modifier_rank=0):
            pass
