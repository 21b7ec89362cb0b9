"""Non-finite training: skipped steps are counted, named, and stopped after too many.

A step whose gradients hold a NaN or Inf (a non-finite loss makes every gradient so) is
skipped on every rank alike (runtime/shard_optimizer.h). This module adds:

- which parameters: each rank's ShardOptimizer watches the pieces of the FP32 gradient
  shard it owns, one region per parameter piece, and on a skipped step records which
  regions held a non-finite value. One small all-gather (FIRST_K indices per rank) then
  gives every rank the same globally first parameters, in named_parameters() order.
  engine.stats["nonfinite_params"] lists them after each skipped step.
- a limit: after config max_consecutive_skips skipped steps in a row, step() raises
  NonFiniteError naming those parameters and the loss scale. Under fp16, the loss
  scaler's own LossScaleError (an overflow with the scale already at its minimum) is
  raised again with the same details.
"""
import weakref

import torch

from zerort.layout import shard_map
from zerort.errors import LossScaleError, NonFiniteError

FIRST_K = 4  # parameters named in an error


class Guard:
    """Owned by an Engine; wraps its step()."""

    def __init__(self, engine):
        self.engine = weakref.proxy(engine)  # owned by the engine: no reference cycle
        self.limit = engine.config.max_consecutive_skips
        self.consecutive = 0
        self.target = engine.runtime  # has set_watch_regions
        layout = shard_map.param_layout(engine)  # trainable parameters, named_parameters() order
        self.names = list(layout)
        index = {name: i for i, name in enumerate(self.names)}
        self.target.set_watch_regions([(offset, numel, index[name])
                                       for offset, numel, name in shard_map.owned(engine, layout)])

    def first_nonfinite(self):
        """Names of the first FIRST_K parameters (named_parameters() order) whose gradient
        held a non-finite value on the last skipped step, the same on every rank. A
        collective."""
        n = len(self.names)
        mine = sorted(set(self.target.nonfinite_ids))[:FIRST_K]
        local = torch.full((FIRST_K,), n, dtype=torch.int64)
        local[:len(mine)] = torch.tensor(mine, dtype=torch.int64)
        comm = self.engine.comm
        everyone = comm.all_gather(local, torch.empty(FIRST_K * comm.size, dtype=torch.int64))
        ids = sorted(set(int(i) for i in everyone.tolist()) - {n})[:FIRST_K]
        return [self.names[i] for i in ids]

    def _describe(self, params, scale):
        e = self.engine
        where = (f"first parameters with non-finite gradients: {', '.join(repr(p) for p in params)}"
                 if params else "no single gradient value was non-finite, but their sum of squares overflowed")
        kind = "dynamic, fp16" if e.config.precision == "fp16" else f"static, {e.config.precision}"
        return f"{where}; loss scale {scale:g} ({kind}); global step {e.global_step}, rank {e.rank} of {e.world_size}"

    def step(self, run):
        try:
            s = run()
        except LossScaleError as e:  # the scaler's (runtime/loss_scaler.cpp): an overflow at the minimum scale
            # Raised on every rank alike, after the shard was checked: name the params.
            params, scale = self.first_nonfinite(), self.engine.loss_scale
            raise LossScaleError(f"{e}; {self._describe(params, scale)}", params, scale) from e
        if not s["boundary"]:
            return s
        if not s["skipped"]:
            self.consecutive = 0
            return s
        self.consecutive += 1
        s["nonfinite_params"] = self.first_nonfinite()
        if self.consecutive >= self.limit:
            raise NonFiniteError(
                f"zerort: {self.consecutive} optimizer steps in a row were skipped because the gradients "
                f"were not finite (max_consecutive_skips = {self.limit}); "
                f"{self._describe(s['nonfinite_params'], s['loss_scale'])}. "
                "Check the inputs and the loss for NaN/Inf and lower the learning rate; under fp16 try bf16; "
                "raise max_consecutive_skips to tolerate longer runs of skipped steps",
                s["nonfinite_params"], s["loss_scale"])
        return s
