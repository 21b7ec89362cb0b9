"""deepspeed.zero.Init's recording: a model built inside gets, at initialize, bit for bit
the weights the same code gives without it, while no rank ever holds the whole model.

Note [recorded initialization]: inside zero.Init every parameter goes to the meta device
as it is registered (zerort.integrations.deepspeed.zero), and a torch dispatch mode keeps,
for each parameter, a Recipe of how the plain build makes its values:
- where its storage came from: a factory op (torch.empty, zeros, ones, randn, ...) with
  the CPU random state before it when it draws numbers, or else (a tensor computed from
  others) its values, copied at registration;
- every in-place op on it or on a view of it afterwards (init.normal_, .data.zero_(),
  weight[pad].fill_(0), HuggingFace's _init_weights, ...), with the view's geometry and,
  for ops that draw random numbers, the random state before the op.
A random op on a meta tensor draws nothing, so the recorder runs the same op on a real
scratch tensor of the parameter's geometry and drops it: the random stream advances as in
the plain build, for the parameters that follow and for the script after construction.
zerort.engine.meta_init's Materializer replays a parameter's Recipe when its unit is made
real (Recipe.materialize): the same ops from the same random states on the same device
and geometry give the same bits. Memory: one parameter's values at a time. A start that
zero.Init's constructors converted to its build dtype records the conversion too, and the
replay converts at the same point (Note [build dtype], dtype_patches).

Limits, each an error rather than a silent difference: an in-place op whose other operands
are meta tensors (values copied between parameters during construction) cannot be
replayed. torch.nn.init's trunc_normal_, orthogonal_, dirac_ and sparse_ return early on
meta tensors, so while recording they are replaced (in torch.nn.init and in transformers'
table of them) by versions that run on a real tensor and record themselves.
"""
import contextlib
import itertools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerort.engine.meta_init import RECIPE
from zerort.errors import UsageError

RANDOM_OPS = {"uniform_", "normal_", "random_", "bernoulli_", "exponential_", "cauchy_", "log_normal_", "geometric_",
              "randn", "rand", "randint", "normal", "randperm", "bernoulli", "multinomial", "rand_like",
              "randn_like", "randint_like"}
EARLY_RETURN_ON_META = ("orthogonal_", "dirac_", "sparse_")  # and _no_grad_trunc_normal_, patched by name


ORDER = "_zerort_built"  # a parameter's place among those built under Init in this process
_built = itertools.count()
EMPTY_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


def _key(t):
    """A storage's identity: its StorageImpl and data addresses (both reused only after it
    is freed, and then by the new storage's maker, which records itself again)."""
    s = t.untyped_storage()
    return s._cdata, s.data_ptr()


