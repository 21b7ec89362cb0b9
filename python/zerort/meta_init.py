"""Models built on the meta device: their parameters are made real one bucket or unit at a
time, inside the Engine's constructor, so no rank ever holds the whole FP32 model.

    with torch.device("meta"):
        model = MyModel()                       # shapes only, no memory
    engine = zerort.initialize(model, config)   # initialized unit by unit

For each module that owns a parameter the Engine asks for, every meta parameter of that
module is replaced by a new float32 Parameter on the model's device (a meta tensor cannot
become a real one in place) and initialized: by the root's `_init_weights(module)` when the
model has one (HuggingFace models), else by `module.reset_parameters()`. Module k (in
model.modules() order) is initialized from its own seed, base + k, where base is drawn once
from torch's random state when initialize starts; and the Engine takes rank 0's values. So
the same seed gives the same model at any world size and stage, whatever order the buckets
are initialized in. Parameters tied
between modules are replaced everywhere they appear. Buffers cannot be recomputed from
nothing: a float buffer on the meta device is an error that says how to keep buffers real.
"""
import torch


def is_meta_model(model):
    return any(p.is_meta for p in model.parameters())


def check_buffers(model):
    for name, b in model.named_buffers():
        if b is not None and b.is_meta:
            raise TypeError(f"zerort: buffer {name!r} is on the meta device, and its values cannot be recomputed: "
                            "build only the parameters on the meta device and keep buffers real, for example with "
                            "accelerate.init_empty_weights(include_buffers=False), or register the buffer after "
                            "leaving the torch.device('meta') context")


class Materializer:
    """Makes meta parameters real, module by module, on `device`."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.holders = {}  # id(meta parameter) -> [(module, name)] (tied parameters: several)
        self.owner = {}    # id(meta parameter) -> its first module
        for m in model.modules():
            for name, p in m.named_parameters(recurse=False):
                if p.is_meta:
                    self.holders.setdefault(id(p), []).append((m, name))
                    self.owner.setdefault(id(p), m)
        self.replaced = {}  # id(meta parameter) -> its real parameter
        self._init = getattr(model, "_init_weights", None)
        self.base = int(torch.randint(0, 2 ** 62, (1,)).item())  # one draw: the model's seed
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
            new = torch.nn.Parameter(torch.empty(old.shape, dtype=torch.float32, device=self.device),
                                     requires_grad=old.requires_grad)
            for m, name in self.holders[id(old)]:
                m._parameters[name] = new
            self.replaced[id(old)] = new
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.base + self.index[id(module)])
            if self._init is not None:
                self._init(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            elif olds:
                names = [n for n, p in module.named_parameters(recurse=False)]
                raise TypeError(f"zerort: {type(module).__name__} holds parameters {names} built on the meta device "
                                "but has no reset_parameters() to initialize them; give it one, or build the model "
                                "on a real device")
