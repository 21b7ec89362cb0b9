"""ZeRO stage 3: each rank keeps only its shard of every parameter.

Parameters are grouped into units (by default each direct child of the model, with
ModuleList/Sequential children expanded into their members; or the modules whose class is
listed in config stage3.unit_modules). Each unit is a flat, padded buffer split into W
shards: units are stage 3's reduce buckets, so reduce_bucket_numel does not apply. Hooks
gather a unit just before its forward and again when backward reaches its outputs
(prefetching the next stage3.prefetch units) and free it after; when a unit's gradients have all accumulated, they are packed and
reduce-scattered at once into this rank's FP32 gradient shard. Parameters under
stage3.persistence_threshold elements, parameters shared by several units (tied weights)
and parameters on the root module itself stay whole in one persistent group, refreshed by
an all-gather after every step; parameters of FP32 modules (norm layers: zerort.precision) likewise,
in a persistent FP32 group. Frozen parameters stay whole in the working precision.

Limits: call units (or the model), not a unit's submodules directly; and autograd keeps a
gathered weight alive until its backward when an op saves a view of it (F.linear saves
weight.t()), so such units free their memory only after backward.

All groups' shards are concatenated into one rank-local FP32 master, so one ShardOptimizer
(runtime/shard_optimizer.h) makes one global skip/clip decision and one fused AdamW pass.
"""
import contextlib
import time
import weakref

import torch

from . import _C

ALIGN = 16  # elements: every group's shard is a multiple of it


class _Group:
    def __init__(self, name, params, world, dtype, persistent):
        """dtype: the group's working dtype (the compute dtype, or float32 for FP32 modules)."""
        self.name, self.params, self.dtype, self.persistent = name, params, dtype, persistent
        self.shapes = [p.shape for p in params]  # params are emptied while not gathered
        self.numels = [p.numel() for p in params]
        self.layout = _C.ShardLayout(self.numels, world, ALIGN)
        self.shard = self.layout.shard_numel
        self.nbytes = self.layout.padded_numel * torch.empty(0, dtype=dtype).element_size()  # gathered
        self.full = None          # the gathered flat low-precision buffer, or None when freed
        self.pending = None       # an all-gather in flight (prefetch)
        self.ready = 0            # params whose grad has accumulated in this backward
        self.expected = len(params)

    def views(self, flat):
        """(param, its view of flat) in layout order."""
        out, off = [], 0
        for p, shape, n in zip(self.params, self.shapes, self.numels):
            out.append((p, flat[off:off + n].view(shape)))
            off += n
        return out


