"""Models that mlx-lm loaded sharded across the processes of an `mx.distributed` group.

Tensor parallel (`model.shard(group)`): each process holds its share of every layer's heads.
Pipeline (`model.model.pipeline(group)`): each process holds a run of consecutive layers.
A translator is fitted for the whole models. A sharded source's capture is made whole on
every process: head shares gathered (`all_gather`), each layer's objects sent from the process
that holds it (`all_sum` over zeros elsewhere). A sharded target's process translates as for
the whole model, only the layers it holds, brings the objects to engine with the whole layer's
norm and rotation, and keeps its share of the heads: the caches it installs are what the
unsharded target would hold, split the way mlx-lm split the model.

The whole model's layout comes from a skeleton of the model built from its config (lazy: its
own weights are never computed); every weight the process holds whole is lent to it, so norms,
rotations and replays run on the checkpoint's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed
from mlx.utils import tree_flatten

from ..capture import Capture, capture
from ..errors import UnsupportedModelError
from ..layouts import CapturePoint, ModelLayout, layout_of
from ..layouts.linear_attention import RawRecurrentInputs, RecurrentInputs

# what a gathered recurrent object is, by its class's name
RECURRENT = {cls.__name__: cls for cls in (RecurrentInputs, RawRecurrentInputs)}

_TENSOR_SHARDED = (distributed.AllToShardedLinear, distributed.ShardedToAllLinear,
                   distributed.QuantizedAllToShardedLinear,
                   distributed.QuantizedShardedToAllLinear)
# cache objects whose engine form needs only weights a tensor-sharded layer holds whole (the key
# norm and the rotation); a recurrent layer's replay reads its sharded projections
_TENSOR_MIXERS = ("gqa",)


@dataclass
class Shards:
    kind: str  # "tensor" or "pipeline"
    rank: int
    size: int
    layers: range  # the whole model's layer indexes this process caches
    whole: ModelLayout  # the unsharded model's layout
    local: ModelLayout  # this process's layout (its caches, in `make_prompt_cache` order)
    skeleton: nn.Module = field(repr=False)  # the whole model, this process's weights lent
    group: mx.distributed.Group = field(repr=False)

    def held(self) -> ModelLayout:
        """The whole layout's layers this process caches."""
        return ModelLayout(self.whole.model_type, self.whole.family,
                           [self.whole.layers[i] for i in self.layers])

    def split(self, engine: list[dict[str, mx.array]]) -> list[dict[str, mx.array]]:
        """Engine objects of the held layers, whole -> this process's share of every object."""
        out = []
        for objects, whole, local in zip(engine, self.held().layers, self.local.layers):
            out.append({name: self._share(value, whole.cache.object(name).engine_shape,
                                          local.cache.object(name).engine_shape)
                        for name, value in objects.items()})
        return out

    def local_select(self, select: set | None) -> set | None:
        """(whole model's layer, object, point) triples -> this process's layers' own."""
        if select is None:
            return None
        start = self.layers.start
        return {(i - start, name, point) for i, name, point in select if i in self.layers}

    def whole_engine(self, objects: list[dict]) -> list[dict]:
        """Engine objects read from this process's caches (its layers, its share of the heads) ->
        the whole model's, on every process."""
        return self.whole_capture(Capture(self.local, None, objects, None)).objects

    def share_held(self, objects: list[dict]) -> list[dict]:
        """Objects a translation gave the layers this process holds (the whole model's layers,
        the others empty) -> every layer's, on every process (a pipeline's layers are each on
        one process; tensor-parallel processes translate every layer whole)."""
        if self.kind == "tensor":
            return objects
        return self._from_owners([objects[i] for i in self.layers])

    def whole_capture(self, part: Capture) -> Capture:
        """This process's capture of a prefill -> the whole model's, the same on every process."""
        objects = [{} for _ in self.whole.layers]
        if self.kind == "tensor":
            for index, (found, whole, local) in enumerate(zip(part.objects, self.whole.layers,
                                                              self.local.layers)):
                for (name, point), value in found.items():
                    a, b = (whole.cache.object(name).engine_shape,
                            local.cache.object(name).engine_shape)
                    if a == b:
                        objects[index][(name, point)] = value
                        continue
                    axis = ([d for d, (x, y) in enumerate(zip(a, b)) if x != y][0]
                            if point == CapturePoint.ENGINE else value.ndim - 1)
                    objects[index][(name, point)] = self._gathered(value, axis)
        else:
            objects = self._from_owners(part.objects)
        return Capture(self.whole, part.tokens, objects, part.engine, part.last_logits)

    def _from_owners(self, mine: list[dict]) -> list[dict]:
        """Objects of the layers this process holds (in its own order) -> every layer's, on
        every process."""
        held = {(i, name, point): value for i, found in zip(self.layers, mine)
                for (name, point), value in found.items()}
        out = [{} for _ in self.whole.layers]
        for (i, name, point), value in _from_owners(held, self.group).items():
            out[i][(name, point)] = value
        return out

    def _gathered(self, value: mx.array, axis: int) -> mx.array:
        """Every process's share of `value` along `axis`, in rank order (mlx-lm's blocks)."""
        moved = mx.moveaxis(value, axis, 0)
        every = mx.distributed.all_gather(moved, group=self.group, stream=mx.cpu)
        return mx.moveaxis(every, 0, axis)

    def _share(self, value: mx.array, whole: tuple, local: tuple) -> mx.array:
        axes = [a for a, (w, s) in enumerate(zip(whole, local)) if w != s]
        if not axes:
            return value  # held whole by every process (a latent, a pipeline's layer)
        (axis,) = axes  # mlx-lm's shard_linear: N contiguous blocks of one axis
        step = local[axis]
        return mx.take(value, mx.arange(self.rank * step, (self.rank + 1) * step), axis=axis)


