"""DeepSpeed's entry points on zerort: a DeepSpeed training script runs unchanged under
python -m zerort.integrations.deepspeed.launcher (which resolves `import deepspeed` to this
package), or with its one import changed:

    import zerort.integrations.deepspeed as deepspeed

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, model_parameters=param_groups, training_data=dataset, config="ds_config.json")
    for x, y in loader:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()

initialize() returns (engine, optimizer, training_dataloader, lr_scheduler) as DeepSpeed's
does. The config is DeepSpeed's JSON (zerort.config.deepspeed_form and its key table
zerort.config.deepspeed_keys) or zerort's own. The optimizer is zerort's fused AdamW over the
param groups: from model_parameters, from a torch AdamW, Adam without weight decay, FusedAdam
or DeepSpeedCPUAdam passed as optimizer (its group dicts themselves, so a schedule built on it
drives the update: Note [shared param groups]), or from a function that builds one from
model_parameters. Without any, stages 0 and 3 give a forward-only engine and stages 1-2 an
error, as in DeepSpeed. The modules scripts import (comm, accelerator, ops, utils, runtime,
zero, compression) are this package's; a name it does not have raises NotProvidedError
(zerort.integrations.deepspeed.names). training_data gives a
DataLoader over a DistributedSampler (DeepSpeed's: shuffled, seed 0), one micro batch
(train_micro_batch_size_per_gpu) per step.
"""
import os

import torch

from zerort.config import parse, read_config
from zerort.engine.engine import Engine as DeepSpeedEngine  # noqa: F401  (isinstance checks in scripts)
from zerort.engine import initialize as _zerort_initialize
from zerort.errors import ConfigError
# The modules DeepSpeed scripts import (deepspeed.comm, deepspeed.zero, ...), loaded with the package as
# DeepSpeed's are.
from zerort.integrations.deepspeed import accelerator, comm, compression, ops, runtime, utils, zero  # noqa: F401
from zerort.integrations.deepspeed.accelerator import get_accelerator  # noqa: F401  (deepspeed.get_accelerator)
from zerort.integrations.deepspeed.comm import init_distributed  # noqa: F401
from zerort.integrations.deepspeed.names import not_provided

__version__ = "0.19.8"  # the DeepSpeed release whose API this drop-in follows (scripts compare it)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """DeepSpeed's deepspeed.initialize: (engine, optimizer, training_dataloader or None,
    lr_scheduler or None). config (or config_params, or args.deepspeed_config): a dict or
    a JSON path. torch.distributed's default group is made first when there is none
    (deepspeed.comm.init_distributed; dist_init_required=False skips it), as DeepSpeed
    does; zerort's engine trains over its own communicator from the launcher's
    environment."""
    if model is None:
        raise ConfigError("deepspeed.initialize: model= is required (a torch.nn.Module)")
    if mpu is not None or mesh_param is not None:
        raise ConfigError("deepspeed.initialize: mpu= / mesh_param= ask for model or sequence parallelism, which "
                         "zerort does not have; zerort shards over data-parallel ranks only")
    config = _config_source(args, config, config_params)
    if isinstance(config, (str, os.PathLike)):  # read once: parse and the optimizer check see the same keys
        config = read_config(config)
    c = parse(config, form="deepspeed")
    has_section = isinstance(config, dict) and "optimizer" in config
    if optimizer is not None and has_section:
        raise ConfigError(["optimizer: the config has an optimizer section and initialize() was given optimizer= "
                           "too; keep one of them (as DeepSpeed requires)"])
    ways = ("add an \"optimizer\" section to the config (e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}), "
            "or pass optimizer= (a torch.optim.AdamW, deepspeed.ops.adam.FusedAdam, or a function of model_parameters)")
    forward_only = optimizer is None and not has_section
    if forward_only and c.stage in (1, 2):
        raise ConfigError([f"optimizer: none given, and ZeRO stage {c.stage} shards an optimizer's state; {ways}. "
                           "zerort does not pick one for you (DeepSpeed refuses too). A model that only runs "
                           "forward (a reference or reward model) takes stage 0 or 3 without an optimizer"])
    groups = optimizer_groups(optimizer, model_parameters, model)
    comm.init_distributed(dist_init_required=dist_init_required, verbose=False)  # as DeepSpeed's initialize
    engine = _zerort_initialize(model, c, param_groups=groups, lr_scheduler=lr_scheduler)
    if training_data is not None:
        engine.training_dataloader = dataloader(engine, training_data, collate_fn)
    if c.stage == 3:
        zero.mark_stage3_params(engine)
    if forward_only:  # as DeepSpeed: an engine without an optimizer runs forward (no optimizer is returned)
        engine.make_forward_only(f"deepspeed.initialize was given no optimizer, so this engine runs forward only; "
                                 f"to train it, {ways}")
        return engine, None, engine.training_dataloader, engine.lr_scheduler
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _config_source(args, config, config_params):
    given = [x for x in (config, config_params) if x is not None]
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None:
        given.append(from_args)
    if len(given) > 1:
        raise ConfigError(["config: given more than once (config=, config_params= and args.deepspeed_config); "
                           "pass one"])
    if not given:
        raise ConfigError(["config: none given; pass config= (a dict or a JSON path), or args with "
                           "--deepspeed_config"])
    return given[0]


def optimizer_groups(optimizer, model_parameters, model, who="deepspeed.initialize"):
    """The param groups for zerort's AdamW, from DeepSpeed's optimizer= / model_parameters=
    (who: the caller named in errors)."""
    if optimizer is None:
        return model_parameters
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
    name = type(optimizer).__name__
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise ConfigError(f"{who}: optimizer is a {name}; zerort runs its own fused AdamW, and takes "
                        "a torch.optim.AdamW (or Adam without weight decay) only for its param groups. Pass "
                        "model_parameters= and an \"optimizer\" config section instead")
    for k, g in enumerate(optimizer.param_groups):
        decoupled = g.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        if not decoupled and g["weight_decay"]:
            raise ConfigError(f"{who}: the {name} optimizer has coupled weight_decay "
                             f"{g['weight_decay']:g} in param group {k}: Adam's L2 decay is added to the gradient, "
                             "zerort's AdamW decays the weights directly; use torch.optim.AdamW or weight_decay 0")
        if g.get("amsgrad") or g.get("maximize"):
            raise ConfigError(f"{who}: param group {k} of the {name} asks for amsgrad or maximize, "
                             "which zerort's AdamW does not do")
        g["params"], g["betas"] = list(g["params"]), tuple(g["betas"])
    return optimizer.param_groups  # the groups themselves: Note [shared param groups] (zerort.engine.optimizer)


def dataloader(engine, dataset, collate_fn=None):
    """DeepSpeed's training_data loader: a DistributedSampler over this rank's share, one
    micro batch per step."""
    micro = engine.config.batch.train_micro_batch_size_per_gpu
    if micro is None:
        raise ConfigError(["train_micro_batch_size_per_gpu: not set; training_data= needs it (or train_batch_size) "
                           "to batch the dataset"])
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=engine.world_size,
                                                              rank=engine.rank)
    return torch.utils.data.DataLoader(dataset, batch_size=micro, sampler=sampler, collate_fn=collate_fn,
                                       drop_last=engine.config.batch.dataloader_drop_last)


def add_config_arguments(parser):
    """DeepSpeed's --deepspeed and --deepspeed_config arguments, on an argparse parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable DeepSpeed (zerort)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the DeepSpeed JSON config file")
    return parser


__getattr__ = not_provided(__name__)


