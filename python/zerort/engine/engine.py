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
import weakref

import torch

from zerort import _C, lifecycle
from zerort import comm as comm_mod
from zerort.accounting import phases
from zerort.config import native, replace, resolve_batch
from zerort.engine import failfast, meta_init, nonfinite, same_model, setup, stage3
from zerort.engine.deepspeed_methods import DeepSpeedMethods
from zerort.engine.state_methods import StateMethods
from zerort.engine.optimizer import ZeroOptimizer
from zerort.errors import ConfigError, DeviceError, UsageError
from zerort.layout import precision
from zerort.layout import units as unit_plan
from zerort.monitoring import monitor, progress

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Engine(StateMethods, DeepSpeedMethods):
    def __init__(self, model, config, comm=None, weights=None, param_groups=None, lr_scheduler=None):
        c = config
        owner = setup.engine_of(model.parameters())
        if owner is not None:
            raise UsageError("zerort.initialize: this model is already wrapped by a live zerort engine, whose "
                             f"initialize made its parameters {owner.dtype} views of that engine's buffers (in "
                             "place); wrap a model once and train through the engine initialize returned, or call "
                             "that engine's destroy() first (every parameter gets its FP32 master value back)")
        self.module = model
        self.config = c
        self.dtype = _DTYPES[c.precision]
        self.device = setup.model_device(model)
        cuda = self.device.type == "cuda"
        backend = "nccl" if cuda and c.comm.backend == "auto" else c.comm.backend
        if comm is None and backend == "nccl" and not cuda:
            raise ConfigError([f"comm.backend: got 'nccl' but the model is on {self.device}; nccl moves CUDA "
                               "buffers: move the model (model.cuda()), or use 'auto', 'mpi' or 'gloo'"])
        # A CUDA model over mpi or gloo: its buffers travel through pinned host memory (ranks
        # that share one GPU, where NCCL refuses them).
        staged = "cuda" if cuda and backend != "nccl" else None
        if comm is None:
            comm = comm_mod.init(backend, c.comm.timeout_s, bool(c.comm.debug), staged)
        self.comm = comm
        if self.comm.device != self.device:
            raise ConfigError([f"comm.backend: the model is on {self.device} but the '{self.comm.backend}' "
                               f"communicator moves {self.comm.device} buffers; use 'nccl' (or 'auto') for CUDA "
                               "models, or zerort.comm.init(..., staged='cuda'), and 'mpi' or 'gloo' for CPU "
                               "models"])
        if c.stage == 3 and c.comm.debug is None:
            self.comm.check_each_call()  # Note [checked calls]: ranks that diverge at stage 3 differ in size
        c = self.config = resolve_batch(c, self.comm.size)  # DeepSpeed's batch rule, at this world size
        failfast.install(self.comm.rank, self.comm.size)  # an uncaught error ends every rank
        lifecycle.track_engine(self)  # closed at exit if still alive (its comm thread joined)
        same_model.check_model(self.comm, model)  # the same model on every rank, or an error
        grouping = precision.group_params(model, c.precision, c.fp32_modules)
        plan = grouping.fp32_plan
        fp32_ids = plan.fp32_ids
        self._hooks = precision.compute_in_fp32(plan, self.dtype)  # every hook on the model, for destroy()
        self._cast_buffers = plan.cast_buffers
        self._names = grouping.names  # id(param) -> its first name, for errors
        with torch.no_grad():  # bf16/fp16 parameters (a model loaded in half precision): their values, exactly, in
            for p in model.parameters():  # the FP32 master, as DeepSpeed takes them
                if p.dtype in (torch.bfloat16, torch.float16):
                    p.data = p.data.float()
        wrong = [p for p in model.parameters() if p.dtype != torch.float32]
        if wrong:
            raise DeviceError(f"zerort: parameter {self._names[id(wrong[0])]!r} is {wrong[0].dtype}; zerort trains "
                              "float32, bfloat16 and float16 parameters (it keeps an FP32 master and casts itself): "
                              "convert the model (model.float()), or keep such a tensor as a buffer "
                              "(register_buffer) instead of a parameter")
        params, frozen = grouping.trainable, grouping.frozen
        materialize = None
        if weights is not None and not meta_init.is_meta_model(model):
            raise ConfigError("zerort.initialize: weights= is for a model built on the meta device (with "
                             "torch.device('meta'): ...); this model's parameters already hold values")
        if meta_init.is_meta_model(model):  # made real bucket by bucket inside the Engine
            meta_init.check_buffers(model)
            materialize = meta_init.Materializer(model, self.device, weights)
            frozen = materialize(frozen)  # frozen parameters stay whole: real from the start
        # Frozen parameters take part in compute only: rank 0's values, in the working
        # precision. Their FP32 values are kept for full_state_dict(master=True).
        self._frozen_fp32 = {}
        with torch.no_grad():
            for p in frozen:
                self.comm.broadcast(p.data, 0)
                self._frozen_fp32[id(p)] = p.data.clone()
                if id(p) not in fp32_ids:
                    p.data = p.data.to(self.dtype)
            for m in model.modules():  # rank 0's buffers; cast only where zerort.layout.precision says
                for name, b in m.named_buffers(recurse=False):
                    if b is not None and b.is_floating_point():
                        self.comm.broadcast(b, 0)
                        if (id(m), name) in plan.cast_buffers:
                            setattr(m, name, b.to(self.dtype))
        self._groups = grouping.groups
        self._shapes = {id(p): tuple(p.shape) for p in params}  # stage 3 empties the params
        self._params = params  # every trainable parameter, each once
        self._frozen = frozen
        self.comm._c.reset_scratch_peak()  # the memory report measures from here
        units = unit_plan.UnitPlan(model, params, fp32_ids, c) if c.stage == 3 else None
        if units:  # DeepSpeed's element counts become a number of units (zerort.layout.units.prefetch_units)
            c = self.config = replace(c, stage3={"prefetch": units.prefetch})
        fill = None if materialize is None else lambda g, idx: materialize([self._groups[g][i] for i in idx])
        self._impl = _C.Engine(self._groups[0], self._groups[1], self.comm._c, units=units.specs if units else [],
                               options=native.engine_options(c), materialize=fill)  # zerort.config.native
        if materialize is not None:  # the real parameters replace the meta ones everywhere
            real = lambda ps: [materialize.replaced.get(id(p), p) for p in ps]
            self._groups = [real(g) for g in self._groups]
            self._params = real(self._params)
            self._shapes = {id(p): self._shapes[id(q)] for p, q in zip(self._params, params)}
            self._names = {id(p): n for n, p in reversed(list(model.named_parameters()))}
            self._replaced = materialize.replaced  # for param groups built from the meta parameters
        self._unit_plan = units
        self.unit_names = units.names if units else []  # stage 3: Engine unit i's module
        self._units = stage3.UnitHooks(self, model, units, units.prefetch) if units else None
        # Each gradient, once complete, lets its bucket go to the comm thread while backward
        # continues (at stage 3 it also lets a finished unit be released).
        ref = weakref.ref(self)  # the model's hooks must not keep the engine alive
        for g, group in enumerate(self._groups):
            for i, p in enumerate(group):
                self._hooks.append(
                    p.register_post_accumulate_grad_hook(lambda _p, g=g, i=i: alive(ref)._grad_ready(g, i)))
        if self._units:
            self._hooks += self._units.handles
        self.stats = {}
        self.training_dataloader = None  # deepspeed.initialize's training_data loader, when it made one
        self.tput_timer = progress.ThroughputTimer()
        self._nonfinite = nonfinite.Guard(self)  # names non-finite params; max_consecutive_skips
        self.optimizer = ZeroOptimizer(self, param_groups)
        self.lr_scheduler = setup.scheduler(c, self.optimizer, lr_scheduler)
        self._no_sync = False
        self._forward_only = None  # why backward() and step() are refused (make_forward_only), or None
        self._backward_since_step = False
        self._step_applied = False
        self._progress = progress.Progress(self)  # steps_per_print, wall_clock_breakdown
        self._monitor = monitor.make(self)  # the config's CSV / TensorBoard monitor, or None
        progress.announce(self, comm_mod.detect_launch_env())

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
            out = self.module(*args, **kwargs)
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
            if self._units:
                self._units.in_backward = True  # recomputed forwards keep their units
            try:
                with torch.enable_grad():  # the scaling multiply must be part of the graph
                    gas = self.config.batch.gradient_accumulation_steps
                    scale = self._impl.loss_scale * (1 if scale_wrt_gas else gas)
                    (loss.float() * scale).backward(retain_graph=retain_graph)
            finally:
                if self._units:
                    self._units.in_backward = False
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
            self.optimizer._in_step = True
            try:
                self.optimizer.step()
            finally:
                self.optimizer._in_step = False
        with self._phase("step"):  # the step's errors name diverging stage-3 units (C++ Note [unit names])
            s = self._nonfinite.step(self._impl.step)
        self._backward_since_step = False
        self._step_applied = s["boundary"] and not s["skipped"]
        if s["boundary"]:
            s["forward_ms"] = 1e3 * getattr(self, "_t_forward", 0.0)
            s["backward_ms"] = 1e3 * getattr(self, "_t_backward", 0.0)
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

    def zero_grad(self, set_to_none=True):
        """zerort zeroes the gradients itself after every step() that ends the window, so
        this does nothing between step() and the next backward(): at stages 2 and 3 the
        window's gradients are in the FP32 shard already (as DeepSpeed's ZeRO-2/3 keep
        them). It is an error after backward() and before step(), where part of the
        gradients may already be reduced on other ranks, and at stages 0 and 1 inside an
        accumulation window, where it would drop the window's local sum."""
        gas = self.config.batch.gradient_accumulation_steps
        inside = self._impl.micro_steps % gas and self.config.stage < 2
        if self._backward_since_step:
            raise UsageError("engine.zero_grad(): called after backward() and before the step(); part of these "
                                "gradients may already be reduced on other ranks. zerort zeroes gradients after "
                                "every step() that ends the window: call zero_grad() (if at all) after step()")
        if inside:
            raise UsageError(f"engine.zero_grad(): called at stages 0 and 1 inside an accumulation window "
                                f"(micro-step {self._impl.micro_steps % gas} of "
                                f"{gas}), where it would drop the window's "
                                "gradients, which this rank holds until the window ends; call it after the step() "
                                "that ends the window")

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
        mem = getattr(self, "_memory", None)
        if mem is None:  # made as zerort.Engine(...), not by zerort.initialize
            mem = self._memory = phases.EngineMemory(self.device)
        mem.begin(name, self._impl)
        try:
            yield
        finally:
            mem.end(name, self._impl)
            done = mem.phases.result.get(name)
            if getattr(self, "_monitor", None) and done is not None:
                self._monitor.phase_peak(done.last_peak)

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
        for ps, was in ((self._params, True), (self._frozen, False)):
            for p in ps:
                if p.requires_grad != was:
                    raise UsageError(
                        f"zerort: parameter {self._names[id(p)]!r} was {'trainable' if was else 'frozen'} at "
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
        if getattr(self, "_monitor", None):
            self._monitor.close()

def alive(ref):
    """The engine behind a model hook's weak reference, or a clear error once it is gone."""
    engine = ref()
    if engine is None:
        raise UsageError("zerort: the engine this model was wrapped by has been deleted, and its hooks "
                           "(and at stage 3 its parameters) went with it; keep the engine alive while you "
                           "use the model, or wrap the model again")
    return engine
