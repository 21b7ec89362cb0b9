"""deepspeed.runtime.zero.partition_parameters on zerort: ZeroParamStatus, and zero.Init and
GatheredParameters under the names DeepSpeed defines them here."""
import enum

from zerort.integrations.deepspeed.names import not_provided
from zerort.integrations.deepspeed.zero import GatheredParameters, Init  # noqa: F401


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # whole on this rank
    NOT_AVAILABLE = 2  # only this rank's shard
    INFLIGHT = 3  # being gathered


__getattr__ = not_provided(__name__)
