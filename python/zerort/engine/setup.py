"""What building an Engine decides before it allocates: the model's one device, whether a
live engine already trains the model, and the lr schedule the engine steps."""
import torch

from zerort import lifecycle
from zerort.engine import lr_schedules
from zerort.errors import ConfigError, DeviceError


def engine_of(params):
    """The live engine that trains any of params, or None."""
    ids = {id(p) for p in params}
    for engine in lifecycle.engines():  # one whose __init__ failed has no _impl
        if getattr(engine, "_impl", None) is not None and ids & set(engine._names):
            return engine
    return None


def model_device(model):
    """The one device of every parameter and buffer (CPU for a model with none)."""
    device = None
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:  # built on the meta device: made real on the model's device (zerort.engine.meta_init)
            continue
        if device is None:
            device = t.device
        elif t.device != device:
            raise DeviceError(f"zerort: {name!r} is on {t.device} but the model's first tensor is on {device}; "
                            "move the whole model to one device (model.to(device)) first")
    if device is not None and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device or torch.device("cpu")


def scheduler(config, optimizer, given):
    """The engine's lr schedule: the config's scheduler section, or the one given (a
    schedule, or a function optimizer -> schedule), or None."""
    if given is not None and (config.optimizer.scheduler is not None or config.optimizer.lr_schedule is not None):
        key = "scheduler" if config.optimizer.scheduler is not None else "lr_schedule"
        raise ConfigError([f"{key}: the config has one and initialize() was given lr_scheduler= too; keep one of "
                           "them"])
    if given is None:
        return lr_schedules.build(config.optimizer.scheduler, optimizer)
    schedule = given(optimizer) if callable(given) and not hasattr(given, "step") else given
    moved = getattr(schedule, "optimizer", optimizer)
    if moved is not optimizer and [id(g) for g in moved.param_groups] != [id(g) for g in optimizer.param_groups]:
        raise ConfigError([f"lr_scheduler: the {type(schedule).__name__} given moves a {type(moved).__name__} whose "
                           "param groups are not the ones zerort's update reads, so its lr would never reach "
                           "the training; build it on engine.optimizer after initialize, or pass that optimizer "
                           "(its groups become zerort's: Note [shared param groups], zerort.engine.optimizer) "
                           "as optimizer= together with the schedule"])
    return schedule
