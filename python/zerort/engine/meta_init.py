"""Models built on the meta device: their parameters are made real one bucket or unit at a
time, inside the Engine's constructor, so no rank ever holds the whole FP32 model.

    with torch.device("meta"):
        model = MyModel()                       # shapes only, no memory
    engine = zerort.initialize(model, config)   # initialized unit by unit

For each module that owns a parameter the Engine asks for, every meta parameter of that
module is replaced by a new float32 Parameter on the model's device (a meta tensor cannot
become a real one in place) and initialized: by the root's `_init_weights(module)` when the
model has one (HuggingFace models), else by `module.reset_parameters()`. Module k (in
model.modules() order) is initialized from its own seed, base + k, where base is a hash of
torch's CPU random state when initialize starts (read, never drawn from: initialize() leaves
the global random stream where the script left it, so the data a script draws next is the
data it draws without zerort); and the Engine takes rank 0's values. So the same seed gives
the same model at any world size and stage, whatever order the buckets are initialized in.
Parameters tied
between modules are replaced everywhere they appear. A parameter built under
deepspeed.zero.Init instead replays its own recorded initialization (RECIPE): there the
model's own init is followed bit for bit, and the per-module seeds above are only for
models built on the meta device by other means, which have no "own" values to follow. Buffers cannot be recomputed from
nothing: a float buffer on the meta device is an error that says how to keep buffers real.

With `weights` (a state dict, a .safetensors file, or a folder of safetensors files with or
without HuggingFace's model.safetensors.index.json), a module's parameters are read from
there instead, one tensor at a time, under any of the names the parameter has (a tied
weight is often saved once); a parameter found under none of them is an error naming it.
"""
import contextlib
import hashlib
import json
import os

import torch
from zerort.errors import ConfigError, DeviceError

# A meta parameter built under deepspeed.zero.Init carries how to make its values (an object
# with materialize(device)): Note [recorded initialization], zerort.integrations.deepspeed.init_record.
RECIPE = "_zerort_recipe"


@contextlib.contextmanager
def parameters_on_meta(on_register=None):
    """Inside, every parameter registered on a module goes to the meta device; buffers
    stay real (zerort needs them). A model built so is made real at initialize, from its
    weights= or its modules' own initialization. on_register(module, param, meta), when
    given, sees each parameter and its meta replacement (deepspeed.zero.Init records
    there)."""
    original = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        original(module, name, param)
        if param is not None and not param.is_meta:
            meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            if on_register is not None:
                on_register(module, param, meta)
            module._parameters[name] = meta

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def is_meta_model(model):
    return any(p.is_meta for p in model.parameters())


def check_buffers(model):
    for name, b in model.named_buffers():
        if b is not None and b.is_meta:
            raise DeviceError(f"zerort: buffer {name!r} is on the meta device, and its values cannot be recomputed: "
                            "build only the parameters on the meta device and keep buffers real, for example with "
                            "accelerate.init_empty_weights(include_buffers=False), or register the buffer after "
                            "leaving the torch.device('meta') context")


def _seed_of_random_state():
    """62 bits that follow from torch's CPU random state without advancing it."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


class Materializer:
    """Makes meta parameters real, module by module, on `device`."""

    def __init__(self, model, device, weights=None):
        self.model, self.device = model, device
        self.weights = None if weights is None else Weights(weights)
        self.path = {id(m): p for p, m in model.named_modules()}
        self.holders = {}  # id(meta parameter) -> [(module, name)] (tied parameters: several)
        self.owner = {}    # id(meta parameter) -> its first module
        for m in model.modules():
            for name, p in m.named_parameters(recurse=False):
                if p.is_meta:
                    self.holders.setdefault(id(p), []).append((m, name))
                    self.owner.setdefault(id(p), m)
        self.replaced = {}  # id(meta parameter) -> its real parameter
        self._init = getattr(model, "_init_weights", None)
        self.base = _seed_of_random_state()  # the model's seed
        self.index = {id(m): k for k, m in enumerate(model.modules())}

    def __call__(self, params):
        """The real parameters for `params` (meta or already real), in order."""
        for p in params:
            if id(p) not in self.replaced and id(p) in self.owner:
                self._materialize(self.owner[id(p)])
        return [self.replaced.get(id(p), p) for p in params]

    def _materialize(self, module):
        olds = [p for p in module.parameters(recurse=False) if p.is_meta and id(p) not in self.replaced]
        for old in olds:
            new = torch.nn.Parameter(self._values(old), requires_grad=old.requires_grad)
            for m, name in self.holders[id(old)]:
                m._parameters[name] = new
            self.replaced[id(old)] = new
        if self.weights is not None or all(hasattr(p, RECIPE) for p in olds):
            return  # the values came from the weights, or from the build's own recorded initialization
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.base + self.index[id(module)])
            if self._init is not None:
                self._init(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            elif olds:
                names = [n for n, p in module.named_parameters(recurse=False)]
                raise DeviceError(f"zerort: {type(module).__name__} holds parameters {names} built on the meta device "
                                "but has no reset_parameters() to initialize them; give it one, or build the model "
                                "on a real device")

    def _values(self, old):
        if self.weights is None and hasattr(old, RECIPE):  # built under zero.Init: Note [recorded initialization]
            return getattr(old, RECIPE).materialize(self.device)
        if self.weights is None:
            return torch.empty(old.shape, dtype=torch.float32, device=self.device)
        names = [f"{self.path[id(m)]}.{n}".lstrip(".") for m, n in self.holders[id(old)]]
        t = self.weights.get(names)
        if tuple(t.shape) != tuple(old.shape):
            raise ConfigError(f"zerort: weights {self.weights.source}: {names[0]!r} has shape {tuple(t.shape)} but "
                             f"the model's parameter has shape {tuple(old.shape)}")
        return t.to(device=self.device, dtype=torch.float32)


class Weights:
    """Named tensors read one at a time from a state dict or safetensors files."""

    def __init__(self, source):
        self.source = source if not isinstance(source, dict) else "the state dict"
        if isinstance(source, dict):
            self.where, self.dict = {k: None for k in source}, source
            return
        self.dict = None
        if os.path.isdir(source):
            index = os.path.join(source, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    files = {k: os.path.join(source, v) for k, v in json.load(f)["weight_map"].items()}
            else:
                files = {}
                for name in sorted(os.listdir(source)):
                    if name.endswith(".safetensors"):
                        files.update(dict.fromkeys(_keys(os.path.join(source, name)), os.path.join(source, name)))
            self.where = files
        elif os.path.isfile(source):
            self.where = dict.fromkeys(_keys(source), source)
        else:
            raise FileNotFoundError(f"zerort: weights {source!r} is neither a file nor a folder")

    def get(self, names):
        for n in names:
            if n in self.where:
                if self.dict is not None:
                    return self.dict[n].detach()
                from safetensors import safe_open

                with safe_open(self.where[n], framework="pt") as f:
                    return f.get_tensor(n)
        raise ConfigError(f"zerort: weights {self.source}: no tensor named {' or '.join(map(repr, names))}; the file "
                       "must hold every parameter of the model (under any of its names, for tied weights)")


def _keys(path):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return list(f.keys())
