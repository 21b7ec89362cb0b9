"""DeepSpeed's learning-rate schedules, on any optimizer's param_groups (engine.optimizer).

    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100,
                             "total_num_steps": 1000}}

The formulas and step semantics are DeepSpeed's (deepspeed/runtime/lr_schedules.py):
construction sets each group's lr to the schedule at iteration -1, and step() advances
one iteration; the engine calls step() after every applied optimizer step (not after a
skipped one). So the lr of Adam step n (1-based) is the schedule at iteration n - 2:
warm-up from min_lr at step 1 and 2, then log(i + 1) / log(W) (or i / W) of the way up.
A value given as a list has one entry per param group. state_dict() is
{"last_batch_iteration": i}, as DeepSpeed saves it.
"""
import math

from zerort.errors import ConfigError, UsageError

LOG, LINEAR = "log", "linear"


def _per_group(optimizer, value, name):
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError([f"scheduler.params.{name}: got {len(value)} values for {n} param groups; give one "
                               "number, or one per param group"])
        return [float(v) for v in value]
    return [float(value)] * n


def _warmup_fraction(i, steps, kind):
    """How far warm-up has come at iteration i < steps (DeepSpeed: log or linear)."""
    return math.log(i + 1) / math.log(steps) if kind == LOG else i / steps


class _Schedule:
    """Shared by every schedule: step(), the lr list, and the saved iteration. Each
    schedule defines get_lr(): the lr of every group at self.last_batch_iteration."""

    def __init__(self, optimizer, last_batch_iteration=-1):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:
            self._apply()

    def _apply(self):
        lrs = self.get_lr()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration=None):
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._apply()

    def get_last_lr(self):
        if self._last_lr is None:
            raise UsageError(f"{type(self).__name__}.get_last_lr(): call step() first")
        return self._last_lr

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state):
        self.last_batch_iteration = state["last_batch_iteration"]
        self._apply()


class WarmupLR(_Schedule):
    """From warmup_min_lr up to warmup_max_lr (default: each group's lr) over
    warmup_num_steps (at least 2), then constant."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type=LOG, last_batch_iteration=-1):
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self):
        i = self.last_batch_iteration
        return _warmup_fraction(i, self.warmup_num_steps, self.warmup_type) if i < self.warmup_num_steps else 1.0

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then down linearly to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type=LOG, last_batch_iteration=-1):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self):
        i = self.last_batch_iteration
        if i < self.warmup_num_steps:
            return _warmup_fraction(i, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - i) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Each group's lr times a ratio: from warmup_min_ratio up to 1 over
    warmup_num_steps, then a cosine down to cos_min_ratio at total_num_steps, and there it
    stays."""

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type=LOG, last_batch_iteration=-1):
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self):
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            up = _warmup_fraction(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + up * (1.0 - self.warmup_min_ratio)
        done = min(1.0, (i - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * done)) / 2)

    def get_lr(self):
        r = self.ratio()
        return [lr * r for lr in self.org_lrs]


class LRRangeTest(_Schedule):
    """lr_range_test_min_lr times (1 + step_rate * iterations / step_size), continuous or
    in stairs: a sweep to find the largest lr that trains."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False, last_batch_iteration=-1):
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ConfigError([f"scheduler.params.lr_range_test_step_size: got {lr_range_test_step_size!r}; allowed: "
                               "an integer > 0"])
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def get_lr(self):
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lrs]


class OneCycle(_Schedule):
    """One triangle from cycle_min_lr up to cycle_max_lr (cycle_first_step_size
    iterations) and back (cycle_second_step_size), optionally in stairs, then a decay of
    the min lr by 1 / (1 + decay_lr_rate * k / decay_step_size). With cycle_momentum, the
    first beta goes the other way, between cycle_max_mom and cycle_min_mom (the second
    beta is 0.99, as DeepSpeed sets it)."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0,
                 last_batch_iteration=-1):
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0 or second < 0:
            raise ConfigError([f"scheduler.params.cycle_first_step_size / cycle_second_step_size: got {first:g} / "
                               f"{second:g}; allowed: the first > 0, the second >= 0"])
        self.first, self.second, self.total = first, second, first + second
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.cycle_momentum = bool(cycle_momentum)
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.decay_mom_rate = float(decay_mom_rate)
        no_decay = math.isclose(decay_step_size, 0)
        self.lr_decays = not no_decay and not math.isclose(self.decay_lr_rate, 0)
        self.mom_decays = not no_decay and not math.isclose(self.decay_mom_rate, 0)
        if self.cycle_momentum and last_batch_iteration == -1:
            for g, mom in zip(optimizer.param_groups, self.min_moms):
                g["betas"] = (mom, 0.99)
        super().__init__(optimizer, last_batch_iteration)

    def _scale(self):
        """Where in the triangle iteration last_batch_iteration + 1 is: 0 at the min, 1 at the max."""
        it = self.last_batch_iteration + 1
        x = 1.0 + it / self.total - math.floor(1 + it / self.total)
        ratio = self.first / self.total
        if x <= ratio:
            scale, stairs = x / ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (ratio - 1), self.second_stairs
        if stairs > 0:
            pos = it % self.total
            up = pos <= self.first
            scale = math.floor((pos if up else self.total - pos) * stairs
                               / (self.first if up else self.second)) / stairs
        return scale

    def _decay_k(self):
        return (self.last_batch_iteration - self.total + 1) / self.decay_step_size

    def get_lr(self):
        if self.last_batch_iteration < self.total:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if not self.lr_decays:
            return list(self.min_lrs)
        return [lo / (1 + self.decay_lr_rate * self._decay_k()) for lo in self.min_lrs]

    def get_mom(self):
        if self.last_batch_iteration < self.total:
            s = self._scale()
            return [(hi - (hi - lo) * s, 0.99) for lo, hi in zip(self.min_moms, self.max_moms)]
        if not self.mom_decays:
            return [(hi, 0.99) for hi in self.max_moms]
        return [(hi * (1 + self.decay_mom_rate * self._decay_k()), 0.99) for hi in self.max_moms]

    def _apply(self):
        super()._apply()
        if self.cycle_momentum and self.last_batch_iteration >= 0:
            for g, mom in zip(self.optimizer.param_groups, self.get_mom()):
                g["betas"] = mom


SCHEDULES = {c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}

def build(spec, optimizer):
    """The schedule a parsed config's scheduler section names, on optimizer (None: none)."""
    if spec is None:
        return None
    return SCHEDULES[spec["type"]](optimizer, **spec["params"])
