"""Stage 3's units: the modules whose parameters are gathered together before the module's
forward (and again for its backward) and freed together after it.

    units = choose_units(model, unit_modules=config.stage3.unit_modules,
                         persistence_threshold=config.stage3.persistence_threshold)
    names = unit_names(model, units)     # ["transformer.h.0 (GPT2Block)", ...]

The units come back in registration order (``model.modules()``, pre-order; for layers kept
in a ModuleList that is also their forward order), each module once, and never nested: no
unit is inside another, nor holds a module that is another unit. Parameters outside every
unit (embeddings and heads on the root model, the final norm) are the caller's persistent
group; so are parameters that several units share, or that a unit shares with the outside
(GPT2's lm_head shares wte's weight): the caller finds those from the modules returned.
Nothing here moves, wraps or hooks anything.

Size: a module's size is the number of elements of its distinct parameters that stage 3
shards, i.e. those of at least ``persistence_threshold`` elements (smaller ones stay whole
on every rank whichever unit they are in). Under rules 2-4 a module of size 0 is never a
unit: it would gather nothing.

Rules, the first that gives units wins:

1. ``unit_modules`` (config ``stage3.unit_modules``: class names) given: every outermost
   module, the root included, whose class name is listed; nothing else is looked at. The
   user knows the model; an empty result stays empty (all parameters persistent).

2. The class names the model declares in ``_no_split_modules``, collected from every module
   that has the attribute (a HuggingFace PreTrainedModel, the root or one nested inside a
   wrapper): every outermost module of those classes below the root. These are the model
   author's own statement of what one layer is (GPT2LMHeadModel -> GPT2Block,
   LlamaForCausalLM -> LlamaDecoderLayer, Qwen2ForCausalLM -> Qwen2DecoderLayer); they are
   the classes accelerate gives FSDP's auto-wrap, and one unit per decoder layer is the
   usual ZeRO-3/FSDP granularity. Used when at least one such module holds parameters.

3. Repeated layers: a ModuleList or Sequential whose members (those of size > 0) include
   two or more of one class is a stack of layers; all its members of size > 0 are
   candidates (so nn.Sequential(Linear, ReLU, Linear) gives both Linears, and the embedding
   and head of a Sequential-built GPT become units too), except ModuleLists, ModuleDicts,
   ParameterLists and ParameterDicts, which are never called and so fire no hook. The units
   are the outermost candidates, searched from the root (with stages that hold blocks: the
   stages), so that a layer's own small stacks (an MLP built as a Sequential) stay inside
   it. A candidate holding more than half of the model's size is not taken when it can be
   split (see rule 4), as it would hold most of the model; the search goes on inside it.
   Used when the units found hold at least half of the model's size: otherwise the
   repetition is incidental (a pair of small heads beside one large body) and most of the
   model would stay whole on every rank.

4. By size, for a model with no repeated structure: split the root into its children, and
   any child larger than a target into its own children, recursively; every ModuleList or
   ModuleDict is split, and a ParameterList's parameters stay outside (none is ever called).
   Target: ceil(size of the model / 8). With about 8 units, the (prefetch + 2) units
   gathered at once hold at most about 3/8 of the model at the default prefetch of 1, while
   the collectives per step stay few (3 per unit: gather in forward, gather in backward,
   reduce-scatter) and large. A module that cannot be split stays whole, larger than the
   target if it must: a leaf, or one with parameters of its own (such a module may use its
   children's parameters without calling them: MultiheadAttention reads out_proj.weight,
   so out_proj alone would never be gathered). A model that is one leaf module has no units.

The root is never a unit under rules 2-4: a unit holding all of the model is gathered whole
for forward and backward, so it lowers no peak.
"""
import math

import torch
from zerort.errors import ConfigError

__all__ = ["choose_units", "unit_names"]

UNITS_PER_MODEL = 8                                       # rule 4's target: size / 8
# containers with no forward: no hook on them ever fires
_NEVER_CALLED = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)
_STACKS = (torch.nn.ModuleList, torch.nn.Sequential)      # where rule 3 looks for layers


def choose_units(model, unit_modules=None, persistence_threshold=0):
    """Stage 3's units of ``model``, a list of its modules in registration order, chosen by
    the first rule in the module's docstring that gives any: ``unit_modules`` (class names),
    the model's ``_no_split_modules``, layers repeated in a ModuleList or Sequential, or by
    size. ``persistence_threshold``: parameters with fewer elements stay whole on every rank
    and count for nothing in the sizes that rules 2-4 compare."""
    return _choose(model, unit_modules, persistence_threshold)[1]


def unit_names(model, units):
    """Each unit's name, its module path in ``model`` and its class: "transformer.h.0
    (GPT2Block)"; the root is "<model> (GPT2LMHeadModel)"."""
    path = {id(m): n for n, m in model.named_modules()}  # a shared module: its first path
    names = []
    for u in units:
        if id(u) not in path:
            raise ConfigError(f"a {type(u).__name__} given as a unit is not a module of the model")
        names.append(f"{path[id(u)] or '<model>'} ({type(u).__name__})")
    return names


def _choose(model, unit_modules, persistence_threshold):
    """(rule, units): the rule that gave the units ("unit_modules", "_no_split_modules",
    "repeated", "size") and the units."""
    if unit_modules:
        names = set(unit_modules)
        return "unit_modules", _outermost(model, lambda m: type(m).__name__ in names, include_root=True)
    size = _Sizes(persistence_threshold)
    declared = _no_split_names(model)
    if declared:
        units = _outermost(model, lambda m: size(m) > 0 and type(m).__name__ in declared)
        if units:
            return "_no_split_modules", units
    units = _repeated(model, size)
    if units and 2 * size.of(units) >= size(model):
        return "repeated", units
    return "size", _by_size(model, size)