def shard_model(model: nn.Module, kind: str, group: mx.distributed.Group,
                name: str = "the model") -> Shards:
    """Shard `model` (loaded whole or lazily) across `group` as mlx-lm does: "tensor" by its
    `shard(group)`, "pipeline" by its decoder's `pipeline(group)`; returns how."""
    from ..capture.instrument import language_model

    inner = language_model(model)
    model_type = type(model).__module__.rsplit(".", 1)[-1]
    holder = model if hasattr(model, "shard") else inner
    can = {"tensor": hasattr(holder, "shard"), "pipeline": hasattr(inner.model, "pipeline")}
    if kind not in can:
        raise ValueError(f"sharding is tensor or pipeline, not {kind!r}")
    if not can[kind]:
        other = next((k for k, ok in can.items() if ok), None)
        raise UnsupportedModelError(
            f"{name}: mlx-lm's {model_type} has no {kind} parallelism"
            + (f": try --shard {other}" if other else ": it cannot be sharded; serve it whole"))
    if kind == "tensor":
        holder.shard(group)
    else:
        inner.model.pipeline(group)
    model.__dict__.pop("_kvtrans_shards", None)
    found = shards_of(model)
    if found is None:
        raise UnsupportedModelError(f"{name}: sharding across {group.size()} process(es) "
                                    "left it whole")
    return found


def shards_of(model: nn.Module) -> Shards | None:
    """How `model` is sharded (None: held whole by this process); worked out once per model."""
    found = model.__dict__.get("_kvtrans_shards", False)
    if found is not False:
        return found
    found = _find_shards(model)
    model.__dict__["_kvtrans_shards"] = found
    return found


