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
  forward, its Engine unit is gathered and the next stage3.prefetch units start gathering
  on the comm thread; after it, the unit is released, and a hook on its outputs gathers it
  again when backward reaches them (prefetching the units before it). The Engine releases a
  unit once all its gradients are in and reduces them on its comm thread.

What released means: See Note [released storage] (runtime/unit_cache.h).
"""
import contextlib
import weakref

import torch



class UnitHooks:
    """The module hooks that gather and release an Engine's stage-3 units."""

    def __init__(self, engine, model, plan, prefetch):
        self.prefetch = prefetch
        self.in_backward = False  # set by Engine.backward: a recomputed forward keeps its unit
        self.depth = [0] * len(plan.modules)  # forwards of the unit running now
        self.units = len(plan.modules)  # Engine units 0..units-1 in forward order; the persistent one follows
        self.handles = []  # removed by engine.destroy()
        ref = self._ref = weakref.ref(engine)
        for u, unit in enumerate(plan.modules):
            mine = {id(p) for p in unit.parameters()}
            for m in unit.modules():  # the unit itself, and submodules that may be called alone
                if m is unit or any(id(p) in mine for p in m.parameters(recurse=False)):
                    self.handles.append(m.register_forward_pre_hook(self._pre_forward(ref, u)))
                    self.handles.append(m.register_forward_hook(self._post_forward(ref, u)))

    def release_idle(self):
        """Releases every unit no forward is running (prefetched ones included)."""
        impl = self._impl(self._ref)
        for u in range(self.units):
            if self.depth[u] == 0:
                impl.release(u)

    def _impl(self, ref):
        from zerort.engine.engine import alive
        return alive(ref)._impl

    def _pre_forward(self, ref, u):
        def hook(module, args):
            impl = self._impl(ref)
            if self.in_backward:  # a recomputation (which may stop early): gather, keep
                impl.gather(u)
                return
            if self.depth[u] == 0:
                impl.gather(u)  # its errors name the units (C++ Note [unit names])
                for k in range(1, self.prefetch + 1):
                    if u + k < self.units:
                        impl.prefetch(u + k)
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
            for k in range(1, self.prefetch + 1):
                if u - k >= 0:
                    impl.prefetch(u - k)
        return hook


@contextlib.contextmanager
def gathered(impl):
    """Every unit whole (and kept) inside."""
    impl.hold_gathered(True)
    try:
        yield
    finally:
        impl.hold_gathered(False)
