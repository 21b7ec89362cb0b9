"""engine.optimizer: the param groups of zerort's fused AdamW, as a torch optimizer.

    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    engine = zerort.initialize(model, config, param_groups=groups)
    engine.optimizer.param_groups[0]["lr"] = 1e-4          # read and changed between steps
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: min(1, s / 100))

Each group's lr, betas, eps and weight_decay apply to its parameters' elements of this
rank's FP32 shard: the fused AdamW runs once per stretch of elements that share a group
(runtime/shard_optimizer.h), on every device and at every stage. The update itself is
engine.step(); engine.step() calls optimizer.step() at each accumulation boundary, which
hands the groups' current values to the C++ optimizer (and lets a torch LRScheduler see
that the optimizer stepped). The FP32 master and Adam moments live sharded in the engine;
state_dict() holds the param groups only, by parameter name, so it survives resharding.
"""
import contextlib
import math
import weakref

import torch

from zerort.config import fp32_problem
from zerort.errors import CheckpointError, ConfigError, UsageError
from zerort.layout.shard_map import owned

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")
# torch.optim.AdamW's options that zerort's AdamW does not have, with the value it implies.
UNSUPPORTED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}


def _where(k):
    return f"param_groups[{k}]"


class ZeroOptimizer(torch.optim.Optimizer):
    """Built by the engine from param_groups (None: one group of every trainable
    parameter; a list of tensors: one group; a list of dicts: torch's param groups).
    Frozen parameters in a group are dropped (they have no optimizer state); every
    trainable parameter must be in exactly one group.

    Note [shared param groups]: given dicts are taken as they are, not copied (as
    torch.optim.Optimizer takes them), so param_groups[k] IS the caller's group k. When
    the groups come from a user's optimizer (deepspeed.initialize(optimizer=AdamW(...)),
    zerort.integrations.deepspeed.optimizer_groups), a schedule built on that optimizer
    moves the lr, betas and weight decay zerort's update reads, as in DeepSpeed, where the
    client optimizer's groups are the ones stepped. Nothing reads a copy that could go stale.
    """

    def __init__(self, engine, param_groups=None):
        c = engine.config
        o = c.optimizer
        defaults = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
                    "bias_correction": o.bias_correction}
        groups = _normalize(engine, param_groups)
        self._engine = weakref.ref(engine)  # owned by the engine: no reference cycle
        self._in_step = False
        self._pushed = None
        self._laid_out = False
        super().__init__(groups, defaults)
        for k, g in enumerate(self.param_groups):
            for key, implied in UNSUPPORTED.items():
                if g.get(key, implied) != implied:
                    raise ConfigError(f"zerort optimizer: {_where(k)}[{key!r}] = {g[key]!r} is not supported; "
                                     f"zerort's fused AdamW runs with {key}={implied}: remove the key")
        self._laid_out = True
        self._regions = _regions(engine, self.param_groups)
        self.push()  # checks every group's values now, not at the first step

    # ---- torch.optim.Optimizer -------------------------------------------------------
    def add_param_group(self, param_group):
        """Called by torch's constructor only, with a group _normalize checked: the
        defaults go in. (Not torch's, which imports torch._dynamo: imported after gloo's
        worker threads had started, exits with collectives in flight aborted.)"""
        if getattr(self, "_laid_out", False):
            raise UsageError("engine.optimizer.add_param_group: zerort lays out the parameters and their "
                                "optimizer state at initialize; pass every group to zerort.initialize "
                                "(param_groups=) or deepspeed.initialize (model_parameters=)")
        for key, value in self.defaults.items():
            param_group.setdefault(key, value)
        self.param_groups.append(param_group)

    @contextlib.contextmanager
    def stepping(self):
        """Inside, step() hands the groups to the update: engine.step() opens it at each
        accumulation boundary; a user's own optimizer.step() call is refused."""
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def step(self, closure=None):
        """Called by engine.step() at each accumulation boundary (inside stepping()), before
        the update."""
        if not self._in_step:
            raise UsageError("engine.optimizer.step(): zerort's update is engine.step(), which reduces the "
                                "gradients and then updates with these param groups; call engine.step() "
                                "after engine.backward(loss) instead")
        self.push()

    def zero_grad(self, set_to_none=True):
        """As engine.zero_grad()."""
        self._live().zero_grad()

    def state_dict(self):
        """The param groups (hyperparameters and parameter names), as saved in checkpoints.
        The FP32 master and Adam moments are in the checkpoint's shards."""
        return {"param_groups": describe(self._live(), self.param_groups)}

    def load_state_dict(self, state_dict):
        self.restore_groups(state_dict["param_groups"], "optimizer.load_state_dict")
        self.push()

    def restore_groups(self, saved, who, check_only=False):
        """Takes saved param groups (state_dict()'s form) after checking they hold this
        engine's parameters; check_only: only the check (who: the caller named in errors)."""
        restore(self._live(), [dict(g) for g in self.param_groups] if check_only else self.param_groups, saved, who)

    # ---- zerort ----------------------------------------------------------------------
    def _live(self):
        engine = self._engine()
        if engine is None:
            raise UsageError("zerort optimizer: its engine has been deleted")
        return engine

    def push(self):
        """Hands the groups' current values to the C++ optimizer (checked first: a bad value
        names its group and changes nothing). A config lr_schedule sets every group's lr
        for the next Adam step."""
        engine = self._live()
        schedule = engine.config.optimizer.lr_schedule
        if schedule is not None:
            lr = schedule(engine.runtime.adam_steps + 1)
            for g in self.param_groups:
                g["lr"] = lr
        rows = [_row(k, g, schedule is not None) for k, g in enumerate(self.param_groups)]
        if rows != self._pushed:
            engine.runtime.set_hyper_groups(rows, self._regions if len(rows) > 1 else [])
            self._pushed = rows


