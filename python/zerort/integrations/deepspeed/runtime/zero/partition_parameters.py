"""deepspeed.runtime.zero.partition_parameters on zerort: ZeroParamStatus, and zero.Init and
GatheredParameters under the names DeepSpeed defines them here."""
from zerort.integrations.deepspeed.names import not_provided
from zerort.integrations.deepspeed.zero import GatheredParameters, Init, ZeroParamStatus  # noqa: F401


__getattr__ = not_provided(__name__)
