"""The engine: zerort.initialize and the Engine it returns (engine), engine.optimizer's
param groups (optimizer), DeepSpeed's schedules (lr_schedules), stage 3's module hooks
(stage3), meta-device models (meta_init), the non-finite guard (nonfinite), the one-model
check (same_model), and ending a job when one rank fails (failfast)."""
from zerort.config import parse
from zerort.engine.engine import Engine
from zerort.errors import UsageError


def initialize(model=None, config=None, comm=None, weights=None, param_groups=None, lr_scheduler=None,
               **others):
    """Wraps model (a torch.nn.Module with float32 parameters, the same on every rank; rank
    0's values win) for ZeRO training. config: a dict, a JSON path (our keys or DeepSpeed's
    schema) or a zerort.config.Config. comm: a zerort.comm.Communicator (default: created
    from config's comm.backend and comm.timeout_s). weights: for a model built on the meta
    device, its starting values instead of its modules' own initialization: a state dict, a
    .safetensors file, or a folder of safetensors files (HuggingFace's, with or without its
    index JSON), read one unit at a time (zerort.engine.meta_init). param_groups: torch's param
    groups (dicts with "params" and any of lr, betas, eps, weight_decay) or a list of
    parameters; default one group of every trainable parameter (zerort.engine.optimizer).
    lr_scheduler: a schedule on engine.optimizer (a torch LRScheduler or one of
    zerort.engine.lr_schedules), or a function optimizer -> schedule; the engine steps it after
    every applied update. Not with a config scheduler or lr_schedule.

    Memory: before the engine allocates anything it installs zerort's counting CPU
    allocator (zerort.accounting.phases), and notes what is allocated; engine.memory_report() then
    shows what the engine holds and each phase's peak as the allocator (on CUDA: torch's
    memory statistics) saw them. Arguments of deepspeed.initialize (model_parameters,
    optimizer, args, ...) are a UsageError pointing to zerort.integrations.deepspeed."""
    if others or model is None:
        got = ", ".join(sorted(others)) or "no model"
        raise UsageError(f"zerort.initialize(): got {got}; its arguments are model, config, comm, weights, "
                         "param_groups and lr_scheduler. deepspeed.initialize's arguments (model_parameters, "
                         "optimizer, args, training_data, ...) and its 4-tuple result are "
                         "zerort.integrations.deepspeed.initialize's: import it as deepspeed, or pass param_groups= "
                         "here instead of model_parameters=")
    return Engine(model, parse(config), comm, weights, param_groups, lr_scheduler)
