"""ParamIndex: the engine's parameters as initialize laid them out, for the modules that read
them (checkpoints, the shard map, the memory report, the DeepSpeed integration). An engine
builds one when its C++ Engine exists (after a meta-device model's parameters were made
real) and hands it out as engine.param_index; collaborators take it instead of reading the
engine's fields."""
import dataclasses
import types

import torch


@dataclasses.dataclass(frozen=True)
class ParamIndex:
    """params: every trainable parameter, each once, in the order the engine laid them out.
    frozen: the parameters that do not train (whole on every rank, in the working precision).
    names: id(param) -> its first name in the model (trainable and frozen), for messages.
    shapes: id(trainable param) -> its whole shape (stage 3 empties released parameters).
    groups: the C++ Engine's two groups, (compute-dtype parameters, FP32-module parameters).
    dtypes: id(trainable param) -> the dtype it computes in (float32 in FP32 modules)."""
    params: tuple
    frozen: tuple
    names: types.MappingProxyType
    shapes: types.MappingProxyType
    groups: tuple
    dtypes: types.MappingProxyType

    @classmethod
    def build(cls, params, frozen, names, groups, shapes, dtype):
        """The index of an engine's parameters: groups as the C++ Engine holds them, shapes
        by id(param) (taken before stage 3 empties them), dtype the compute dtype."""
        fp32 = {id(p) for p in groups[1]}
        dtypes = {id(p): torch.float32 if id(p) in fp32 else dtype for p in params}
        return cls(tuple(params), tuple(frozen), types.MappingProxyType(dict(names)),
                   types.MappingProxyType(dict(shapes)), tuple(tuple(g) for g in groups),
                   types.MappingProxyType(dtypes))

    def full_shape(self, p):
        """p's whole shape: its recorded one when it trains, else its own."""
        return self.shapes.get(id(p), tuple(p.shape))
