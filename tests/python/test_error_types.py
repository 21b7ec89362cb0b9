"""Each misuse ends with the zerort error of its kind, naming what to change (issue 27, item 4):
a parameter zerort cannot train, a model wrapped twice, deepspeed.initialize's arguments
given to zerort.initialize, and load_checkpoint on something that is not a checkpoint
directory. One process, W = 1."""
import os

import pytest
import torch
import torch.nn as nn

import zerort

CFG = {"stage": 2, "precision": "bf16"}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_a_parameter_of_another_dtype_is_a_device_error_naming_it(dtype):
    m = model()
    m[2].weight = nn.Parameter(m[2].weight.detach().to(dtype), requires_grad=dtype.is_floating_point)
    with pytest.raises(zerort.DeviceError) as e:
        zerort.initialize(m, CFG)
    assert f"parameter '2.weight' is {dtype}" in str(e.value) and "register_buffer" in str(e.value)


def test_wrapping_a_model_twice_says_so_and_destroy_makes_it_possible():
    m = model()
    first = zerort.initialize(m, CFG)
    with pytest.raises(zerort.UsageError) as e:
        zerort.initialize(m, CFG)
    msg = str(e.value)
    assert "already wrapped by a live zerort engine" in msg and "torch.bfloat16 views" in msg, msg
    assert "destroy()" in msg
    first.destroy()
    second = zerort.initialize(m, CFG)
    second.backward(second(torch.randn(3, 4)).pow(2).mean())
    second.step()
    assert second.global_step == 1


@pytest.mark.parametrize("kwargs", [{"model_parameters": "params"}, {"args": None, "optimizer": None}, {}])
def test_deepspeed_arguments_point_to_the_deepspeed_integration(kwargs):
    m = model()
    if "model_parameters" in kwargs:
        kwargs = {"model": m, "model_parameters": m.parameters(), "config": CFG}
    with pytest.raises(zerort.UsageError) as e:
        zerort.initialize(**kwargs)
    msg = str(e.value)
    assert "zerort.integrations.deepspeed.initialize" in msg, msg
    named = sorted(k for k in kwargs if k not in ("model", "config")) or ["no model"]
    assert f"got {', '.join(named)};" in msg, msg


@pytest.fixture
def engine():
    e = zerort.initialize(model(), CFG)
    yield e
    e.destroy()


def test_load_checkpoint_of_a_file_is_a_checkpoint_error(engine, tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(zerort.CheckpointError) as e:
        engine.load_checkpoint(str(path))
    assert repr(str(path)) in str(e.value) and "this path is not a directory" in str(e.value)


def test_load_checkpoint_of_a_directory_of_other_things_is_a_checkpoint_error(engine, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model").mkdir()
    with pytest.raises(zerort.CheckpointError) as e:
        engine.load_checkpoint(str(tmp_path))
    assert "holds neither a 'latest' file nor a checkpoint folder" in str(e.value)


def test_load_checkpoint_where_nothing_was_saved_yet_loads_nothing(engine, tmp_path, capsys):
    """DeepSpeed's (None, None): no such path, an empty directory, or checkpoints saved
    without `latest` (the tag must then be named)."""
    assert engine.load_checkpoint(str(tmp_path / "not-yet")) == (None, None)
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    engine.save_checkpoint(str(tmp_path), tag="mine", save_latest=False)
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    assert "no 'latest' file there, nothing loaded" in capsys.readouterr().out
    path, _ = engine.load_checkpoint(str(tmp_path), tag="mine")
    assert path == os.path.join(str(tmp_path), "mine")


@pytest.mark.parametrize("key,value,fp32", [("eps", 1e-46, "0"), ("eps", 1e-40, "subnormal"), ("lr", 1e39, "inf"),
                                            ("weight_decay", 1e39, "inf")])
def test_param_group_values_are_checked_as_the_fp32_the_engine_uses(key, value, fp32):
    """A param group's values (a torch optimizer's, or param_groups=) pass the same FP32
    rule as the config's: eps 1e-46 was 0 in FP32 and wrote NaN into the master."""
    m = model()
    with pytest.raises(zerort.ConfigError) as e:
        zerort.initialize(m, CFG, param_groups=[{"params": list(m.parameters()), key: value}])
    assert f"param_groups[0]['{key}'] = {value!r}, which is {fp32} in FP32" in str(e.value), str(e.value)


@pytest.mark.parametrize("cfg", [{"stage": 3, "stage3": {"prefetch": 65536, "persistence_threshold": 0}},
                                 {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7,
                                                        "stage3_param_persistence_threshold": 0}}])
def test_prefetch_is_never_more_than_the_units_that_follow(cfg):
    """A prefetch past the model's units (DeepSpeed's 5e7-element bucket over small units
    counts millions) is the units after the first: the hooks walk that many per unit."""
    m = model()
    engine = zerort.initialize(m, cfg)
    try:
        units = engine._impl.num_buckets
        assert units >= 2 and engine.config.stage3.prefetch == units - 1, (units, engine.config.stage3.prefetch)
        engine.backward(engine(torch.randn(3, 4)).pow(2).mean())
        engine.step()
    finally:
        engine.destroy()


def test_zerort_raises_only_its_own_error_types():
    """Every failure zerort's Python raises on purpose is a zerort.errors type (ConfigError
    is also a ValueError, DeviceError a TypeError, the rest RuntimeErrors): no bare
    builtin exception, so `except zerort.Error` catches them all. (AttributeError stays
    where __getattr__ must raise it: hasattr() and the import system rely on it.)"""
    import re

    root = os.path.dirname(zerort.__file__)
    bare = re.compile(r"\braise (ValueError|TypeError|RuntimeError|KeyError|IndexError)\(")
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py") and "_testing" not in folder:
                path = os.path.join(folder, name)
                with open(path) as f:
                    found += [f"{os.path.relpath(path, root)}:{i}" for i, line in enumerate(f, 1) if bare.search(line)]
    assert not found, found
