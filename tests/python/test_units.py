"""zerort.layout.units: the stage-3 units chosen for a model (one process, no launch). HuggingFace
models are built from small configs with HF_HUB_OFFLINE=1, nothing downloaded.

Every case also checks what the caller relies on: units in registration order, each module
once, none inside another, none a ModuleList (never called), and every unit called by a
forward of the model, so that its hooks fire."""
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from zerort.layout.units import _choose, choose_units, unit_names  # noqa: E402

VOCAB, SEQ, LAYERS = 96, 16, 3


def hf(name):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=LAYERS, n_embd=32, n_head=4, n_positions=SEQ, **common))
    kw = dict(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, **common)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=True, **kw))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=False, **kw))


HF_BLOCKS = {"gpt2": ("transformer.h", "GPT2Block"), "llama": ("model.layers", "LlamaDecoderLayer"),
             "qwen2": ("model.layers", "Qwen2DecoderLayer")}


def ids():
    return torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB


def check(model, units, *inputs):
    """The invariants of every result; returns the units' names."""
    order = {id(m): i for i, m in enumerate(model.modules())}
    assert [order[id(u)] for u in units] == sorted(order[id(u)] for u in units)
    assert len({id(u) for u in units}) == len(units)
    for i, u in enumerate(units):
        assert not isinstance(u, (nn.ModuleList, nn.ModuleDict))
        inside = {id(s) for s in u.modules()}
        assert not any(id(v) in inside for j, v in enumerate(units) if j != i), "a unit holds another"
    called = set()
    hooks = [u.register_forward_pre_hook(lambda m, a: called.add(id(m))) for u in units]
    with torch.no_grad():
        model(*inputs)
    for h in hooks:
        h.remove()
    assert called == {id(u) for u in units}, "a unit that forward never calls"
    return unit_names(model, units)


def fraction(model, unit):
    return sum(p.numel() for p in unit.parameters()) / sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
def test_hf_one_unit_per_block(name):
    model = hf(name)
    path, cls = HF_BLOCKS[name]
    rule, units = _choose(model, None, 0)
    assert rule == "_no_split_modules"
    assert units == list(model.get_submodule(path)) and len(units) == LAYERS
    assert check(model, units, ids()) == [f"{path}.{i} ({cls})" for i in range(LAYERS)]
    # the same blocks when the model is wrapped, or declares nothing (rule 3 finds them)
    wrapper = nn.Module()
    wrapper.lm = model
    assert choose_units(wrapper) == units
    for m in model.modules():
        if getattr(m, "_no_split_modules", None):
            m._no_split_modules = set()
    assert _choose(model, None, 0) == ("repeated", units)


