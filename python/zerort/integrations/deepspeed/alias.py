"""`import deepspeed` resolved to zerort's drop-in, inside one process.

    from zerort.integrations.deepspeed import alias
    alias.install()          # then: import deepspeed, import deepspeed.comm as dist, ...

install() puts a finder first on sys.meta_path that answers for "deepspeed" and every
"deepspeed.X.Y": each is the module zerort.integrations.deepspeed.X.Y itself (the same
object, so `deepspeed.comm is zerort.integrations.deepspeed.comm`). A module zerort does
not have is a ModuleNotFoundError that names it and says so. importlib.metadata finds a
"deepspeed" distribution of the drop-in's version there too. A real DeepSpeed installation
is never imported or changed: the finder answers before it is looked for. The launcher
(zerort.integrations.deepspeed.launcher) installs it in every rank it starts; nothing else
does.
"""
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import sys

from zerort.integrations.deepspeed.names import ZERORT
from zerort.errors import UsageError

NAME = "deepspeed"


class _Existing(importlib.abc.Loader):
    """Hands the import system a module that is loaded already."""

    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        return None


class _Distribution(importlib.metadata.Distribution):
    """The package metadata libraries look up (transformers asks importlib.metadata for
    deepspeed's version before it uses its integration): the drop-in's, named deepspeed at
    the DeepSpeed release whose API it follows."""

    def read_text(self, filename):
        if filename == "METADATA":
            from zerort.integrations.deepspeed import __version__

            return f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {__version__}\nSummary: zerort's drop-in\n"
        return None

    def locate_file(self, path):
        return None


class DeepSpeedAlias(importlib.abc.MetaPathFinder):
    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name in (None, NAME):
            yield _Distribution()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME and not fullname.startswith(NAME + "."):
            return None
        ours = ZERORT + fullname[len(NAME):]
        try:
            module = importlib.import_module(ours)
        except ModuleNotFoundError as e:
            if e.name is None or not ours.startswith(e.name):  # a missing dependency inside ours, not ours
                raise
            raise ModuleNotFoundError(f"No module named {fullname!r}: zerort's DeepSpeed drop-in runs this script "
                                      f"and does not provide {fullname} (it would be {ours}); see the README's "
                                      "DeepSpeed section, or run the script under real DeepSpeed",
                                      name=fullname) from None
        return importlib.util.spec_from_loader(fullname, _Existing(module), is_package=hasattr(module, "__path__"))


def install():
    """deepspeed and deepspeed.* are zerort's from now on in this process (idempotent)."""
    if not any(isinstance(f, DeepSpeedAlias) for f in sys.meta_path):
        stale = [m for m in sys.modules if m == NAME or m.startswith(NAME + ".")]
        if stale:
            raise UsageError(f"zerort.integrations.deepspeed.alias.install(): {stale[0]!r} was imported before; "
                               "install the alias before anything imports deepspeed")
        sys.meta_path.insert(0, DeepSpeedAlias())
