"""The model must be the same on every rank: one check at initialize.

Every rank hashes its model's description (each parameter's name, shape, dtype and whether
it trains, then each floating buffer's name, shape and dtype) and one all-gather of a
fixed-size digest compares them. Only when the digests differ do the ranks all-gather
their full descriptions, so the error can name the first entry that differs and which
ranks hold which version of it. Every rank reaches the same verdict and raises the same
error, so no rank goes on to wait in a collective its peers never join.
"""
import json

from zerort.comm.agreement import gather_if_different, ranks_text
from zerort.errors import ModelMismatchError


def describe(model):
    """[(kind, name, shape, dtype, trains)] in named_parameters() then named_buffers() order
    (a tied parameter once, as named_parameters yields it)."""
    out = [("parameter", n, list(p.shape), str(p.dtype).replace("torch.", ""), bool(p.requires_grad))
           for n, p in model.named_parameters()]
    out += [("buffer", n, list(b.shape), str(b.dtype).replace("torch.", ""), False)
            for n, b in model.named_buffers() if b is not None and b.is_floating_point()]
    return out


def _entry(e):
    kind, name, shape, dtype, trains = e
    frozen = "" if kind == "buffer" or trains else ", frozen"
    return f"{kind} {name!r} shape {tuple(shape)} {dtype}{frozen}"


def first_difference(lists):
    """The message for the first index where the ranks' descriptions differ, or None."""
    longest = max(len(x) for x in lists)
    for i in range(longest):
        groups = {}  # the entry (or None: the list ended) -> ranks holding it
        for r, x in enumerate(lists):
            key = json.dumps(x[i]) if i < len(x) else None
            groups.setdefault(key, []).append(r)
        if len(groups) == 1:
            continue
        parts = []
        for key, rs in groups.items():
            if key is None:
                counts = sorted({len(lists[r]) for r in rs})
                parts.append(f"{ranks_text(rs)}: no entry #{i} (only {'/'.join(map(str, counts))} "
                             "parameters and floating buffers)")
            else:
                parts.append(f"{ranks_text(rs)}: {_entry(json.loads(key))}")
        return (f"the first difference is entry #{i} (named_parameters(), then floating named_buffers()): "
                + "; ".join(parts))
    return None


def check_model(comm, model):
    """Raises ModelMismatchError on every rank when the ranks' models differ in a parameter's
    or floating buffer's name, shape or dtype, in which parameters train, or in how many
    there are. A collective: one all-gather of 5 int64 when the models agree."""
    entries = describe(model)
    gathered = gather_if_different(comm, json.dumps(entries).encode())
    if gathered is None:
        return
    lists = [json.loads(b.decode()) for b in gathered]
    what = first_difference(lists) or "the descriptions hash differently"
    raise ModelMismatchError(
        f"zerort.initialize on rank {comm.rank} of {comm.size}: the model differs across ranks; {what}. "
        "Build the same model (same parameter names, shapes, dtypes and requires_grad) on every "
        "rank before calling zerort.initialize")