def _name(func):
    packet = getattr(func, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(func, "__name__", "")


def _geometry(t):
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _is_random(func, kwargs):
    if kwargs.get("generator") is not None:
        raise UsageError(f"deepspeed.zero.Init: {_name(func)} draws from a generator= of its own during "
                         "construction; zerort replays initialization from torch's default generator only; drop "
                         "generator= or build the model outside zero.Init")
    return _name(func) in RANDOM_OPS


class Recipe:
    """How the plain build makes one parameter: a start, then in-place ops."""

    def __init__(self, start, cast=None):
        self.start = start  # ("factory", func, args, kwargs, rng) or ("values", tensor)
        self.cast = cast  # the dtype zero.Init's constructors turned the start into (Note [build dtype])
        self.ops = []  # (fn, geometry or None, args, kwargs, rng): geometry None = a call on the whole tensor

    def replay(self):
        """The parameter's values in the dtype the build made them in, replayed on the
        device its plain build used."""
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            kind = self.start[0]
            if kind == "values":
                t = self.start[1].clone()
            else:
                _, func, args, kwargs, rng = self.start
                if rng is not None:
                    torch.set_rng_state(rng)
                t = func(*args, **kwargs)
            if self.cast is not None:
                t = t.to(self.cast)
            for fn, geometry, args, kwargs, rng in self.ops:
                if rng is not None:
                    torch.set_rng_state(rng)
                target = t if geometry is None else t.as_strided(*geometry)
                fn(target, *args, **kwargs)
        return t

    def materialize(self, device):
        """The parameter's values as FP32 on `device` (exact: every build dtype is a subset)."""
        return self.replay().to(device=device, dtype=torch.float32)


class Recorder(TorchDispatchMode):
    """The dispatch mode zero.Init runs under: Recipes by storage (Note [recorded
    initialization])."""

    def __init__(self):
        super().__init__()
        self.recipes = {}  # storage key -> Recipe, for every storage made inside (and the meta parameters)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        mutated = func._schema.arguments[0].alias_info if func._schema.arguments else None
        if mutated is not None and mutated.is_write and tensors and args and isinstance(args[0], torch.Tensor):
            self._record_in_place(func, args, kwargs)
        rng = torch.get_rng_state() if not tensors and _is_random(func, kwargs) else None
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            inputs = {_key(t) for t in tensors}
            if _key(out) not in inputs or _name(func).startswith("lift_fresh"):  # a new storage: its maker
                fresh = not tensors and not out.is_meta
                self.recipes[_key(out)] = Recipe(("factory", func, args, kwargs, rng)) if fresh else None
        return out

    def _record_in_place(self, func, args, kwargs):
        target = args[0]
        recipe = self.recipes.get(_key(target))
        if recipe is None:
            return
        if not target.is_meta:  # a real tensor changed after its maker: only its values tell what it holds
            self.recipes[_key(target)] = None
            return
        others = [a for a in torch.utils._pytree.tree_leaves((args[1:], kwargs)) if isinstance(a, torch.Tensor)]
        if any(t.is_meta for t in others):
            raise UsageError(f"deepspeed.zero.Init: {func} writes values computed from another parameter into a "
                             "parameter during construction; zerort replays each parameter's initialization on its "
                             "own and cannot replay this; build the model outside zero.Init (or initialize it "
                             "after zerort.initialize, inside GatheredParameters(modifier_rank=0))")
        rest = torch.utils._pytree.tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a,
                                            (args[1:], kwargs))
        rng = None
        if _is_random(func, kwargs):
            rng = torch.get_rng_state()
            _advance(lambda t: func(t, *args[1:], **kwargs), target)
        recipe.ops.append((func, _geometry(target), rest[0], rest[1], rng))

    def record_call(self, fn, tensor, args, kwargs):
        """A whole-tensor init function that returns early on meta (EARLY_RETURN_ON_META):
        recorded as one op, and run on a scratch tensor so the random stream advances."""
        recipe = self.recipes.get(_key(tensor))
        if recipe is None:
            raise UsageError(f"deepspeed.zero.Init: {fn.__name__} on a meta tensor that is not a parameter built "
                             "inside zero.Init; zerort cannot replay it")
        rng = torch.get_rng_state()
        _advance(lambda t: fn(t, *args, **kwargs), tensor)
        recipe.ops.append((fn, _geometry(tensor) if tensor.storage_offset() or not tensor.is_contiguous() else None,
                           args, kwargs, rng))
        return tensor

    def adopt(self, param):
        """param, real and just registered, is going to the meta device: the Recipe that
        remakes its values. Its storage's maker when that is torch.empty (nothing to
        remake) or a factory whose replay gives these very bits; else a copy of its values."""
        if param.device.type != "cpu":
            raise UsageError(f"deepspeed.zero.Init: a parameter of shape {list(param.shape)} was made on "
                             f"{param.device}; zerort records initialization on the CPU (its random stream), so "
                             "build the model with CPU parameters inside zero.Init: initialize() makes each unit "
                             "real on the model's device")
        recipe = self.recipes.get(_key(param))
        plain = param.storage_offset() == 0 and param.is_contiguous() and \
            param.untyped_storage().nbytes() == param.numel() * param.element_size()
        if recipe is not None and plain and _name(recipe.start[1]) in EMPTY_OPS and not recipe.ops:
            return recipe  # any dtype: nothing to remake (a half-precision build, as from_pretrained's dtype= gives)
        if recipe is not None and plain and param.is_floating_point():
            replayed = recipe.replay()
            if replayed.dtype == param.dtype and replayed.shape == param.shape and \
                    torch.equal(replayed.reshape(-1).view(torch.uint8), param.detach().reshape(-1).view(torch.uint8)):
                return recipe
        return Recipe(("values", param.detach().clone()))

    def cast(self, source, out):
        """out is source (fresh from a constructor) in zero.Init's build dtype: its Recipe is
        source's with the cast, when source's is a bare factory (Note [build dtype])."""
        recipe = self.recipes.get(_key(source))
        fresh = recipe is not None and recipe.start[0] == "factory" and recipe.cast is None and not recipe.ops
        self.recipes[_key(out)] = Recipe(recipe.start, cast=out.dtype) if fresh else None

    def track(self, meta, recipe):
        self.recipes[_key(meta)] = recipe
        meta.__dict__[ORDER] = next(_built)  # the same on every rank: they run the same constructors
        setattr(meta, RECIPE, recipe)  # read by zerort.engine.meta_init.Materializer


CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")