class Stage3:
    """The stage-3 implementation behind zerort.Engine (same interface as _C.Engine)."""

    def __init__(self, model, config, comm, dtype, params, fp32_ids, optimizer_kwargs):
        self.comm, self.dtype, self.config = comm, dtype, config
        self.device = dev = comm.device  # the model's device: every buffer lives there
        self._reduce_s = self._gather_s = 0.0
        self.gathered_bytes = self.gathered_peak = 0  # live unit buffers (persistent excluded)
        self.pack_peak = 0                            # largest gradient pack buffer
        W, rank = comm.size, comm.rank
        self.groups, self.unit_of = [], {}
        for name, module, ps, fp32, persistent in plan_units(model, params, fp32_ids, config):
            g = _Group(name, ps, W, torch.float32 if fp32 else dtype, persistent)
            g.index = len(self.groups)  # the tag of its collectives: ranks must serve the same unit
            self.groups.append(g)
            if module is not None:
                self.unit_of[module] = g
        # Rank-local shards, one slice per group in group order: FP32 master; working copy.
        total = sum(g.shard for g in self.groups)
        master = torch.empty(total, device=dev)
        off = 0
        for g in self.groups:
            flat = torch.zeros(g.layout.padded_numel, device=dev)
            for p, view in g.views(flat):
                view.copy_(p.detach())
            comm.broadcast(flat, 0)  # every rank starts from rank 0's values
            master[off:off + g.shard] = flat[rank * g.shard:(rank + 1) * g.shard]
            g.lp_slice = master[off:off + g.shard].to(g.dtype, copy=True)  # RNE, as AdamW rounds
            g.grad_off = off
            off += g.shard
        self.opt = _C.ShardOptimizer(master, comm._c, precision=config.precision, **optimizer_kwargs)
        self.grad_shard = self.opt.grad_shard
        for g in self.groups:
            for p in g.params:
                p.data = torch.empty(0, dtype=g.dtype, device=dev)
                p.register_post_accumulate_grad_hook(self._make_grad_hook(g))
            if g.persistent:
                self._gather(g)
        self._order = [g for g in self.groups if not g.persistent]
        for module, g in self.unit_of.items():
            module.register_forward_pre_hook(self._make_pre_forward(g))
            module.register_forward_hook(self._make_post_forward(g))
        self.in_backward = False
        self._pinned = 0  # > 0 inside gathered(): nothing is freed
        self.micro_steps = self.global_step = self.skipped_steps = 0
        self.saw_backward = False  # a backward pass ran in this micro-step
        self.missed_backward = 0   # micro-steps of this window without one

    # ---- gather / free --------------------------------------------------------------
    def _start_gather(self, g):
        if g.full is None and g.pending is None:
            g.full_buf = torch.empty(g.layout.padded_numel, dtype=g.dtype, device=self.device)
            if not g.persistent:
                self.gathered_bytes += g.nbytes
                self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)
            with _naming(g, "gathering"):
                g.pending = self.comm.all_gather_async(g.lp_slice, g.full_buf, tag=g.index)

    def _gather(self, g):
        t0 = time.perf_counter()
        self._start_gather(g)
        if g.pending is not None:
            g.pending.wait()
            g.pending = None
            g.full = g.full_buf
            for p, view in g.views(g.full):
                p.data = view
        self._gather_s += time.perf_counter() - t0

    def _free(self, g):
        if g.persistent or g.full is None or self._pinned:
            return
        for p in g.params:
            p.data = torch.empty(0, dtype=g.dtype, device=self.device)
        g.full = g.full_buf = None
        self.gathered_bytes -= g.nbytes

    def _neighbour(self, g, delta):
        i = self._order.index(g) + delta
        return self._order[i] if 0 <= i < len(self._order) else None

    def _prefetch(self, g, direction):
        for k in range(1, self.config.prefetch + 1):  # the next `prefetch` units
            nxt = self._neighbour(g, direction * k)
            if nxt is None:
                break
            self._start_gather(nxt)

    # The model's hooks reach the engine through a weak reference (alive()): they must not
    # keep it, and its device memory, alive after the user drops it.
    def _make_pre_forward(self, g):
        ref = weakref.ref(self)

        def hook(module, args):
            self = alive(ref)
            self._gather(g)
            if not self.in_backward:
                self._prefetch(g, +1)
        return hook

    def _make_post_forward(self, g):
        ref = weakref.ref(self)

        def hook(module, args, out):
            self = alive(ref)
            if self.in_backward:  # a recomputation inside backward keeps the unit
                return
            # Gather again when backward reaches this unit: a hook on every output tensor
            # that needs a gradient, wherever it sits in the output (tuple, dict, ...).
            outs = [t for t in torch.utils._pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:
                torch.autograd.graph.register_multi_grad_hook(outs, self._make_pre_backward(g), mode="any")
            self._free(g)
        return hook

    def _make_pre_backward(self, g):
        ref = weakref.ref(self)

        def hook(grad):
            self = alive(ref)
            self._gather(g)
            self._prefetch(g, -1)
        return hook

    # ---- gradients ------------------------------------------------------------------
    def _make_grad_hook(self, g):
        ref = weakref.ref(self)

        def hook(p):
            self = alive(ref)
            self.saw_backward = True
            g.ready += 1
            if g.ready == g.expected:
                self._reduce(g)
        return hook

    def _reduce(self, g):
        """Packs the group's low-precision grads (layout order, zero padding) and
        reduce-scatters them into this rank's FP32 gradient slice; frees the grads."""
        t0 = time.perf_counter()
        packed = torch.zeros(g.layout.padded_numel, dtype=g.dtype, device=self.device)
        self.pack_peak = max(self.pack_peak, g.nbytes)
        for p, view in g.views(packed):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = None
        with _naming(g, "reducing the gradients of"):
            self.comm.reduce_scatter_accumulate(packed, self.grad_shard[g.grad_off:g.grad_off + g.shard],
                                                accumulate=True, tag=g.index)
        g.ready = 0
        self._free(g)
        self._reduce_s += time.perf_counter() - t0

    # ---- the _C.Engine interface -----------------------------------------------------
    @property
    def loss_scale(self):
        return self.opt.loss_scale

    def set_lr(self, lr):
        self.opt.set_lr(lr)

    def begin_backward(self):
        """Before each backward pass (_C.Engine's interface). Units reduce as each pass
        ends, so passes add up without waiting here."""
        self.saw_backward = True

    def step(self):
        for g in self.groups:  # params that got no gradient this micro-step
            if g.ready:
                self._reduce(g)
        self.missed_backward += not self.saw_backward
        self.saw_backward = False
        self.micro_steps += 1
        window = self.config.gradient_accumulation_steps
        boundary = self.micro_steps % window == 0
        stats = {"boundary": boundary, "skipped": False, "loss_scale": self.opt.loss_scale,
                 "reduce_ms": 1e3 * self._reduce_s, "gather_ms": 1e3 * self._gather_s}
        self._reduce_s = self._gather_s = 0.0
        if not boundary:
            return stats
        missed, self.missed_backward = self.missed_backward, 0
        try:
            _C.check_backward_calls(self.comm._c, missed, window)
        except _C.Error:
            self.grad_shard.zero_()  # the window is dropped whole, as _C.Engine does
            self.micro_steps -= window
            raise
        self.global_step += 1
        s = self.opt.step([(g.grad_off, g.lp_slice) for g in self.groups])
        stats.update({k: v for k, v in s.items() if k not in ("reduce_ms", "gather_ms")})
        if s["skipped"]:
            self.skipped_steps += 1
        else:
            t0 = time.perf_counter()
            for g in self.groups:
                if g.pending is not None:  # a prefetch of the old values: finish and drop it
                    g.pending.wait()
                    g.pending = g.full_buf = None
                    if not g.persistent:
                        self.gathered_bytes -= g.nbytes
                if g.persistent:
                    g.full = None
                    self._gather(g)
                else:
                    self._free(g)
            stats["gather_ms"] += 1e3 * (time.perf_counter() - t0)
        return stats

    # ---- checkpoints ----------------------------------------------------------------
    def state(self):
        d = self.opt.state()
        d.update(global_step=self.global_step, skipped_steps=self.skipped_steps, micro_steps=self.micro_steps)
        return d

    def load_state(self, d):
        self.opt.load_state(d)
        self.global_step, self.skipped_steps, self.micro_steps = d["global_step"], d["skipped_steps"], d["micro_steps"]

    def refresh_from_master(self):
        """The working shards from a freshly loaded master (RNE, as AdamW writes them)."""
        for g in self.groups:
            if g.pending is not None:
                g.pending.wait()
                g.pending = g.full_buf = None
                if not g.persistent:
                    self.gathered_bytes -= g.nbytes
            self._free(g)
            g.lp_slice.copy_(self.opt.master[g.grad_off:g.grad_off + g.shard])
            if g.persistent:
                g.full = None
                self._gather(g)

    @contextlib.contextmanager
    def gathered(self):
        for g in self.groups:
            self._gather(g)
        self._pinned += 1
        try:
            yield
        finally:
            self._pinned -= 1
            for g in self.groups:
                self._free(g)

    def full_flat(self, group, master):
        """The group's full flat values: FP32 master (gathered) or low precision."""
        if master:
            out = torch.empty(group.layout.padded_numel, device=self.device)
            self.comm.all_gather(self.opt.master[group.grad_off:group.grad_off + group.shard], out)
            return out
        out = torch.empty(group.layout.padded_numel, dtype=group.dtype, device=self.device)
        self.comm.all_gather(group.lp_slice.clone(), out)
        return out


@contextlib.contextmanager
def _naming(g, doing):
    """A collective's error says which unit this rank was serving (ranks that take different
    paths through the model gather or reduce different units)."""
    try:
        yield
    except _C.Error as e:
        raise type(e)(f"{e}\n(this rank was {doing} stage-3 unit {g.index}, {g.name!r})") from e


def alive(ref):
    """The engine behind a model hook's weak reference, or a clear error once it is gone."""
    engine = ref()
    if engine is None:
        raise RuntimeError("zerort: the engine this model was wrapped by has been deleted, and its hooks "
                           "(and at stage 3 its parameters) went with it; keep the engine alive while you "
                           "use the model, or wrap the model again")
    return engine


def plan_units(model, params, fp32_ids, config):
    """Stage 3's groups, in order: (name, unit module or None, params, is_fp32, persistent).
    One group per unit that owns parameters, then the persistent group (root-level, shared
    by several units, or under persistence_threshold), then the persistent FP32 group."""
    units = _units(model, config.unit_modules)
    owner = {}
    for u, module in enumerate(units):
        for p in module.parameters():
            owner.setdefault(id(p), set()).add(u)
    per_unit = [[] for _ in units]
    persistent, persistent_fp32 = [], []
    for p in params:
        us = owner.get(id(p), set())
        if id(p) in fp32_ids:
            persistent_fp32.append(p)  # FP32 modules (norms): small, kept whole in FP32
        elif len(us) == 1 and p.numel() >= config.persistence_threshold:
            per_unit[next(iter(us))].append(p)
        else:
            persistent.append(p)
    plan = [(type(m).__name__, m, ps, False, False) for m, ps in zip(units, per_unit) if ps]
    if persistent:
        plan.append(("persistent", None, persistent, False, True))
    if persistent_fp32:
        plan.append(("persistent_fp32", None, persistent_fp32, True, True))
    return plan


def _units(model, unit_modules):
    if unit_modules:
        names = set(unit_modules)
        found, skip = [], set()
        for m in model.modules():
            if type(m).__name__ in names and not any(m is s for s in skip):
                found.append(m)
                skip.update(m.modules())
        return found
    units = []
    for child in model.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
            units.extend(child.children())
        else:
            units.append(child)
    return units
