"""zerort.initialize(model, config) -> Engine: ZeRO training for a torch.nn.Module.

    engine = zerort.initialize(model, {"stage": 2, "precision": "bf16"})
    for x, y in data:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()

Stages 0, 1 and 2 go through the C++ Engine (runtime/engine.h): parameters become views of
one flat buffer per dtype, and each rank owns its shard of the FP32 master and Adam states
(stage 0: all of it). At stages 0 and 1 their grads are views of a flat grad buffer that
autograd accumulates into; at stage 2 each grad is packed into a bucket's pack buffer as it
completes and autograd's copy is freed (runtime/engine_reduce.cpp). Stage 3 is the same
Engine with units (zerort/layout/units.py plans them, zerort/engine/stage3.py holds the
module hooks that gather and release them). Compute runs in bf16, fp16 or fp32. Under bf16
and fp16, FP32 modules keep FP32 parameters and compute, with their
inputs cast to FP32 and their outputs back to the compute dtype: norm layers, by what they
are (torch's norm classes and any class whose name ends in "Norm", such as HuggingFace's
LlamaRMSNorm), with config fp32_modules adding ("Name") or removing ("-Name") classes. Float
buffers keep the dtype the model gave them (rotary inv_freq, BatchNorm's running
statistics) except in modules with parameters in the compute dtype, whose forward mixes
the two: there they are cast to it. A module without parameters that holds float buffers
computes in FP32 like an FP32 module. The rule is zerort.layout.precision's. Every buffer lives on
the model's device: CPU (mpi or gloo communicators) or one CUDA device (nccl).
"""
import contextlib
import math
import time
import types
import weakref

import torch

