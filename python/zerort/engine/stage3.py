"""ZeRO stage 3: the module hooks over the C++ Engine (the units are planned by
zerort.layout.units.UnitPlan).

The Engine (runtime/engine.h, stage 3) owns the shards, the gathers, the releases, the
reduce-scatters and the step; this module only decides what the units are and tells the
Engine when a unit is needed:

- Units are zerort.layout.units.choose_units' modules (a HuggingFace model's `_no_split_modules`,
  else the layers repeated in a ModuleList/Sequential, else by size; config
  stage3.unit_modules overrides). A unit's trainable compute-dtype parameters that belong
  to it alone and hold at least stage3.persistence_threshold elements form one Engine unit.
  The rest (parameters on the root, shared by several units or with the outside like a tied
  lm_head, small ones) form one persistent unit, kept whole; FP32-module parameters form the
  Engine's persistent FP32 group. Frozen parameters stay whole in the working precision.
- Before a unit (or any of its submodules called on its own, such as a tied head) runs
  forward, its Engine unit is gathered and the next stage3.prefetch units in the recorded
  forward order (Note [recorded unit order]) start gathering on the comm thread; after it,
  the unit is released, and a hook on its outputs gathers it again when backward reaches
  them (prefetching the units before it in that order). The Engine releases a
  unit once all its gradients are in and reduces them on its comm thread.

What released means: See Note [released storage] (runtime/unit_cache.h).
"""
import contextlib
import weakref

import torch

from zerort.engine.alive import alive


class UnitHooks:
    """The module hooks that gather and release an Engine's stage-3 units.

    Note [recorded unit order]: prefetch follows the order the forward ran the units in, not
    the order they were registered (model.modules() order need not be call order). Each
    forward the engine runs (Engine.__call__, inside forward_pass()) records the units as
    they start, followed by the units it did not run in registration order (a path that
    skips a unit now may take it later). When that differs from the order in use (the
    first forward, or a forward down another path), it becomes the order from the next
    forward on: one step's forward and backward prefetch by one order, so ranks whose
    paths part in a step prefetch alike until then. Before a forward is recorded the order
    is registration order. In the forward a unit prefetches the next `prefetch` units
    after it in the order; in the backward, the ones before it (backward runs it
    reversed). Ranks whose paths differ gather different units, and the checked calls
    name them (stage 3)."""

    def __init__(self, engine, model, plan):
        self.prefetch = plan.prefetch
        self.in_backward = False  # inside Engine.backward (backward_pass()): a recomputed forward keeps its unit
        self.depth = [0] * len(plan.modules)  # forwards of the unit running now
        self.units = len(plan.modules)  # Engine units 0..units-1; the persistent one follows
        self.order = list(range(self.units))  # See Note [recorded unit order]
        self._trace = None  # the units the running forward_pass() started, in order
        self._recorded = None  # a new order the last forward recorded, taken by the next one
        self.handles = []  # removed by engine.destroy()
        ref = self._ref = weakref.ref(engine)
        for u, unit in enumerate(plan.modules):
            mine = {id(p) for p in unit.parameters()}
            for m in unit.modules():  # the unit itself, and submodules that may be called alone
                if m is unit or any(id(p) in mine for p in m.parameters(recurse=False)):
                    self.handles.append(m.register_forward_pre_hook(self._pre_forward(ref, u)))
                    self.handles.append(m.register_forward_hook(self._post_forward(ref, u)))

    @contextlib.contextmanager
    def forward_pass(self):
        """One forward of the engine: records the order it runs the units in (See Note
        [recorded unit order]). A forward inside another (engine(x) called from a forward)
        belongs to the outer one."""
        if self._trace is not None or self.in_backward:
            yield
            return
        if self._recorded is not None:  # the previous forward's order, from this step on
            self.order, self._recorded = self._recorded, None
        self._trace = []
        try:
            yield
            ran = self._trace
            order = ran + [u for u in range(self.units) if u not in ran]  # units it skipped keep their place after
            if ran and order != self.order:
                self._recorded = order
        finally:
            self._trace = None

    @contextlib.contextmanager
    def backward_pass(self):
        """Inside Engine.backward: a forward recomputed by checkpointing gathers its unit
        and keeps it (backward releases it once its gradients are in)."""
        self.in_backward = True
        try:
            yield
        finally:
            self.in_backward = False

    def release_idle(self):
        """Releases every unit no forward is running (prefetched ones included)."""
        impl = self._impl(self._ref)
        for u in range(self.units):
            if self.depth[u] == 0:
                impl.release(u)

    def _impl(self, ref):
        return alive(ref).runtime

    def next_order(self):
        """The units in the order the next forward runs them (the order a recorded forward
        hands it), each once: the overlapped step updates them so (C++ Note [overlapped step])."""
        order = self._recorded if self._recorded is not None else self.order
        return list(dict.fromkeys(order))

    def _ahead(self, u):
        """The next `prefetch` units after u in the recorded order (u's place: where the
        running forward is in it, else u's first run)."""
        at = len(self._trace) - 1 if self._trace else -1
        order = self.order
        if not (0 <= at < len(order) and order[at] == u):
            at = order.index(u) if u in order else len(order)
        return [v for v in order[at + 1:at + 1 + self.prefetch] if v != u]

    def _behind(self, u):
        """The `prefetch` units the backward reaches after u: the ones before u's last run
        in the recorded order, nearest first."""
        if u not in self.order:
            return []
        at = len(self.order) - 1 - self.order[::-1].index(u)
        return [v for v in self.order[max(0, at - self.prefetch):at][::-1] if v != u]

    def _pre_forward(self, ref, u):
        def hook(module, args):
            impl = self._impl(ref)
            if self.in_backward:  # a recomputation (which may stop early): gather, keep
                impl.gather(u)
                return
            if self.depth[u] == 0:
                if self._trace is not None:
                    self._trace.append(u)
                impl.gather(u)  # its errors name the units (C++ Note [unit names])
                for v in self._ahead(u):
                    impl.prefetch(v)
            self.depth[u] += 1
        return hook

    def _post_forward(self, ref, u):
        def hook(module, args, out):
            if self.in_backward:
                return
            self.depth[u] -= 1
            if self.depth[u]:
                return
            impl = self._impl(ref)
            outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:  # gather again when backward reaches this unit's outputs
                torch.autograd.graph.register_multi_grad_hook(outs, self._pre_backward(ref, u), mode="any")
            impl.release(u)
        return hook

    def _pre_backward(self, ref, u):
        def hook(grad):
            impl = self._impl(ref)
            impl.gather(u)
            for v in self._behind(u):
                impl.prefetch(v)
        return hook


@contextlib.contextmanager
def gathered(impl):
    """Every unit whole (and kept) inside."""
    impl.hold_gathered(True)
    try:
        yield
    finally:
        impl.hold_gathered(False)
