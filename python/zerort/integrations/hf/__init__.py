"""HuggingFace's Trainer on zerort: a Trainer script switches by changing one import and
adding zerort_config=.

    from zerort.integrations.hf import Trainer                # was: from transformers import Trainer
    trainer = Trainer(model=model, args=training_args, train_dataset=ds,
                      zerort_config={"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}})
    trainer.train()

zerort_config is a dict or a JSON path, in zerort's form or DeepSpeed's; its "auto" values
are filled from the TrainingArguments and the model as HuggingFace fills them for
DeepSpeed (zerort.integrations.hf.config). Under it:

- the model is wrapped by zerort.initialize at the configured stage, the first time the
  Trainer wraps it (train, evaluate or predict);
- the optimizer is zerort's fused AdamW over the Trainer's param groups (its no-decay
  rule), with the TrainingArguments' learning_rate, adam_beta1/2, adam_epsilon and
  weight_decay; the scheduler is the Trainer's (lr_scheduler_type, warm-up) driving it, or
  the config's scheduler section (one of zerort.engine.lr_schedules) when it has one;
- the Trainer owns the accumulation window: each micro-batch's loss goes to
  engine.backward, and the last one of a window runs engine.step(), which clips at
  max_grad_norm, updates, and steps the scheduler when the update was applied (a skipped
  fp16 step does not advance it); the logged grad_norm is the engine's, and the logged
  learning_rate is the one after the update, as HuggingFace's DeepSpeed integration logs
  it (the stock Trainer logs the one the update used: one step earlier);
- each checkpoint-N folder holds zerort's sharded checkpoint (engine.save_checkpoint)
  beside the Trainer's own state and the model's safetensors; train(resume_from_checkpoint=)
  loads it, at any world size and stage;
- save_model() writes HuggingFace safetensors of the FP32 master weights (tied weights
  once, as save_pretrained does), which from_pretrained loads exactly;
- from_pretrained(cls, folder) builds a model on the meta device whose weights zerort
  reads unit by unit at initialize, so no rank holds the whole FP32 model.

Distributed runs come from torchrun or `accelerate launch`. On a machine without a GPU,
several ranks need TrainingArguments(use_cpu=True): accelerate otherwise believes each rank
is alone, and zerort says so.
"""
import contextlib
import os

import torch
import transformers
from transformers.optimization import get_scheduler

from zerort.engine import lr_schedules
from zerort.config import parse, read_config, replace
from zerort.integrations.deepspeed import optimizer_groups
from zerort.engine import initialize
from zerort.errors import ConfigError, Error, UsageError
from zerort.integrations.hf.config import fill, scheduler_spec

WHO = "zerort.integrations.hf.Trainer"  # how errors name it
ADAMW = ("adamw_torch", "adamw_torch_fused")  # args.optim values zerort's fused AdamW stands for


class _ZeroModel(torch.nn.Module):
    """What the training and evaluation loops see as the model: forwards through the
    engine, with the engine's no_sync and zero_grad."""

    def __init__(self, engine):
        super().__init__()
        self.module = engine.module
        object.__setattr__(self, "engine", engine)  # not a submodule: the engine is no nn.Module

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def no_sync(self):
        """The Trainer's non-final micro-batches: the engine's no_sync at stages 0 and 1;
        at stages 2 and 3 every backward reduce-scatters its gradient shard anyway."""
        return self.engine.no_sync() if self.engine.config.stage < 2 else contextlib.nullcontext()

    def zero_grad(self, set_to_none=True):
        self.engine.zero_grad()  # never nn.Module's, which would drop zerort's gradient views

    def train(self, mode=True):
        self.training = mode
        self.engine.train(mode)
        return self

    def _get_name(self):  # the loss (label smoothing) picks its shift by the model's class name
        return self.module._get_name()


class _OptimizerProxy:
    """The Trainer's self.optimizer: its step() and zero_grad() do nothing, because
    engine.step() updates. Not a torch Optimizer, so accelerate leaves it unwrapped.
    (The Trainer saves and loads no optimizer state of its own here: the engine's
    checkpoint holds it.)"""

    def __init__(self, engine):
        self.engine = engine

    param_groups = property(lambda self: self.engine.optimizer.param_groups)

    def step(self, closure=None):
        pass

    def zero_grad(self, set_to_none=True):
        pass


