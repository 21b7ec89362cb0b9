"""deepspeed.runtime on zerort: the names scripts import from it."""
from zerort.integrations.deepspeed.names import not_provided
from zerort.integrations.deepspeed.runtime import zero  # noqa: F401

__getattr__ = not_provided(__name__)
