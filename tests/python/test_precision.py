"""zerort.layout.precision: which modules stay FP32 under bf16/fp16 (norm layers by what they are,
config fp32_modules adding and removing classes) and which float buffers keep their dtype.
One process, world size 1; the HuggingFace models are in test_hf_models.py."""
import pytest
import torch
import torch.nn as nn

import zerort
from zerort.layout import precision

INPROC = {"comm": {"backend": "inprocess"}}


class ScaleNorm(nn.Module):
    """A norm of no torch class: FP32 by its name alone."""

    def __init__(self, d):
        super().__init__()
        self.g = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


class Renamed(nn.LayerNorm):
    """A subclass of a torch norm class whose name does not end in Norm."""


TORCH_NORMS = [nn.LayerNorm(8), nn.RMSNorm(8), nn.GroupNorm(2, 8), nn.BatchNorm1d(8), nn.BatchNorm2d(8),
               nn.BatchNorm3d(8), nn.SyncBatchNorm(8), nn.InstanceNorm1d(8, affine=True, track_running_stats=True),
               nn.InstanceNorm2d(8, affine=True), nn.InstanceNorm3d(8), nn.LocalResponseNorm(2), nn.CrossMapLRN2d(3),
               Renamed(8), ScaleNorm(8)]


@pytest.mark.parametrize("module", TORCH_NORMS, ids=lambda m: type(m).__name__)
def test_norm_layers_are_fp32_by_what_they_are(module):
    assert precision.is_norm(module)
    assert not precision.is_norm(module, ("-" + type(module).__name__,))  # removed by exact class name


def test_other_modules_are_not_fp32_unless_added():
    for m in (nn.Linear(2, 2), nn.Embedding(3, 2), nn.Conv1d(2, 2, 1), nn.MultiheadAttention(4, 2), nn.Dropout()):
        assert not precision.is_norm(m), type(m).__name__
    assert precision.is_norm(nn.Linear(2, 2), ("Linear",))
    assert precision.is_norm(nn.LayerNorm(2), ("-BatchNorm1d",))  # another class's removal: no effect


class Gate(nn.Module):
    """A composite class to add to the FP32 modules: its submodules' parameters go too."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(self.proj(x), -1) * x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.norm = ScaleNorm(8)
        self.gate = Gate()
        self.ln = nn.LayerNorm(8)
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        return self.b(self.ln(self.gate(self.norm(self.bn(self.a(x))))))


def dtypes(engine):
    return {k: v.dtype for k, v in engine.full_state_dict().items() if v.is_floating_point()}


def step(engine, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
    out = engine(x)
    assert out.dtype == torch.bfloat16  # FP32 modules hand back the compute dtype
    engine.backward(nn.functional.mse_loss(out.float(), y))
    engine.step()


FP32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("stage", [0, 3])
def test_default_rule_keeps_norms_and_their_buffers_fp32(stage):
    e = zerort.initialize(Net(), dict(INPROC, stage=stage, precision="bf16"))
    step(e)
    assert dtypes(e) == {"a.weight": BF16, "a.bias": BF16, "bn.weight": FP32, "bn.bias": FP32,
                         "bn.running_mean": FP32, "bn.running_var": FP32, "norm.g": FP32,
                         "gate.proj.weight": BF16, "gate.proj.bias": BF16, "ln.weight": FP32, "ln.bias": FP32,
                         "b.weight": BF16, "b.bias": BF16}


@pytest.mark.parametrize("spelling", ["ours", "deepspeed"])
def test_fp32_modules_adds_and_removes_classes_in_both_spellings(spelling):
    change = ["Gate", "-LayerNorm", "-ScaleNorm"]
    cfg = (dict(INPROC, stage=2, precision="bf16", fp32_modules=change) if spelling == "ours" else
           {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "zerort": {"fp32_modules": change}})
    e = zerort.initialize(Net(), cfg, comm=zerort.comm.init("inprocess"))
    step(e)  # the Linear inside Gate computes in FP32 with the Gate's FP32 inputs
    d = dtypes(e)
    assert d["gate.proj.weight"] == d["gate.proj.bias"] == FP32
    assert d["ln.weight"] == d["norm.g"] == BF16
    assert d["bn.weight"] == d["bn.running_mean"] == FP32 and d["a.weight"] == BF16


def test_nested_fp32_modules_stay_fp32_inside():
    # An added class holding a norm: the inner norm must not hand bf16 to its FP32 parent.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(6)
            self.fc = nn.Linear(6, 2)

        def forward(self, x):
            assert x.dtype == FP32
            return self.fc(self.ln(x))

    model = nn.Sequential(nn.Linear(6, 6), Block())
    e = zerort.initialize(model, dict(INPROC, stage=1, precision="bf16", fp32_modules=["Block"]))
    step(e)
    assert [m for m in precision.fp32_plan(model, ("Block",)).fp32_modules] == [model[1]]
    assert model[1].fc.weight.dtype == FP32 and model[0].weight.dtype == BF16


class PositionTable(nn.Module):
    """No parameters, a float buffer added to bf16 activations (a sinusoidal table)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pe", torch.sin(torch.arange(8.0) / 3.0))

    def forward(self, x):
        return x + self.pe