def _row(k, g, scheduled):
    """(lr, beta1, beta2, eps, weight_decay, bias_correction) of group k, checked."""
    lr, betas, eps, wd = (g[key] for key in HYPER_KEYS)
    lr = float(lr) if isinstance(lr, torch.Tensor) else lr
    real = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    for key, v in (("lr", lr), ("eps", eps), ("weight_decay", wd)):  # the engine computes in FP32
        fp32 = fp32_problem(v, zero_ok=key != "eps") if real(v) else None
        if fp32:
            raise ConfigError([f"zerort optimizer: {_where(k)}[{key!r}] = {v!r}, which is {fp32[0]} in FP32, the "
                               f"dtype the engine computes with; allowed: {fp32[1]}"])
    if not real(lr) or lr < 0:
        source = " (from the config's lr_schedule)" if scheduled else ""
        raise ConfigError([f"zerort optimizer: {_where(k)}['lr'] = {lr!r}{source}; it must be a finite number >= 0"])
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(real(b) and 0 <= b < 1 for b in betas)):
        raise ConfigError([f"zerort optimizer: {_where(k)}['betas'] = {betas!r}; it must be two numbers, each >= 0 "
                           "and < 1, such as (0.9, 0.999)"])
    if not real(eps) or eps <= 0:
        raise ConfigError([f"zerort optimizer: {_where(k)}['eps'] = {eps!r}; it must be a finite number > 0, such "
                           "as 1e-8 (eps = 0 turns the update into 0/0 where a gradient is 0)"])
    if not real(wd) or wd < 0:
        raise ConfigError([f"zerort optimizer: {_where(k)}['weight_decay'] = {wd!r}; it must be a finite number "
                           ">= 0"])
    bias_correction = g.get("bias_correction", True)
    if not isinstance(bias_correction, bool):
        raise ConfigError([f"zerort optimizer: {_where(k)}['bias_correction'] = {bias_correction!r}; it must be "
                           "true (Adam's bias-corrected moments, the default) or false"])
    return (float(lr), float(betas[0]), float(betas[1]), float(eps), float(wd), float(bias_correction))