@contextlib.contextmanager
def dtype_patches(recorder, dtype):
    """Note [build dtype]: DeepSpeed's zero.Init makes the floating tensors that
    torch.tensor, empty, zeros, ones, full, arange, eye and randn return, and torch.Tensor(...),
    in its build dtype (zero.build_dtype), whatever dtype they were asked for: each is made
    as asked, then converted. Inside zerort's Init these do the same, so nn.Linear's weight
    is a bf16 tensor under a bf16 config and its kaiming_uniform_ runs on bf16, as under
    DeepSpeed; the Recorder notes the conversion in the tensor's Recipe (made as asked, then
    converted, then its in-place ops), which initialize() replays to the same bits, one
    parameter at a time. The converted tensor is the same Python object (its .data
    replaced), so a leaf that requires grad stays one. Calls that reach torch by other
    names (tensor.new_empty, torch.rand, a module's `from torch import empty`) are left
    alone, as DeepSpeed leaves them; and so is torch.arange while transformers'
    prevent_arange_dtype_change() has swapped partition_parameters'
    zero_wrapper_for_fp_tensor_constructor for one that leaves it alone (_swapped_away)."""
    def in_dtype(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            source = t.data
            out = source.to(dtype)
            recorder.cast(source, out)
            t.data = out
        return t

    def wrapping(original):
        def fn(*args, **kwargs):
            return in_dtype(original(*args, **kwargs))
        fn.__name__, fn.__doc__ = original.__name__, original.__doc__
        return fn

    import torch._dynamo  # noqa: F401 (imported inside the build anyway; importing it checks Tensor.__new__)

    originals = {name: getattr(torch, name) for name in CONSTRUCTORS if name not in _swapped_away(dtype)}
    own_new = torch.Tensor.__dict__.get("__new__")  # None: inherited from torch._C.TensorBase
    base_new = torch.Tensor.__new__

    def new(cls, *args, **kwargs):  # torch.Tensor(2, 3) only: subclasses are built as they ask
        t = base_new(cls, *args, **kwargs)
        return in_dtype(t) if cls is torch.Tensor else t

    try:
        for name, f in originals.items():
            setattr(torch, name, wrapping(f))
        torch.Tensor.__new__ = new
        yield
    finally:
        for name, f in originals.items():
            setattr(torch, name, f)
        if own_new is None:
            del torch.Tensor.__new__
        else:
            torch.Tensor.__new__ = own_new


def _swapped_away(dtype):
    """The constructors a swapped partition_parameters.zero_wrapper_for_fp_tensor_constructor
    (transformers' prevent_arange_dtype_change, entered before zero.Init) leaves in their
    own dtype, as DeepSpeed's Init, which wraps through that name, then does: torch.arange
    when the swapped wrapper's arange gives a float32 result."""
    import sys

    pp = sys.modules.get("zerort.integrations.deepspeed.runtime.zero.partition_parameters")
    if pp is None or dtype == torch.float32 or \
            pp.zero_wrapper_for_fp_tensor_constructor is pp.DEEPSPEEDS_WRAPPER:
        return ()
    probe = pp.zero_wrapper_for_fp_tensor_constructor(pp._orig_torch_arange, target_fp_dtype=dtype,
                                                      target_device=torch.device("cpu"))
    return ("arange",) if probe(0.0, 1.0).dtype == torch.float32 else ()


def _advance(op, like):
    """Runs op on a real scratch tensor shaped as `like` (its geometry over a storage of its
    size), so the CPU random stream moves as it would have."""
    size, stride, offset = _geometry(like)
    span = offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1 if all(size) else 0
    scratch = torch.empty(span, dtype=like.dtype).as_strided(size, stride, offset)
    with torch.no_grad():
        op(scratch)


@contextlib.contextmanager
def early_return_patches(recorder):
    """trunc_normal_, orthogonal_, dirac_ and sparse_ record themselves on meta tensors."""
    import sys

    init = torch.nn.init
    originals = {name: getattr(init, name) for name in EARLY_RETURN_ON_META}
    trunc = init._no_grad_trunc_normal_

    def recording(name, original):
        def fn(tensor, *args, **kwargs):
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return recorder.record_call(original, tensor, args, kwargs)
            return original(tensor, *args, **kwargs)
        fn.__name__ = name
        return fn

    patched = {name: recording(name, f) for name, f in originals.items()}
    hf = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    hf_saved = dict(hf) if isinstance(hf, dict) else None
    try:
        for name, f in patched.items():
            setattr(init, name, f)
            if hf_saved is not None and name in hf:
                hf[name] = f
        init._no_grad_trunc_normal_ = recording("trunc_normal_", trunc)  # every trunc_normal_ calls it
        yield
    finally:
        for name, f in originals.items():
            setattr(init, name, f)
        init._no_grad_trunc_normal_ = trunc
        if hf_saved is not None:
            hf.clear()
            hf.update(hf_saved)
