"""deepspeed.compression.helper on zerort: the two attribute helpers DeepSpeed-Chat imports
(its LoRA code), by dotted module path. Model compression itself is not provided."""
from zerort.integrations.deepspeed.names import not_provided


def recursive_getattr(model, module_name):
    """model's submodule (or attribute) at the dotted path module_name ("h.0.attn")."""
    out = model
    for part in module_name.split("."):
        out = getattr(out, part)
    return out


def recursive_setattr(model, module_name, module):
    """Replaces model's submodule (or attribute) at the dotted path module_name."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)


__getattr__ = not_provided(__name__)
