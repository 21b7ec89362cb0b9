"""deepspeed.compression on zerort: only the helpers scripts import from it."""
from zerort.integrations.deepspeed.compression import helper  # noqa: F401
from zerort.integrations.deepspeed.names import not_provided

__getattr__ = not_provided(__name__)
