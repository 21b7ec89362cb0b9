"""deepspeed.ops.adam on zerort: FusedAdam and DeepSpeedCPUAdam.

Each is a torch.optim.Adam with DeepSpeed's constructor (adam_w_mode / adamw_mode picks
decoupled weight decay, AdamW, the default). Passed to deepspeed.initialize(optimizer=...),
zerort's fused AdamW takes over its param groups (Note [shared param groups],
zerort.engine.optimizer), as DeepSpeed's engine takes over the client optimizer; stepped
on its own, it is torch's Adam / AdamW. There is nothing to build: zerort's kernels are
compiled with the package (DeepSpeed JIT-compiles its ops).
"""
import torch

from zerort.errors import ConfigError
from zerort.integrations.deepspeed.names import not_provided


def _check(who, amsgrad):
    if amsgrad:
        raise ConfigError([f"deepspeed.ops.adam.{who}(amsgrad=True): zerort's AdamW (and DeepSpeed's {who}) has "
                           "no AMSGrad; leave amsgrad False"])


class FusedAdam(torch.optim.Adam):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        _check("FusedAdam", amsgrad)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=bool(adam_w_mode))
        for g in self.param_groups:
            g.setdefault("bias_correction", bool(bias_correction))
        self.set_grad_none = set_grad_none


class DeepSpeedCPUAdam(torch.optim.Adam):
    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        _check("DeepSpeedCPUAdam", amsgrad)
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=bool(adamw_mode))
        for g in self.param_groups:
            g.setdefault("bias_correction", bool(bias_correction))


__getattr__ = not_provided(__name__)
