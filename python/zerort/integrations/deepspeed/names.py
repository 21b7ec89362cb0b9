"""What a DeepSpeed name that zerort does not provide raises: an error that names it.

    __getattr__ = not_provided(__name__)     # at the end of each module of the namespace

deepspeed.X resolves to zerort.integrations.deepspeed.X (zerort.integrations.deepspeed.alias);
an attribute that is not there raises NotProvidedError, an AttributeError (so hasattr()
and getattr(m, name, default) still answer) whose message says zerort does not provide
it, instead of a bare AttributeError from deep inside a script.
"""
from zerort.errors import UsageError

ZERORT = "zerort.integrations.deepspeed"


class NotProvidedError(UsageError, AttributeError):
    """A DeepSpeed name zerort's drop-in does not provide."""


def deepspeed_name(module_name):
    """zerort.integrations.deepspeed.comm -> deepspeed.comm."""
    return "deepspeed" + module_name[len(ZERORT):]


def not_provided(module_name):
    """A module __getattr__ that raises NotProvidedError for every name it is asked for."""
    def __getattr__(name):
        if name.startswith("__"):  # the import system's own probes (__path__, __file__, ...)
            raise AttributeError(name)
        raise NotProvidedError(f"{deepspeed_name(module_name)}.{name}: zerort's DeepSpeed drop-in ({module_name}) "
                               "does not provide it; see the README's DeepSpeed section for what it does provide, "
                               "or run this script under real DeepSpeed")
    return __getattr__