from zerort import _C, lifecycle
from zerort import comm as comm_mod
from zerort.accounting import phases, placement_auto
from zerort.config import native, offload, replace, resolve_batch
from zerort.engine import failfast, nonfinite, same_model, setup, stage3, streams
from zerort.engine.alive import alive
from zerort.engine.deepspeed_methods import DeepSpeedMethods
from zerort.engine.optimizer import ZeroOptimizer
from zerort.engine.param_index import ParamIndex
from zerort.engine.param_waits import ParamWaits
from zerort.engine.state_methods import StateMethods
from zerort.errors import ConfigError, UsageError
from zerort.layout import precision
from zerort.layout import units as unit_plan
from zerort.monitoring import monitor, progress

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Engine(StateMethods, DeepSpeedMethods):
    def __init__(self, model, config, comm=None, weights=None, param_groups=None, lr_scheduler=None):
        """See zerort.initialize, which parses the config and calls this. Each step below is
        one job, in the order they must run (each later one uses what the earlier made)."""
        setup.refuse_wrapped(model)
        memory_token = phases.EngineMemory.begin_initialize(model)  # before anything is allocated
        self._declare(model, config)
        self.comm = setup.connect(config, self.device, comm)
        self.config = resolve_batch(setup.chosen_shard_size(config, self.comm), self.comm.size)  # DS's batch rule
        self.config, self.placement = placement_auto.resolve(self.config, model, self.device, self.comm)
        self._join_job()
        grouping = precision.group_params(model, self.config.precision, self.config.fp32_modules)
        plan = grouping.fp32_plan
        self._hooks = precision.compute_in_fp32(plan, self.dtype)  # every hook on the model, for destroy()
        self._cast_buffers = plan.cast_buffers
        setup.masters_to_fp32(model, grouping.names)
        materialize = setup.materializer(model, self.device, weights)
        frozen = materialize(grouping.frozen) if materialize else grouping.frozen  # frozen stay whole: real now
        self._frozen_fp32 = setup.share_rank0_values(self.comm, model, frozen, plan, self.dtype)
        self._build_runtime(grouping, frozen, materialize)
        self._units = stage3.UnitHooks(self, model, self.unit_plan) if self.unit_plan else None
        self._param_waits = ParamWaits(self, model, self.param_index) if ParamWaits.wanted(self) else None
        self._register_grad_hooks()
        self._build_training_loop(param_groups, lr_scheduler)
        self._memory = phases.EngineMemory.end_initialize(memory_token, self)
        progress.announce(self, comm_mod.detect_launch_env())

    def _declare(self, model, config):
        """Every attribute the engine has, born here (the later steps fill them in), so a
        half-built engine (its __init__ raised) is still one zerort.lifecycle can close."""
        self.module = model
        self.config = config
        self.dtype = _DTYPES[config.precision]
        self.device = setup.model_device(model)
        self._autocast_dtype = precision.autocast_dtype(config.autocast, self.device)  # None: off
        offload.check_tier(config, self.device)  # before any collective: See Note [offload tiers]
        self.comm = None
        self._impl = None               # the C++ Engine (engine.runtime); None once closed
        self.param_index = None         # a ParamIndex, when the C++ Engine exists
        self.unit_plan, self.unit_names = None, []  # stage 3: the zerort.layout.units.UnitPlan; unit i's module
        self._units = None              # stage 3: the module hooks (zerort.engine.stage3.UnitHooks)
        self._param_waits = None        # overlap_param_gather: its module hooks (zerort.engine.param_waits)
        self._overlaps_step = False     # the C++ Engine's overlaps_step (Note [overlapped step])
        self._shard_groups = None, None, None  # shard_size's group and replicas; hpZ's secondary group
        self._hooks = []                # every hook on the model, removed by destroy()
        self._cast_buffers = set()      # (id(module), name) of the buffers cast to the compute dtype
        self._frozen_fp32 = {}          # id(frozen param) -> its FP32 value (engine.frozen_masters)
        self._replaced = {}             # meta model: id(meta param) -> the real one
        self._memory = None             # phases.EngineMemory: the allocator's view (memory_report)
        self.placement = None           # offload.placement auto: its placement.Placement (memory_report)
        self.stats = {}
        self.training_dataloader = None  # deepspeed.initialize's training_data loader, when it made one
        self.tput_timer = progress.ThroughputTimer()
        self._nonfinite = None          # nonfinite.Guard: names non-finite params; max_consecutive_skips
        self.optimizer = None
        self.lr_scheduler = None
        self._no_sync = False
        self._forward_only = None  # why backward() and step() are refused (make_forward_only), or None
        self._backward_since_step = False
        self._step_applied = False
        self._t_forward = self._t_backward = 0.0  # the last forward's and backward's seconds
        self._progress = None           # progress.Progress: steps_per_print, wall_clock_breakdown
        self._monitor = None            # the config's CSV / TensorBoard monitor, or None

    def _join_job(self):
        """This engine in the job: an uncaught error ends every rank, it is closed at exit if
        still alive (its comm thread joined), and every rank holds the same model."""
        failfast.install(self.comm.rank, self.comm.size)
        lifecycle.track_engine(self)
        same_model.check_model(self.comm, self.module)

    def _build_runtime(self, grouping, frozen, materialize):
        """The C++ Engine over the trainable parameters (stage 3: over the planned units), and
        the ParamIndex of the parameters it holds (a meta model's real ones)."""
        c, model, params, groups = self.config, self.module, grouping.trainable, grouping.groups
        shapes = {id(p): tuple(p.shape) for p in params}  # stage 3 empties the params
        self.comm._c.reset_scratch_peak()  # the memory report measures from here
        units = unit_plan.UnitPlan(model, params, grouping.fp32_plan.fp32_ids, c) if c.stage == 3 else None
        if units:  # DeepSpeed's element counts become a number of units (zerort.layout.units.prefetch_units)
            c = self.config = replace(c, stage3={"prefetch": units.prefetch})
        fill = None if materialize is None else lambda g, idx: materialize([groups[g][i] for i in idx])
        shard, replicas, secondary = self._shard_groups = setup.shard_groups(c, self.comm)
        self._impl = _C.Engine(groups[0], groups[1], self.comm._c, units=units.specs if units else [],
                               options=native.engine_options(c, self.device), materialize=fill,  # zerort.config.native
                               shard=shard and shard._c, replicas=replicas and replicas._c,
                               replica_dtype=c.comm.inter_node_dtype, secondary=secondary and secondary._c)
        names = grouping.names
        if materialize is not None:  # the real parameters replace the meta ones everywhere
            real = lambda ps: [materialize.replaced.get(id(p), p) for p in ps]
            groups, meta, params = [real(g) for g in groups], params, real(params)
            shapes = {id(p): shapes[id(q)] for p, q in zip(params, meta)}
            names = {id(p): n for n, p in reversed(list(model.named_parameters()))}
            self._replaced = materialize.replaced  # for param groups built from the meta parameters
        self.param_index = ParamIndex.build(params, frozen, names, groups, shapes, self.dtype)
        self.unit_plan, self.unit_names = units, units.names if units else []
        self._overlaps_step = self._impl.overlaps_step  # read once: fixed for the engine's life

    def _register_grad_hooks(self):
        """Each gradient, once complete, lets its bucket go to the comm thread while backward
        continues (at stage 3 it also lets a finished unit be released)."""
        ref = weakref.ref(self)  # the model's hooks must not keep the engine alive
        for g, group in enumerate(self.param_index.groups):
            for i, p in enumerate(group):
                self._hooks.append(
                    p.register_post_accumulate_grad_hook(lambda _p, g=g, i=i: alive(ref)._grad_ready(g, i)))
        for hooks in (self._units, self._param_waits):
            if hooks:
                self._hooks += hooks.handles

    def _build_training_loop(self, param_groups, lr_scheduler):
        """What step() uses beside the C++ Engine: the non-finite guard, the param groups, the
        lr schedule, the progress printer and the monitor."""
        self._nonfinite = nonfinite.Guard(self)
        self.optimizer = ZeroOptimizer(self, param_groups)
        self.lr_scheduler = setup.scheduler(self.config, self.optimizer, lr_scheduler)
        self._progress = progress.Progress(self)
        self._monitor = monitor.make(self)

    # ---- training loop -------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Forward. Floating-point tensor arguments are cast to the compute dtype (0-dim
        ones, scalars such as a token count, are passed as they are)."""
        with self._phase("forward"):
            if self.module.training:
                self.tput_timer.start()
            if self._monitor and self.module.training:
                self._monitor.forward(args, kwargs)
            args, kwargs = precision.cast_floats((args, kwargs), self.dtype)
            t0 = time.perf_counter()
            autocast = precision.autocast(self._autocast_dtype, self.device)  # config autocast, or nothing
            with self._units.forward_pass() if self._units else contextlib.nullcontext(), autocast:
                out = self.module(*args, **kwargs)
            self._params_whole()  # a gather no module waited for (See zerort.engine.param_waits)
            self._t_forward = time.perf_counter() - t0
        return out

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """loss.backward() with the loss scaled by the current loss scale (in FP32). The
        engine averages over ranks and micro-steps itself: pass the plain mean loss.
        Several backward() calls before one step() add up, as in PyTorch. Works under
        torch.no_grad() too. DeepSpeed's arguments: retain_graph as in torch;
        scale_wrt_gas=False sums the micro-steps' gradients instead of averaging them."""
        self._check_trainable()
        self._backward_since_step = True
        if self._monitor:
            self._monitor.backward(loss)
        with self._phase("backward"):
            t0 = time.perf_counter()
            self._impl.begin_backward()  # a previous pass's reduces finish first
            recompute = self._units.backward_pass() if self._units else contextlib.nullcontext()
            with recompute, torch.enable_grad():  # the scaling multiply must be part of the graph
                scale = self._impl.loss_scale * (1 if scale_wrt_gas else self.config.batch.gradient_accumulation_steps)
                (loss.float() * scale).backward(retain_graph=retain_graph)
            self._t_backward = time.perf_counter() - t0

    def step(self, lr_kwargs=None):
        """Reduces this micro-step's gradients; at the accumulation boundary, updates the
        parameters (or skips on non-finite gradients) and zeroes the gradients. Every rank
        must have run backward() since its previous step(): otherwise the step() that ends
        the accumulation window raises zerort.UsageError on every rank, naming the ranks,
        and applies nothing. The same holds when the ranks issued different collectives since
        the previous step (the step's one decision collective compares them): the error names
        the first call that differs on each rank (comm.debug: true names it at the call)."""
        if self._no_sync:
            raise UsageError("engine.step() inside engine.no_sync(): leave the no_sync() block first; the "
                                "last backward() of the accumulation window runs outside it, then step()")
        self._check_trainable()
        self._progress.before_step()
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:  # the param groups' values (a scheduler may have changed them) go to the update
            with self.optimizer.stepping():
                self.optimizer.step()
        if self._param_waits and boundary:
            self._param_waits.pending = True  # the update may leave gathers in flight, even if it fails midway
        with self._phase("step"):  # the step's errors name diverging stage-3 units (C++ Note [unit names])
            s = ParamWaits.overlapped_step(self, boundary, lambda: self._nonfinite.step(self._impl.step))
        self._backward_since_step = False
        self._step_applied = s["boundary"] and not s["skipped"]
        if s["boundary"]:
            s["forward_ms"] = 1e3 * self._t_forward
            s["backward_ms"] = 1e3 * self._t_backward
            self.stats = s
            if self._step_applied and self.lr_scheduler is not None:
                moved = getattr(self.lr_scheduler, "optimizer", None)
                if moved is not None:  # a user's optimizer sharing our groups stepped too: torch's check
                    moved._opt_called = True
                self.lr_scheduler.step(**(lr_kwargs or {}))  # as DeepSpeed: after every applied update
            if self._monitor:  # one all-gather, every rank; the row holds the lr after the update, as DeepSpeed
                self._monitor.after_update(self, s)
        batch = self.config.batch
        samples = (batch.train_micro_batch_size_per_gpu or 0) * batch.gradient_accumulation_steps
        self.tput_timer.stop(s["boundary"], samples * self.world_size)
        self._progress.after_step(s, self)
        return s

    forward = __call__  # engine.forward(x), as DeepSpeed scripts call it, is engine(x)

    def _grad_ready(self, g, i):
        """A parameter's gradient is complete (its post-accumulate-grad hook): its bucket may
        be reduced now, except inside no_sync(), where the gradients stay local."""
        if not self._no_sync:
            self._impl.grad_ready(g, i)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward() accumulates gradients on this rank only; the backward() after
        the block, then step(), reduces them all (DeepSpeed's and DDP's no_sync). Stages 0
        and 1 only: at stages 2 and 3 each rank keeps only its gradient shard, so gradients
        are reduced during every backward; use gradient_accumulation_steps there."""
        if self.config.stage >= 2:
            raise UsageError(f"engine.no_sync(): not at ZeRO stage {self.config.stage}, which reduce-scatters "
                                "gradients during every backward pass (each rank keeps only its shard); use "
                                "gradient_accumulation_steps in the config, or stage 0 or 1")
        if self._no_sync:
            raise UsageError("engine.no_sync(): already inside a no_sync() block")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def train(self, mode=True):
        """engine.module.train(mode); returns the engine."""
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def __getattr__(self, name):
        """Unknown public attributes are the module's (as DeepSpeed's engine forwards them)."""
        module = self.__dict__.get("module")
        if module is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"neither the zerort engine nor its module ({type(module).__name__}) has an "
                                 f"attribute {name!r}") from None

    @contextlib.contextmanager
    def _phase(self, name):
        """The allocator's peak over one phase (zerort.accounting.phases.EngineMemory), for the memory
        report."""
        streams.follow_current_stream(self._impl, self.device)  # the caller's stream: C++ Note [stream order]
        mem = self._memory
        mem.begin(name, self._impl)
        try:
            yield
        finally:
            mem.end(name, self._impl)
            done = mem.phases.result.get(name)
            if self._monitor and done is not None:
                self._monitor.phase_peak(done.last_peak)

    def _params_whole(self):
        """overlap_param_gather: waits for every bucket's gather still in flight."""
        if self._param_waits:
            self._param_waits.wait_all(self._impl)

    def make_forward_only(self, reason):
        """From now on backward() and step() raise UsageError(reason): an engine made
        without an optimizer (a reference or reward model, as DeepSpeed allows at stages 0
        and 3) runs forward only."""
        self._forward_only = reason

    def _check_trainable(self):
        """The trainable set is planned at initialize: a later requires_grad change is an
        error naming the parameter (raised before any collective, so on every rank that
        made the change). A forward-only engine refuses to train."""
        if self._forward_only:
            raise UsageError(self._forward_only)
        index = self.param_index
        for ps, was in ((index.params, True), (index.frozen, False)):
            for p in ps:
                if p.requires_grad != was:
                    raise UsageError(
                        f"zerort: parameter {index.names[id(p)]!r} was {'trainable' if was else 'frozen'} at "
                        f"initialize and now has requires_grad={p.requires_grad}; zerort lays out its shards and "
                        "optimizer state at initialize, so set requires_grad before zerort.initialize (freeze "
                        "or unfreeze, then wrap the model again, or restore requires_grad)")

    # ---- properties ----------------------------------------------------------------
    @property
    def rank(self):
        return self.comm.rank

    @property
    def world_size(self):
        return self.comm.size

    @property
    def shard_comms(self):
        """The zerort.comm.Communicator of shard_size's group and replicas, and of stage 3's secondary
        shards (None for each that is not there)."""
        return self._shard_groups

    @property
    def runtime(self):
        """The C++ Engine (zerort._C.Engine) that holds the buffers, shards and counters, for
        zerort's own modules (checkpoints, the shard map, the memory report); None once the
        engine is closed."""
        return self._impl

    @property
    def frozen_masters(self):
        """id(frozen parameter) -> its FP32 value (read-only mapping; the tensors are the
        engine's own, which checkpoint loads write into)."""
        return types.MappingProxyType(self._frozen_fp32)

    @property
    def unit_order(self):
        """Stage 3: the Engine units in the order prefetch follows now, as a recorded forward
        ran them (See Note [recorded unit order], zerort.engine.stage3); [] at stages 0-2."""
        return list(self._units.order) if self._units else []

    @property
    def loss_scale(self):
        return self._impl.loss_scale

    @property
    def global_step(self):
        return self._impl.global_step

    @property
    def skipped_steps(self):
        return self._impl.skipped_steps

    def set_lr(self, lr):
        """Sets every param group's learning rate for the next steps. Not with a config
        lr_schedule, which decides the lr at every step."""
        if self.config.optimizer.lr_schedule is not None:
            raise UsageError("set_lr: this engine has an lr_schedule in its config, which sets the "
                               "lr every step; remove lr_schedule to set the lr by hand")
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise ConfigError([f"set_lr: lr must be a finite number >= 0, got {lr!r}"])
        for g in self.optimizer.param_groups:
            g["lr"] = float(lr)

    def _close(self):
        """Drops the C++ engine (or the stage-3 one) now, whatever else refers to this object:
        zerort.lifecycle calls it at exit, so the comm thread is joined while the interpreter
        is whole. Unusable afterwards."""
        self._impl = None
        self._nonfinite = None
        if self._monitor:
            self._monitor.close()

