"""The Engine's state as the user reads and saves it: the full parameters (low precision or
the FP32 master), checkpoints, a 16-bit model file, the memory report, and the whole
parameters held for a while (stage 3). Part of zerort.engine.engine.Engine (this mixin only
keeps that file to building the engine and the training loop); it uses its fields as its
own methods do."""
import contextlib
import math

import torch

from zerort.engine import stage3, streams
from zerort.errors import ConfigError


class StateMethods:
    def full_state_dict(self, master=False):
        """The full parameters on every rank, at every stage: the low-precision working
        copy, or with master=True the FP32 master weights gathered from every shard."""
        streams.follow_current_stream(self._impl, self.device)  # C++ Note [stream order]
        if not master and self._units:
            with self.gathered_parameters():  # stage 3: whole while inside
                return {k: t.detach().clone() for k, t in self.module.state_dict(keep_vars=True).items()}
        values = {}  # id(param) -> full tensor
        if master:
            for g in range(self._impl.num_groups):
                full = self._impl.gather_master(g)
                for i, p in enumerate(self.param_index.groups[g]):
                    off = self._impl.param_offset(g, i)
                    shape = self.param_index.shapes[id(p)]  # stage 3 empties released parameters
                    values[id(p)] = full[off:off + math.prod(shape)].view(shape).clone()
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) in values:
                out[name] = values[id(t)]
            elif master and id(t) in self._frozen_fp32:
                out[name] = self._frozen_fp32[id(t)].clone()
            else:
                out[name] = t.detach().clone()
        return out

    def full_shape(self, p):
        """p's whole shape (stage 3 empties released parameters; their shape is kept here)."""
        return self.param_index.full_shape(p)

    def _finish_update(self):
        """The overlapped update done, its gathers issued (C++ Engine.finish_update): before a
        collective of the engine's Python side, which the worker's must not fall between."""
        if self._impl is not None and self._overlaps_step:
            self._impl.finish_update()

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """Every rank writes its shard; rank 0 the metadata, the param groups, the lr
        schedule's state and client_state (tensors, numbers, strings and containers of
        them), then `latest` unless save_latest is false (a collective). Returns the
        checkpoint's path. See zerort.state.checkpoint."""
        from zerort.state import checkpoint

        if exclude_frozen_parameters:
            raise ConfigError("save_checkpoint: exclude_frozen_parameters=True is not supported; zerort's checkpoints "
                             "hold the frozen parameters (a load restores the whole model); leave it False")
        streams.follow_current_stream(self._impl, self.device)
        self._finish_update()
        return checkpoint.save(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """Loads `tag` (default: the one in `latest`), saved at any world size and stage
        for this same model (a collective). Returns (path, client_state), or (None, None)
        when load_dir has no `latest` (nothing loaded), as DeepSpeed does."""
        from zerort.state import checkpoint

        if not load_module_strict or custom_load_fn is not None:
            raise ConfigError("load_checkpoint: zerort loads every parameter strictly, by its own loader; "
                             "load_module_strict=False and custom_load_fn are not supported")
        streams.follow_current_stream(self._impl, self.device)
        self._finish_update()
        return checkpoint.load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                               load_module_only)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        """Rank 0 writes the whole model's state_dict, parameters in the compute dtype
        (bf16/fp16; FP32 modules' stay FP32; with stage3.gather_dtype int8 the master's values
        cast to it, not the int8-decoded weights the forward used) and buffers as the module holds them, to
        save_dir/save_filename with torch.save (a .safetensors name: safetensors). At
        stage 3 every rank takes part in the gather. Returns True."""
        import os

        self._finish_update()
        state = self.full_state_dict()
        if self._units and self.config.stage3.gather_dtype == "int8":  # the master's values, not the int8-decoded ones
            master = self.full_state_dict(master=True)
            state = {k: master[k].to(v.dtype) if v.is_floating_point() else v for k, v in state.items()}
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        from zerort.state.checkpoint import Steps

        def write():  # rank 0; a failure is raised on every rank, not left to a barrier's timeout
            if self.rank != 0:
                return
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            tmp = f"{path}.tmp{os.getpid()}"
            if save_filename.endswith(".safetensors"):
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in state.items()}, tmp)
            else:
                torch.save(state, tmp)
            os.replace(tmp, path)

        Steps(self.comm, f"save_16bit_model({save_dir!r})").run("writing the model", write)
        return True

    def memory_report(self):
        """What this run allocated on every rank, beside our exact estimate
        (zerort.accounting.report.MemoryReport): the allocator's figures first (what initialize left
        allocated, each phase's peak growth), then the engine's own counters per category.
        A collective: call it on every rank."""
        from zerort.accounting import report

        return report.report(self, self._memory)

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Inside, every parameter of engine.module is whole (stage 3 gathers them; stages
        1 and 2 always hold them whole). For evaluation and export."""
        streams.follow_current_stream(self._impl, self.device)
        self._params_whole()  # overlap_param_gather's gathers in flight
        if self._units:
            with stage3.gathered(self._impl):
                yield
        else:
            yield
