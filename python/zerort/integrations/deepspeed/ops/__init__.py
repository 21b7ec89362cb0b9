"""deepspeed.ops on zerort: the optimizers scripts import (deepspeed.ops.adam, .lamb)."""
from zerort.integrations.deepspeed.names import not_provided
from zerort.integrations.deepspeed.ops import adam, lamb  # noqa: F401  (deepspeed.ops.adam.FusedAdam, ...)

__getattr__ = not_provided(__name__)
