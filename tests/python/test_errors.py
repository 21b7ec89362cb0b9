"""One exception type per kind of failure, the same class whether C++ or Python raised it
(zerort.errors; core/error.h; the translator in python/bindings.cpp)."""
import pytest
import torch

import zerort
from zerort import _C, errors
from zerort.comm.tensor_args import buffer

KINDS = ("Error", "UsageError", "DeviceError", "ConfigError", "LossScaleError", "CommError", "CommTimeoutError",
         "CollectiveMismatchError")


@pytest.mark.parametrize("name", KINDS)
def test_the_binding_raises_the_python_class_itself(name):
    assert getattr(_C, name) is getattr(errors, name) is getattr(zerort, name)
    assert issubclass(getattr(errors, name), errors.Error)


def test_the_families():
    assert issubclass(errors.CommTimeoutError, errors.CommError) and issubclass(errors.CommTimeoutError, TimeoutError)
    assert issubclass(errors.CollectiveMismatchError, errors.CommError)
    assert issubclass(errors.DeviceError, errors.UsageError) and issubclass(errors.DeviceError, TypeError)
    assert issubclass(errors.ConfigError, ValueError) and issubclass(errors.LossScaleError, errors.NonFiniteError)


def test_a_bad_option_is_a_config_error_from_cpp_and_from_python():
    with pytest.raises(errors.ConfigError, match="unknown comm.backend 'bogus'") as e:
        _C.make_communicator("bogus", 10.0, False)  # core/error.h's ConfigError, thrown in comm/
    assert e.value.problems and "communicator_factory.cpp" in e.value.problems[0]
    with pytest.raises(errors.ConfigError, match="comm.timeout_s must be between 0.001 and 1e9"):
        _C.make_communicator("inprocess", 0.0, False)
    with pytest.raises(errors.ConfigError, match="stage"):
        zerort.config.parse({"stage": 5})  # Python's


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case under test is nccl asked for on a machine "
                    "without a CUDA device; this one has one")
def test_a_backend_that_cannot_run_here_is_a_comm_error():
    with pytest.raises(errors.CommError, match="comm.backend 'nccl'"):
        zerort.comm.init("nccl")


def test_a_tensor_on_another_device_is_a_device_error():
    with pytest.raises(errors.DeviceError, match="x: tensor is on meta, expected cpu"):
        buffer(torch.empty(4, device="meta"), "x")


def test_an_overflow_at_the_minimum_scale_is_a_loss_scale_error_naming_the_parameters():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine = zerort.initialize(model, {"precision": "fp16", "stage": 1, "comm": {"backend": "inprocess"},
                                       "loss_scale": {"initial_scale_power": 0, "min_scale": 1.0, "hysteresis": 1}})
    with pytest.raises(errors.LossScaleError) as e:
        engine.backward(engine(torch.full((3, 4), float("inf"))).float().sum())
        engine.step()
    assert "already at its minimum" in str(e.value) and e.value.params == ["weight"]  # the bias gradient is finite
    assert e.value.loss_scale == 1.0


def test_a_bad_param_group_value_is_a_config_error_wherever_it_is_checked():
    torch.manual_seed(0)
    engine = zerort.initialize(torch.nn.Linear(4, 2), {"precision": "fp32", "stage": 1,
                                                      "comm": {"backend": "inprocess"}})
    engine.optimizer.param_groups[0]["lr"] = -1.0  # Python's check, at the step
    engine.backward(engine(torch.ones(3, 4)).sum())
    with pytest.raises(errors.ConfigError, match=r"\['lr'\] = -1.0"):
        engine.step()
    with pytest.raises(errors.ConfigError, match="lr must be a finite number >= 0"):
        engine.set_lr(float("nan"))
    with pytest.raises(errors.ConfigError, match="unknown keyword 'bucket'"):  # the binding's (C++) check
        _C.ShardOptimizer(torch.zeros(4), zerort.comm.init("inprocess")._c, _C.OptimizerOptions(bucket=1))


def test_checkpoint_errors_are_zerort_errors():
    from zerort.state import checkpoint

    assert checkpoint.CheckpointError is errors.CheckpointError and issubclass(errors.CheckpointError, errors.Error)
