"""The engine behind a model hook's weak reference (the hooks of zerort.engine.engine and
zerort.engine.stage3 hold weak references, so the model does not keep its engine alive)."""
from zerort.errors import UsageError


def alive(ref):
    """The engine behind a model hook's weak reference, or a clear error once it is gone."""
    engine = ref()
    if engine is None:
        raise UsageError("zerort: the engine this model was wrapped by has been deleted, and its hooks "
                         "(and at stage 3 its parameters) went with it; keep the engine alive while you "
                         "use the model, or wrap the model again")
    return engine