class _SchedulerProxy:
    """The Trainer's self.lr_scheduler for a schedule the engine steps (after each applied
    update): the loop's own step() does nothing."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def step(self, *args, **kwargs):
        pass

    def get_last_lr(self):
        return self.scheduler.get_last_lr()


BY_METRIC = (torch.optim.lr_scheduler.ReduceLROnPlateau,)  # stepped by evaluate()'s metric, not per update
PLATEAU_KEY = "zerort.hf.metric_scheduler"  # its state in the engine checkpoint's client_state (a saved key: kept)


def _read(zerort_config):
    if isinstance(zerort_config, (str, os.PathLike)):
        return read_config(zerort_config)  # names the file; a key given twice is a problem
    if zerort_config is not None and not isinstance(zerort_config, dict):
        raise ConfigError(f"zerort.integrations.hf.Trainer: zerort_config is a {type(zerort_config).__name__}; give "
                        "a dict or the path of a JSON file (zerort's form or DeepSpeed's)")
    return dict(zerort_config or {})


class Trainer(transformers.Trainer):
    """transformers.Trainer with zerort underneath (the module docstring says what runs
    where). The constructor is the Trainer's, plus zerort_config=. trainer.engine is the
    zerort Engine once the model has been wrapped."""

    def __init__(self, *args, zerort_config=None, **kwargs):
        self._zerort_raw = _read(zerort_config)
        self.engine = None
        self._zerort_lr = self._zerort_groups = None
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        if given is not None:
            _ = given.device  # sets up accelerate's state, which computes n_gpu
            given._n_gpu = 1  # one device per process: never nn.DataParallel, never batch x n_gpu
        super().__init__(*args, **kwargs)
        if self.args._n_gpu != 1:  # args= not given: the Trainer's default arguments
            self.args._n_gpu = 1
            self._train_batch_size = self.args.train_batch_size
        self._refuse_unsupported()
        self._zerort_config()  # a bad key or a disagreement with the TrainingArguments: an error now
        if self.optimizer is not None:  # optimizers=(AdamW, None): its groups, checked now
            self._zerort_groups = optimizer_groups(self.optimizer, None, self.model, who=WHO)

    def _refuse_unsupported(self):
        a, refuse = self.args, []
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            refuse.append("TrainingArguments deepspeed= / fsdp=: zerort shards the model itself; give a DeepSpeed "
                          "config as zerort_config= and leave deepspeed and fsdp unset")
        if a.fp16_full_eval or a.bf16_full_eval:
            refuse.append("fp16_full_eval / bf16_full_eval: evaluation runs in the engine's compute dtype already")
        if a.auto_find_batch_size:
            refuse.append("auto_find_batch_size: zerort's shards are laid out once; set per_device_train_batch_size")
        if self.model_init is not None:
            refuse.append("model_init= (hyper-parameter search): zerort wraps one model per Trainer")
        optim = getattr(a.optim, "value", a.optim)  # an OptimizerNames
        if optim not in ADAMW or a.optim_args:
            refuse.append(f"optim={optim!r}{' with optim_args' if a.optim_args else ''}: zerort runs its own fused "
                          f"AdamW; use optim one of {ADAMW} and set its values with learning_rate, adam_beta1, "
                          "adam_beta2, adam_epsilon and weight_decay")
        if self.optimizer_cls_and_kwargs is not None or self.lr_scheduler is not None:
            refuse.append("optimizer_cls_and_kwargs= / optimizers=(_, scheduler): zerort runs the Trainer's own "
                          "schedule (lr_scheduler_type) or the zerort_config scheduler section")
        if a.save_only_model:
            refuse.append("save_only_model: checkpoints without zerort's shards cannot resume or load the best model; "
                          "leave it False")
        if a.torch_compile:
            refuse.append("torch_compile: the Trainer compiles through accelerate, which zerort bypasses; call "
                          "block.compile() on the model's blocks before building the Trainer")
        if getattr(self.model, "hf_device_map", None) and len(set(self.model.hf_device_map.values())) > 1:
            refuse.append("a model spread over devices (hf_device_map): zerort needs the model on one device")
        if self._zerort_raw.get("lr_schedule") is not None:
            refuse.append("zerort_config lr_schedule: the Trainer's schedule sets the lr; use lr_scheduler_type or a "
                          "scheduler section")
        if refuse:
            raise ConfigError([f"{WHO} cannot run with:"] + [f"- {r}" for r in refuse])

    # ---- accelerate: no autocast, no GradScaler, backward through the engine ----------
    def _build_accelerator_args(self, **kwargs):
        a = super()._build_accelerator_args(**kwargs)
        a["mixed_precision"] = "no"  # zerort casts and scales the loss itself
        a["deepspeed_plugin"] = None
        return a

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.backward = self._zerort_backward

    def _move_model_to_device(self, model, device):
        if self.engine is None and not any(p.is_meta for p in model.parameters()):
            super()._move_model_to_device(model, device)

    # ---- the engine -----------------------------------------------------------------
    def _zerort_engine(self):
        if self.engine is not None:
            return self.engine
        c = self._zerort_config()
        gas = c.batch.gradient_accumulation_steps
        # The Trainer owns the window (its last one in an epoch may be short): the engine
        # steps once per window, and every micro-batch's backward adds to it.
        c = replace(c, batch={"gradient_accumulation_steps": 1, "train_batch_size": None,
                              "train_micro_batch_size_per_gpu": c.batch.train_micro_batch_size_per_gpu * gas})
        self.engine = initialize(self.model, c, weights=getattr(self.model, "_zerort_weights", None),
                                 param_groups=self._param_groups())
        if self.engine.world_size != self.args.world_size:
            raise UsageError(f"{WHO}: zerort runs {self.engine.world_size} ranks, the Trainer "
                               f"(accelerate) {self.args.world_size}: on a machine without a GPU, launch several "
                               "ranks with TrainingArguments(use_cpu=True)")
        self.model_wrapped = _ZeroModel(self.engine)
        return self.engine

    def _zerort_config(self):
        """The zerort Config from zerort_config and the TrainingArguments (checked)."""
        cfg, deepspeed_form = fill(self._zerort_raw, self.args, self.model)
        self._zerort_scheduler = cfg.pop("scheduler", None)
        return parse(cfg, form="deepspeed" if deepspeed_form else None)

    def _param_groups(self):
        """The Trainer's groups (its no-decay rule), with the TrainingArguments' values; or
        the groups of a torch AdamW given as optimizers=(AdamW, None)."""
        if self._zerort_groups is not None:
            return self._zerort_groups
        a = self.args
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        values = dict(lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon)
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": a.weight_decay, **values},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0, **values}]
        return [g for g in groups if g["params"]]

    def _wrap_model(self, model, training=True, dataloader=None):
        self._zerort_engine()
        return self.model_wrapped

    def create_optimizer(self, model=None):
        self.optimizer = _OptimizerProxy(self._zerort_engine())
        return self.optimizer

    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.lr_scheduler is None:
            engine = self._zerort_engine()
            if self._zerort_scheduler is not None:
                spec = scheduler_spec(self._zerort_scheduler, self.args, num_training_steps)
                scheduler = lr_schedules.build(spec, engine.optimizer)
            else:
                scheduler = get_scheduler(self.args.lr_scheduler_type, optimizer=engine.optimizer,
                                          num_warmup_steps=self.args.get_warmup_steps(num_training_steps),
                                          num_training_steps=num_training_steps,
                                          scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)
            if isinstance(scheduler, BY_METRIC):  # the Trainer steps it with evaluate()'s metric, as stock
                engine.lr_scheduler, self.lr_scheduler = None, scheduler
            else:
                engine.lr_scheduler, self.lr_scheduler = scheduler, _SchedulerProxy(scheduler)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    # ---- the training loop's calls --------------------------------------------------
    def _zerort_backward(self, loss, **kwargs):
        """accelerator.backward: the micro-batch's backward; at the window's end, the step."""
        self.engine.backward(loss)
        if self.accelerator.sync_gradients:
            self.engine.step()
            # Logged as HF's DeepSpeed integration logs it: the scheduler's lr after the update
            # (the next update's; unchanged by a skipped one), so the two logs compare line for line.
            self._zerort_lr = self.engine.optimizer.param_groups[0]["lr"]

    def _clip_grad_norm(self, model):
        return self.engine.get_global_grad_norm()  # engine.step() clipped at max_grad_norm

    def _get_grad_norm(self, model, grad_norm=None):
        g = self.engine.get_global_grad_norm() if grad_norm is None else grad_norm
        return None if g is None else float(g)

    def _get_learning_rate(self):
        if self._zerort_lr is not None:
            return self._zerort_lr
        return self._zerort_engine().optimizer.param_groups[0]["lr"]

    # ---- checkpoints ----------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir):
        state = {PLATEAU_KEY: self.lr_scheduler.state_dict()} if isinstance(self.lr_scheduler, BY_METRIC) else None
        self.engine.save_checkpoint(output_dir, client_state=state)  # every rank: its shard; rank 0 the rest

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        pass  # the engine loads its own checkpoint in _load_optimizer_and_scheduler

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        path, client_state = self.engine.load_checkpoint(checkpoint)
        if path is None:
            raise FileNotFoundError(_no_zerort_state(checkpoint))
        if isinstance(self.lr_scheduler, BY_METRIC) and PLATEAU_KEY in (client_state or {}):
            self.lr_scheduler.load_state_dict(client_state[PLATEAU_KEY])

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        path, _ = self.engine.load_checkpoint(best, load_module_only=True)
        if path is None:
            raise FileNotFoundError(_no_zerort_state(best))

    def save_model(self, output_dir=None, _internal_call=False):
        """HuggingFace safetensors of the FP32 master weights, with config.json saying
        float32. A collective: every rank gathers the weights, rank 0 writes. Inside the
        Trainer's checkpoints it is skipped when the config's
        zero_optimization.stage3_gather_16bit_weights_on_model_save is false (DeepSpeed's
        switch): the checkpoint's zerort shards hold the weights already."""
        output_dir = output_dir or self.args.output_dir
        if _internal_call and not self._zerort_weights_in_checkpoints():
            return
        try:
            state = self._zerort_engine().full_state_dict(master=True)
        except Error as e:  # a rank that is not here: say what it was asked to join
            raise type(e)(f"{WHO}.save_model gathers the weights from every rank: call it on every rank, not "
                          f"only on rank 0 ({e})") from e
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
            config = getattr(self.model, "config", None)
            if config is not None:  # save_pretrained wrote the working copy's dtype
                working, config.dtype = config.dtype, torch.float32
                config.save_pretrained(output_dir)
                config.dtype = working
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _zerort_weights_in_checkpoints(self):
        zero = self._zerort_raw.get("zero_optimization")
        return not isinstance(zero, dict) or zero.get("stage3_gather_16bit_weights_on_model_save") is not False


