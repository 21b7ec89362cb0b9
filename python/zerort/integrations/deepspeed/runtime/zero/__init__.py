"""deepspeed.runtime.zero on zerort."""
from zerort.integrations.deepspeed.names import not_provided
from zerort.integrations.deepspeed.runtime.zero import partition_parameters  # noqa: F401

__getattr__ = not_provided(__name__)
