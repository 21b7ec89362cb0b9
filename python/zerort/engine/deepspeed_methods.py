"""DeepSpeed's engine methods that zerort's own training loop does not need: the ones real
DeepSpeed scripts call (get_mom, destroy, zero_grad, empty_partition_cache, monitor,
dp_world_size, set_gradient_accumulation_boundary) and DeepSpeed's accessors
(is_gradient_accumulation_boundary, fp16_enabled, train_batch_size, global_steps, ...), each
with DeepSpeed's meaning. They are
part of zerort.engine.engine.Engine (this mixin keeps that file to building the engine and
the training loop) and use its fields as its own methods do."""
import torch

from zerort import comm as comm_mod
from zerort.errors import ConfigError, UsageError
from zerort.monitoring import monitor


class DeepSpeedMethods:
    def get_mom(self):
        """Each param group's (beta1, beta2), as DeepSpeed's get_mom() for Adam."""
        return [tuple(g["betas"]) for g in self.optimizer.param_groups]

    def set_gradient_accumulation_boundary(self, is_boundary):
        """DeepSpeed's way to end the window by hand. zerort ends it every
        gradient_accumulation_steps micro-steps (the count every rank agrees on), so this
        accepts what that count says and refuses the rest, naming both."""
        if bool(is_boundary) != self.is_gradient_accumulation_boundary():
            raise UsageError(f"set_gradient_accumulation_boundary({is_boundary}): zerort ends the accumulation window "
                             f"every gradient_accumulation_steps={self.config.batch.gradient_accumulation_steps} "
                             "micro-steps, and the next step() is "
                             f"{'' if self.is_gradient_accumulation_boundary() else 'not '}"
                             "a boundary; set gradient_accumulation_steps to the window you want instead")

    def zero_grad(self, set_to_none=True):
        """zerort zeroes the gradients itself after every step() that ends the window, so
        this does nothing between step() and the next backward(): at stages 2 and 3 the
        window's gradients are in the FP32 shard already (as DeepSpeed's ZeRO-2/3 keep
        them). It is an error after backward() and before step(), where part of the
        gradients may already be reduced on other ranks, and at stages 0 and 1 inside an
        accumulation window, where it would drop the window's local sum."""
        inside = self._impl.micro_step_in_window and self.config.stage < 2  # See Note [accumulation boundary]
        if self._backward_since_step:
            raise UsageError("engine.zero_grad(): called after backward() and before the step(); part of these "
                                "gradients may already be reduced on other ranks. zerort zeroes gradients after "
                                "every step() that ends the window: call zero_grad() (if at all) after step()")
        if inside:
            raise UsageError(f"engine.zero_grad(): called at stages 0 and 1 inside an accumulation window "
                                f"(micro-step {self._impl.micro_step_in_window} of "
                                f"{self.config.batch.gradient_accumulation_steps}), where it would drop the window's "
                                "gradients, which this rank holds until the window ends; call it after the step() "
                                "that ends the window")

    def empty_partition_cache(self):
        """Stage 3: releases the gathered units no forward is using (prefetched ones too),
        as DeepSpeed's; nothing to do at stages 0-2, which hold the parameters whole."""
        if self._units:
            self._units.release_idle()

    def destroy(self):
        """Releases what initialize took, as DeepSpeed's destroy(): the model's hooks go,
        the C++ engine (its buffers and comm thread) is closed, and every parameter of the
        module holds its FP32 master value again as a plain float32 tensor (at stage 3 the
        whole value), so the same model can be given to initialize again. A collective
        (the master is gathered): call it on every rank. The engine is unusable after it."""
        if self._impl is None:
            return
        values = self.full_state_dict(master=True)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._close()
        named = dict(self.module.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, p in named.items():
                p.data = values[name]
            for m in self.module.modules():
                for name, b in list(m.named_buffers(recurse=False)):
                    if (id(m), name) in self._cast_buffers and b is not None:
                        setattr(m, name, b.float())
        self.optimizer = self.lr_scheduler = self.training_dataloader = None

    @property
    def monitor(self):
        """DeepSpeed's engine.monitor: .enabled, and write_events([(name, value, step), ...])
        (rank 0 writes them to the config's TensorBoard and CSV monitor)."""
        return self._monitor or monitor.DISABLED

    @property
    def dp_world_size(self):
        """Data-parallel ranks: every rank (zerort has no model parallelism)."""
        return self.comm.size

    def is_gradient_accumulation_boundary(self):
        """Whether the next step() ends the accumulation window (and updates)."""
        return self._impl.is_boundary()  # See Note [accumulation boundary] (runtime/engine.h)

    def was_step_applied(self):
        """Whether the last step() updated the parameters: False after a micro-step that only
        accumulated, and after a step skipped for non-finite gradients."""
        return self._step_applied

    def get_lr(self):
        """Each param group's learning rate for the next update."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        """The global L2 norm of the last update's averaged, unscaled gradient, before
        clipping (None before the first one)."""
        return self.stats.get("grad_norm")

    def zero_optimization_stage(self):
        return self.config.stage

    def fp16_enabled(self):
        return self.config.precision == "fp16"

    def bfloat16_enabled(self):
        return self.config.precision == "bf16"

    def torch_autocast_enabled(self):
        return self._autocast_dtype is not None

    def torch_autocast_dtype(self):
        """torch.bfloat16 with torch_autocast on (zerort autocasts to bf16 only), else None."""
        return self._autocast_dtype

    def gradient_clipping(self):
        return self.config.optimizer.gradient_clipping

    def train_micro_batch_size_per_gpu(self):
        return self.config.batch.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self):
        return self.config.batch.gradient_accumulation_steps

    def train_batch_size(self):
        """Samples per update on all ranks: micro batch x accumulation x world size."""
        micro = self.config.batch.train_micro_batch_size_per_gpu
        if micro is None:
            raise ConfigError(["train_micro_batch_size_per_gpu: not set; zerort needs it (or train_batch_size) "
                               "in the config to count samples"])
        return micro * self.config.batch.gradient_accumulation_steps * self.world_size

    @property
    def global_rank(self):
        return self.comm.rank

    @property
    def local_rank(self):
        """This rank's index on its host (the launcher's LOCAL_RANK and the like)."""
        return comm_mod.detect_launch_env()["local_rank"]

    @property
    def global_steps(self):
        """Accumulation boundaries passed, skipped ones included (DeepSpeed's name)."""
        return self._impl.global_step

    @property
    def global_samples(self):
        return self.global_steps * self.train_batch_size()