def test_hf_tied_head_outside_every_unit():
    """GPT2's lm_head shares wte's weight: both stay outside the units (persistent), and no
    unit's parameter is used outside it."""
    model = hf("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    units = choose_units(model)
    inside = {id(p) for u in units for p in u.parameters()}
    assert id(model.lm_head.weight) not in inside
    for u in units:
        mine = {id(p) for p in u.parameters()}
        rest = {id(p) for v in units if v is not u for p in v.parameters()}
        assert not mine & rest
    outside = {n for n, m in model.named_modules(remove_duplicate=False)
               for p in m.parameters(recurse=False) if id(p) not in inside}
    assert outside == {"transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"}


def test_example_gpt_one_unit_per_block():
    from gpt import GPT, Block

    torch.manual_seed(0)
    model = GPT(layers=4, d=32, heads=4, seq=SEQ)
    rule, units = _choose(model, None, 0)
    assert rule == "repeated" and units == list(model.blocks)
    assert all(type(u) is Block for u in units)
    assert check(model, units, ids()) == [f"blocks.{i} (Block)" for i in range(4)]


def test_sequential_of_linears():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    rule, units = _choose(model, None, 0)
    assert rule == "repeated" and units == [model[0], model[2], model[4]]
    assert check(model, units, torch.randn(3, 8)) == ["0 (Linear)", "2 (Linear)", "4 (Linear)"]


def test_sequential_gpt_tied_embedding_is_reported_in_two_units():
    """A GPT built as one Sequential: every member that holds parameters is a unit, the
    embedding and the head too; their shared weight is in both, for the caller to keep
    persistent."""
    from gpt import Block

    class Head(nn.Module):
        def __init__(self, emb):
            super().__init__()
            self.ln = nn.LayerNorm(32)
            self.out = nn.Linear(32, VOCAB, bias=False)
            self.out.weight = emb.weight

        def forward(self, x):
            return self.out(self.ln(x))

    emb = nn.Embedding(VOCAB, 32)
    model = nn.Sequential(emb, Block(32, 4), Block(32, 4), Head(emb))
    units = choose_units(model)
    assert units == list(model)
    check(model, units, ids())
    both = [u for u in units if any(p is emb.weight for p in u.parameters())]
    assert both == [model[0], model[3]]


class Stage(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.down = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(n))

    def forward(self, x):
        x = self.down(x)
        for b in self.blocks:
            x = x + b(x)
        return x


def test_nested_stacks_outermost():
    """Stages holding blocks holding Sequentials: the stages are the units (outermost)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(4, 16)
            self.stages = nn.ModuleList(Stage(16, 2) for _ in range(3))
            self.head = nn.Linear(16, 2)

        def forward(self, x):
            x = self.stem(x)
            for s in self.stages:
                x = s(x)
            return self.head(x)

    model = Net()
    rule, units = _choose(model, None, 0)
    assert rule == "repeated" and units == list(model.stages)
    assert check(model, units, torch.randn(3, 4)) == [f"stages.{i} (Stage)" for i in range(3)]


def test_stack_member_holding_most_is_searched_inside():
    """Sequential(Linear, Stage, Linear): the Linears repeat, but the Stage between them
    holds most of the model, so its blocks are the units instead of it."""
    model = nn.Sequential(nn.Linear(4, 32), Stage(32, 3), nn.Linear(32, 2))
    rule, units = _choose(model, None, 0)
    assert rule == "repeated"
    assert units == [model[0], *model[1].blocks, model[2]]
    assert check(model, units, torch.randn(3, 4)) == ["0 (Linear)", "1.blocks.0 (Sequential)",
                                                     "1.blocks.1 (Sequential)", "1.blocks.2 (Sequential)",
                                                     "2 (Linear)"]
    # Stage.down (outside the blocks) is left to the persistent group
    assert all(fraction(model, u) < 0.5 for u in units)


def test_lists_of_lists():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.grid = nn.ModuleList(nn.ModuleList(nn.Linear(8, 8) for _ in range(2)) for _ in range(2))

        def forward(self, x):
            for row in self.grid:
                for cell in row:
                    x = cell(x)
            return x

    model = Net()
    units = choose_units(model)
    assert units == [model.grid[0][0], model.grid[0][1], model.grid[1][0], model.grid[1][1]]
    check(model, units, torch.randn(2, 8))


def test_unit_modules_override():
    model = hf("gpt2")
    units = choose_units(model, unit_modules=["GPT2MLP"])
    assert units == [b.mlp for b in model.transformer.h]
    assert check(model, units, ids()) == [f"transformer.h.{i}.mlp (GPT2MLP)" for i in range(LAYERS)]
    # outermost only: a listed class inside a listed one is not a unit
    assert choose_units(model, unit_modules=["GPT2Attention", "GPT2Block"]) == list(model.transformer.h)
    # the root may be named; an unknown name gives no units
    assert choose_units(model, unit_modules=["GPT2LMHeadModel"]) == [model]
    assert unit_names(model, [model]) == ["<model> (GPT2LMHeadModel)"]
    assert choose_units(model, unit_modules=["NoSuchBlock"]) == []


class Mixer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Tower(nn.Module):
    """No class repeated in any stack: an embedding, a conv, attention, an MLP, a norm, a head."""

    def __init__(self, d=64):
        super().__init__()
        self.emb = nn.Embedding(100, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mix = Mixer(d)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, 10)

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.out(self.norm(self.mix(x)))


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Tower()

    def forward(self, idx):
        return self.body(idx)


def test_by_size_splits_one_big_module():
    model = Wrapped()
    rule, units = _choose(model, None, 0)
    assert rule == "size"
    b = model.body
    # Mixer is larger than size/8 and splits; the conv is a leaf; attention owns in_proj_weight
    # and reads out_proj.weight without calling out_proj, so it stays whole
    assert units == [b.emb, b.conv, b.attn, b.mix.up, b.mix.down, b.norm, b.out]
    check(model, units, ids())
    assert max(fraction(model, u) for u in units) < 0.5


def test_incidental_repetition_falls_back_to_size():
    """Two small heads in a ModuleList beside one large body: by size, not the heads alone."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = Tower()
            self.heads = nn.ModuleList([nn.Linear(10, 2), nn.Linear(10, 3)])

        def forward(self, idx):
            x = self.body(idx)
            return [h(x) for h in self.heads]

    model = Net()
    rule, units = _choose(model, None, 0)
    assert rule == "size"
    assert units[-2:] == list(model.heads) and model.body.attn in units
    check(model, units, ids())
    assert max(fraction(model, u) for u in units) < 0.5


def test_persistence_threshold():
    """Modules whose parameters are all below the threshold gather nothing: not units."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64))
    assert choose_units(model) == [model[0], model[2], model[4]]
    # Linear(4, 4): 16 + 4 elements, Linear(4, 64): 256 + 64, Linear(64, 64): 4096 + 64
    assert choose_units(model, persistence_threshold=256) == [model[2], model[4]]
    assert choose_units(model, persistence_threshold=4096) == [model[4]]  # no repetition left: by size


def test_leaf_and_unknown_unit():
    model = nn.Linear(4, 4)
    assert choose_units(model) == []
    with pytest.raises(ValueError, match="not a module of the model"):
        unit_names(nn.Sequential(nn.Linear(2, 2)), [model])