def _outermost(model, pick, include_root=False):
    """The modules ``pick`` accepts, in pre-order, not looking inside one accepted; one that
    holds an already accepted module (a module registered in two places) is passed over."""
    units, inside = [], set()
    for m in model.modules():
        if id(m) in inside or (m is model and not include_root) or not pick(m):
            continue
        below = {id(s) for s in m.modules()}
        if any(id(u) in below for u in units):
            continue
        units.append(m)
        inside |= below
    return units


class _Sizes:
    """Elements of the distinct parameters of at least ``threshold`` elements, per module."""

    def __init__(self, threshold):
        self.threshold = threshold
        self._memo = {}

    def __call__(self, module):
        n = self._memo.get(id(module))
        if n is None:
            n = self._memo[id(module)] = self.of([module])
        return n

    def of(self, modules):
        seen, n = set(), 0
        for m in modules:
            for p in m.parameters():
                if id(p) not in seen and p.numel() >= self.threshold:
                    seen.add(id(p))
                    n += p.numel()
        return n


def _no_split_names(model):
    names = set()
    for m in model.modules():
        declared = getattr(m, "_no_split_modules", None)
        if isinstance(declared, str):
            declared = [declared]
        if declared:
            names.update(n for n in declared if isinstance(n, str))
    return names


def _splittable(module, size):
    """A module that the search may look inside instead of taking whole: no parameters of
    its own, and a child that holds some."""
    return (next(module.parameters(recurse=False), None) is None
            and any(size(c) > 0 for c in module.children()))


def _repeated(model, size):
    candidates = set()
    for stack in model.modules():
        if not isinstance(stack, _STACKS):
            continue
        members = [m for m in stack.children() if size(m) > 0 and not isinstance(m, _NEVER_CALLED)]
        counts = {}
        for m in members:
            counts[type(m)] = counts.get(type(m), 0) + 1
        if any(c >= 2 for c in counts.values()):
            candidates.update(id(m) for m in members)
    half = size(model) / 2
    return _outermost(model, lambda m: id(m) in candidates and not (size(m) > half and _splittable(m, size)))


def _by_size(model, size):
    target = math.ceil(size(model) / UNITS_PER_MODEL)
    return _outermost(model, lambda m: (size(m) > 0 and not isinstance(m, _NEVER_CALLED)
                                        and (size(m) <= target or not _splittable(m, size))))


class UnitPlan:
    """Which Engine unit each parameter belongs to, and which modules enter which unit."""

    def __init__(self, model, params, fp32_ids, config):
        units = choose_units(model, config.stage3.unit_modules, config.stage3.persistence_threshold)
        names = unit_names(model, units)
        owners = {}
        for u, module in enumerate(units):
            for p in module.parameters():
                owners.setdefault(id(p), set()).add(u)
        outside = {id(p) for p in _parameters_outside(model, units)}
        index = {id(p): i for i, p in enumerate(p for p in params if id(p) not in fp32_ids)}
        members = [[] for _ in units]
        persistent = []
        for p in params:
            if id(p) in fp32_ids:
                continue
            us = owners.get(id(p), set())
            if len(us) == 1 and id(p) not in outside and p.numel() >= config.stage3.persistence_threshold:
                members[next(iter(us))].append(index[id(p)])
            else:
                persistent.append(index[id(p)])
        # Engine units in forward (registration) order, then the persistent one. specs: the
        # Engine's UnitSpecs, (parameter indices, persistent, name); its errors name units.
        self.specs, self.names, self.modules = [], [], []  # per Engine unit
        for module, name, ps in zip(units, names, members):
            if ps:
                self.specs.append((ps, False, name))
                self.names.append(name)
                self.modules.append(module)
        if persistent:
            self.specs.append((persistent, True, "persistent"))
            self.names.append("persistent")
        group = [p for p in params if id(p) not in fp32_ids]
        self.numels = [sum(group[i].numel() for i in ps) for ps, persistent, _ in self.specs if not persistent]
        self.prefetch = prefetch_units(self.numels, config)


def prefetch_units(numels, config):
    """Units gathered ahead: config.stage3.prefetch, or from DeepSpeed's element counts: as many
    units (of the mean size) as fit in stage3_prefetch_bucket_size, and no more than
    stage3_max_live_parameters leaves room for beside the largest unit running. Never more
    than the units that follow the first: the hooks walk that many ahead on every unit, and
    a bucket of 5e7 elements over small units counts millions."""
    ahead = config.stage3.prefetch
    if numels and (config.stage3.prefetch_numel is not None or config.stage3.max_live_numel is not None):
        mean, largest = sum(numels) / len(numels), max(numels)
        if config.stage3.prefetch_numel is not None:
            ahead = int(config.stage3.prefetch_numel // max(mean, 1))
        if config.stage3.max_live_numel is not None:
            ahead = min(ahead, max(0, config.stage3.max_live_numel // max(largest, 1) - 1))
    return min(ahead, max(len(numels) - 1, 0))


def _parameters_outside(model, units):
    """Parameters of modules outside every unit (a tied lm_head's weight, shared with an
    embedding inside a unit, must stay whole)."""
    inside = {id(m) for u in units for m in u.modules()}
    out = []
    for m in model.modules():
        if id(m) not in inside:
            out.extend(m.parameters(recurse=False))
    return out