def _find_shards(model: nn.Module) -> Shards | None:
    from ..capture.instrument import language_model

    decoder = language_model(model).model
    pipelined = getattr(decoder, "pipeline_size", 1) > 1
    groups = [m.group for _, m in model.named_modules() if isinstance(m, _TENSOR_SHARDED)]
    tensor = bool(groups) and groups[0].size() > 1
    if not (pipelined or tensor):
        return None
    if pipelined and tensor:
        raise UnsupportedModelError("a model sharded both by tensor and by pipeline is not "
                                    "supported: shard it one way")
    if any("scales" in m for _, m in model.named_modules() if isinstance(m, nn.Module)):
        raise UnsupportedModelError("a sharded quantized model is not supported yet: load "
                                    "it unquantized or whole")
    if pipelined and any(layer is None for layer in model.layers):
        raise UnsupportedModelError(
            f"mlx-lm's {type(model).__module__.rsplit('.', 1)[-1]} does not run a pipeline's "
            "layers alone (its cache covers every layer): load the model whole")
    skeleton = _skeleton(model)
    whole, local = layout_of(skeleton), layout_of(model)
    if pipelined:
        layers = range(decoder.start_idx, decoder.end_idx)
        rank, size = decoder.pipeline_rank, decoder.pipeline_size
    else:
        layers = range(len(whole.layers))
        rank, size = groups[0].rank(), groups[0].size()
        mixers = {layer.mixer for layer in whole.layers} - set(_TENSOR_MIXERS)
        if mixers:
            raise UnsupportedModelError(
                f"a tensor-sharded model with {', '.join(sorted(mixers))} layers is not "
                "supported yet: shard it by pipeline (model.pipeline(group) on its decoder)")
    # mlx-lm's pipeline keeps its rank and size, not its group: the global one
    group = groups[0] if tensor else mx.distributed.init()
    return Shards("pipeline" if pipelined else "tensor", rank, size, layers, whole, local,
                  skeleton, group)


def _skeleton(model: nn.Module) -> nn.Module:
    """The unsharded model of `model`'s config, with every weight `model` holds whole."""
    args = getattr(model, "args", None)
    if args is None:
        raise UnsupportedModelError(f"{type(model).__name__} keeps no config (args) to see "
                                    "the whole model from")
    skeleton = type(model)(args)
    held = dict(tree_flatten(model.parameters()))
    lent = [(name, held[name]) for name, value in tree_flatten(skeleton.parameters())
            if name in held and held[name].shape == value.shape]
    skeleton.load_weights(lent, strict=False)
    skeleton.eval()
    return skeleton


def _from_owners(mine: dict, group) -> dict:
    """{key: array or RecurrentInputs} each process holds for its own keys -> every key's on
    every process: what each holds is described to all, then summed with zeros elsewhere."""
    import json

    import numpy as np

    from ..backend.processes import gathered

    def described(value):
        arrays = value.arrays() if isinstance(value, RecurrentInputs) else [value]
        return [[list(a.shape), str(a.dtype).rsplit(".", 1)[-1]] for a in arrays]

    payload = json.dumps([[list(key), described(v),
                           type(v).__name__ if isinstance(v, RecurrentInputs) else ""]
                          for key, v in sorted(mine.items())]) + "\n"
    lines = gathered([np.frombuffer(payload.encode(), np.uint8)], group)[0].tobytes()
    out = {}
    for line in lines.decode().splitlines():
        for key, shapes, recurrent in json.loads(line):
            key = tuple(key)
            held = mine.get(key)
            arrays = ([] if held is None else
                      held.arrays() if isinstance(held, RecurrentInputs) else [held])
            summed = [mx.distributed.all_sum(
                arrays[j] if held is not None else mx.zeros(shape, getattr(mx, dtype)),
                group=group, stream=mx.cpu) for j, (shape, dtype) in enumerate(shapes)]
            out[key] = RECURRENT[recurrent](*summed) if recurrent else summed[0]
    mx.eval([v.arrays() if isinstance(v, RecurrentInputs) else v for v in out.values()])
    return out


def capture_whole(model: nn.Module, tokens, points, residuals=()) -> Capture:
    """`capture` of a source whole or sharded: the whole model's objects on every process
    (with the hidden state entering each of the `residuals` layers, of a whole model)."""
    shards = shards_of(model)
    part = capture(model, tokens, points=points, residuals=() if shards else residuals)
    return part if shards is None else shards.whole_capture(part)
