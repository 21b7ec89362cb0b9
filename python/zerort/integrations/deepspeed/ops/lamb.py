"""deepspeed.ops.lamb on zerort: FusedLamb is refused by name (zerort's update is AdamW)."""
from zerort.errors import ConfigError
from zerort.integrations.deepspeed.names import not_provided


class FusedLamb:
    def __init__(self, *args, **kwargs):
        raise ConfigError(["deepspeed.ops.lamb.FusedLamb: zerort's update is its fused AdamW and it has no LAMB; use "
                           "deepspeed.ops.adam.FusedAdam (or torch.optim.AdamW), or run under real DeepSpeed"])


__getattr__ = not_provided(__name__)