def _normalize(engine, param_groups):
    """torch-style groups holding engine's trainable parameters, each exactly once."""
    trainable = {id(p): p for p in engine.param_index.params}
    frozen = {id(p) for p in engine.param_index.frozen}
    if param_groups is None:
        return [{"params": list(engine.param_index.params)}]
    if isinstance(param_groups, torch.Tensor):
        raise ConfigError("zerort optimizer: param groups must be an iterable of tensors or of dicts, got one tensor; "
                        "pass model.parameters() or a list of groups")
    groups = list(param_groups)
    if not groups or not all(isinstance(g, dict) for g in groups):
        if all(isinstance(p, torch.Tensor) for p in groups):
            groups = [{"params": groups}]
        else:
            raise ConfigError("zerort optimizer: param groups must be tensors (one group) or dicts with 'params' "
                            "(torch's param groups), not a mix")
    replaced = getattr(engine, "_replaced", {})  # a meta-device model's parameters became real ones
    seen, out = {}, []
    for k, g in enumerate(groups):
        if "params" not in g:
            raise ConfigError(f"zerort optimizer: {_where(k)} has no 'params'; each group is a dict with 'params' "
                             "(a list of parameters) and optional lr, betas, eps, weight_decay")
        params = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        kept = []
        for p in params:
            p = replaced.get(id(p), p)
            if id(p) in frozen:
                continue  # requires_grad=False: no gradient, no optimizer state
            if id(p) not in trainable:
                raise ConfigError(f"zerort optimizer: {_where(k)} holds a tensor of shape {list(p.shape)} that is not "
                                 "a parameter of the model passed to initialize; build the groups from "
                                 "model.named_parameters()")
            name = engine.param_index.names[id(p)]
            if id(p) in seen:
                raise ConfigError(f"zerort optimizer: parameter {name!r} is in {_where(seen[id(p)])} and in "
                                 f"{_where(k)}; put each parameter in one group")
            seen[id(p)] = k
            kept.append(p)
        g["params"] = kept  # Note [shared param groups]: the caller's dict itself, as torch.optim does
        out.append(g)
    missing = [engine.param_index.names[i] for i in trainable if i not in seen]
    if missing:
        raise ConfigError(f"zerort optimizer: {len(missing)} trainable parameters are in no param group, first "
                         f"{', '.join(repr(n) for n in missing[:5])}; put every trainable parameter in a group, or "
                         "freeze it (requires_grad=False) before initialize")
    return out


def _regions(engine, groups):
    """(offset, numel, group) of this rank's shard, merged where neighbours share a group."""
    group_of = {engine.param_index.names[id(p)]: k for k, g in enumerate(groups) for p in g["params"]}
    merged = []
    for offset, numel, name in owned(engine):
        k = group_of[name]
        if merged and merged[-1][2] == k and merged[-1][0] + merged[-1][1] == offset:
            merged[-1][1] += numel
        else:
            merged.append([offset, numel, k])
    return [tuple(r) for r in merged]


def describe(engine, groups):
    """JSON-able param groups: every key but 'params', which becomes parameter names."""
    out = []
    for g in groups:
        d = {k: (list(v) if isinstance(v, tuple) else float(v) if isinstance(v, torch.Tensor) else v)
             for k, v in g.items() if k != "params"}
        d["params"] = [engine.param_index.names[id(p)] for p in g["params"]]
        out.append(d)
    return out


def restore(engine, groups, saved, who):
    """Puts saved (describe()'s form) into groups; the membership must be the same."""
    if len(saved) != len(groups):
        raise CheckpointError(f"{who}: the saved optimizer has {len(saved)} param groups, this engine {len(groups)}; "
                         "build the same param groups as the run that saved it")
    for k, (g, s) in enumerate(zip(groups, saved)):
        names = [engine.param_index.names[id(p)] for p in g["params"]]
        if sorted(names) != sorted(s["params"]):
            diff = sorted(set(names) ^ set(s["params"]))
            raise CheckpointError(f"{who}: {_where(k)} holds other parameters than the saved one (first difference "
                             f"{diff[0]!r}); build the same param groups as the run that saved it")
    values = [{k: tuple(v) if k == "betas" else v for k, v in s.items() if k != "params"} for s in saved]
    for k, (g, v) in enumerate(zip(groups, values)):
        _row(k, {**g, **v}, False)  # every value checked before any is taken
    for g, v in zip(groups, values):
        g.update(v)