class FixedProjection(nn.Module):
    """No parameters, a float buffer multiplied with bf16 activations."""

    def __init__(self):
        super().__init__()
        self.register_buffer("proj", torch.randn(8, 8) / 3)

    def forward(self, x, *, shift):
        assert x.dtype == shift.dtype == FP32  # bf16 would fail in the matmul with an FP32 buffer
        return x @ self.proj + shift


class Buffers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 8)
        self.table = PositionTable()
        self.fixed = FixedProjection()
        self.b = nn.Linear(8, 2)
        self.register_buffer("scale", torch.full((6,), 0.3))  # meets bf16 x next to the weights: cast
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))  # not floating: untouched

    def forward(self, x):
        h = self.table(self.a(x * self.scale))
        h = self.fixed(h, shift=h[:, :1])  # a keyword input: cast to FP32 too
        assert h.dtype == BF16
        return self.b(h)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_buffers_keep_their_dtype_unless_their_module_computes_in_bf16(stage):
    model = Buffers()
    pe, proj = model.table.pe.clone(), model.fixed.proj.clone()
    e = zerort.initialize(model, dict(INPROC, stage=stage, precision="bf16"))
    step(e)
    assert model.scale.dtype == BF16  # the root has bf16 parameters
    assert model.table.pe.dtype == model.fixed.proj.dtype == FP32  # parameter-free modules: as built
    assert torch.equal(model.table.pe, pe) and torch.equal(model.fixed.proj, proj)
    assert model.steps.dtype == torch.int64


def test_removing_a_parameter_free_class_casts_its_buffers():
    model = Buffers()
    plan = precision.fp32_plan(model, ("-PositionTable",))
    assert model.table not in plan.fp32_modules and model.fixed in plan.fp32_modules
    e = zerort.initialize(model, dict(INPROC, stage=2, precision="bf16", fp32_modules=["-PositionTable"]))
    step(e)
    assert model.table.pe.dtype == BF16 and model.fixed.proj.dtype == FP32


def test_fp32_precision_casts_nothing():
    model = Buffers()
    zerort.initialize(model, dict(INPROC, stage=2, precision="fp32"))
    assert all(b.dtype in (FP32, torch.int64) for b in model.buffers())


def test_memory_estimate_follows_the_same_rule():
    # The FP32 group that zerort.estimate_memory counts is the engine's.
    from zerort.accounting.memory import model_groups

    for change in ((), ("Gate", "-LayerNorm")):
        cfg = zerort.config.parse(dict(stage=2, fp32_modules=list(change)))
        groups = model_groups(Net(), 2, "bf16", cfg)
        e = zerort.initialize(Net(), dict(INPROC, stage=2, precision="bf16", fp32_modules=list(change)))
        fp32 = [g for g in groups if g.element_bytes == 4]
        assert sorted(fp32[0].numels) == sorted(p.numel() for p in e.param_index.groups[1]), change