def _no_zerort_state(checkpoint):
    stock = os.path.exists(os.path.join(checkpoint, "trainer_state.json"))
    why = ("it holds the Trainer's state but no zerort checkpoint (no 'latest' file): a stock Trainer (or "
           "save_only_model) wrote it, or the save that was writing it died" if stock else
           "it holds no zerort checkpoint (no 'latest' file)")
    return (f"{WHO}: {checkpoint}: {why}; resume from a checkpoint-N that {WHO} wrote, or start from its weights "
            f"with zerort.integrations.hf.from_pretrained(ModelClass, {checkpoint!r})")


def from_pretrained(model_class, folder, **config_kwargs):
    """model_class (an AutoModel class or a PreTrainedModel class) built from folder's
    config.json on the meta device, with its weights read from folder's safetensors unit
    by unit when zerort.initialize (or zerort.integrations.hf.Trainer) wraps it. Unlike
    model_class.from_pretrained, no rank reads the whole checkpoint."""
    from zerort.engine.meta_init import parameters_on_meta

    config = transformers.AutoConfig.from_pretrained(folder, **config_kwargs)
    build = getattr(model_class, "from_config", None) or model_class._from_config
    with parameters_on_meta():  # the weights come from the folder: nothing of the init is recorded
        model = build(config, dtype=torch.float32)
    model._zerort_weights = os.fspath(folder)
    if os.path.exists(os.path.join(folder, transformers.utils.GENERATION_CONFIG_NAME)):
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model
