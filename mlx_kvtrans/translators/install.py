"""Install: turn cache objects into mlx-lm cache objects the model continues from, and the step
every switch runs (`translate_into`: translate a capture and install it, whole or sharded).

Objects given at raw or normed become engine with the target's own norm and RoPE at the target's
positions (and, for recurrent states, by replaying the target's own recurrence). The result is a
list of plain mlx-lm caches (`KVCache`, `ArraysCache`, `CacheList`): `model(tokens, cache=...)`,
mlx-lm's generation and `save_prompt_cache` take it as they take their own.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..capture import RESIDUAL
from ..layouts import CapturePoint, ModelLayout, layout_of
from . import relay
from .sharding import shards_of


def resolve_layout(model_or_layout) -> ModelLayout:
    return model_or_layout if isinstance(model_or_layout, ModelLayout) else layout_of(model_or_layout)


def to_engine(model_or_layout: nn.Module | ModelLayout, layers: list[dict[str, Any]],
              point: int | list[dict[str, int]], offset: int = 0,
              previous: list[dict[str, mx.array]] | None = None) -> list[dict[str, mx.array]]:
    """Per-layer objects captured at `point` -> per-layer engine objects, tokens from `offset` on.

    `point`: one capture point for every object, or per layer a point per object name."""
    layout = resolve_layout(model_or_layout)
    previous = previous or [None] * len(layout.layers)
    points = point if isinstance(point, list) else [point] * len(layout.layers)
    deferred = []  # (layer, name, rope, unrotated): rotated together below

    def defer(index):
        def rotate(name, rope, x, offset):
            deferred.append((index, name, rope, x))
            return x  # replaced below; only a cast follows a rotation
        return rotate

    out = [layer.cache.to_engine(objects, p, offset, prev, defer(i))
           for i, (layer, objects, p, prev) in enumerate(zip(layout.layers, layers, points,
                                                              previous))]
    for group in _same_rotation(deferred):
        # one RoPE call over every layer's heads: on a CPU its cost is per position, not per
        # head, so this pays it once instead of once per layer (same arithmetic, same bits)
        rotated = group[0][2](mx.concatenate([x for *_, x in group], axis=1), offset=offset)
        start = 0
        for index, name, _, x in group:
            heads = x.shape[1]
            out[index][name] = layout.layers[index].cache.cast(
                name, rotated[:, start:start + heads])
            start += heads
    return out


def _same_rotation(deferred: list) -> list[list]:
    """Rotations that one RoPE call can do together: nn.RoPE of one configuration, inputs of
    one batch, length and width. Any other RoPE module (YaRN, custom) runs alone."""
    groups: dict = {}
    for item in deferred:
        _, _, rope, x = item
        if isinstance(rope, nn.RoPE):
            config = (rope.dims, rope.traditional, rope.base, rope.scale)
        else:
            config = id(rope)
        key = (type(rope), config, x.shape[0], x.shape[2], x.shape[3], x.dtype)
        groups.setdefault(key, []).append(item)
    return list(groups.values())


class NotFinite(ArithmeticError):
    """Objects to install hold a NaN or an infinity (raised before any cache is touched)."""


def install(model_or_layout: nn.Module | ModelLayout, layers: list[dict[str, Any]],
            point: int | list[dict[str, int]] = CapturePoint.ENGINE, offset: int = 0,
            cache: list | None = None, finite: bool = False) -> list[Any]:
    """mlx-lm cache objects holding `layers` (per-layer objects at `point`, of the tokens from
    position `offset` on).

    Without `cache`: fresh caches. Build a new one for every forward that should start from
    these objects: mlx-lm caches grow in place. With `cache`, the objects are of the tokens
    after the `offset` it holds: it grows in place (per-token objects appended, fixed-size ones
    recomputed from its own: a conv history continues, a state is replayed from its state) and
    is returned. `finite`: raise `NotFinite`, before any cache is touched, when an object to
    install is not finite.
    """
    layout = resolve_layout(model_or_layout)
    if len(layers) != len(layout.layers):
        raise ValueError(f"{len(layers)} layers of objects for a model of {len(layout.layers)}")
    if cache is not None and len(cache) != len(layout.layers):
        raise ValueError(f"a cache of {len(cache)} layers for a model of {len(layout.layers)}")
    if point != CapturePoint.ENGINE:
        previous = None if cache is None else [
            layer.cache.read_engine(c) for layer, c in zip(layout.layers, cache)]
        layers = to_engine(layout, layers, point, offset, previous)
    if finite and not all_finite(layers):
        raise NotFinite("objects to install are not finite")
    if cache is None:
        return [layer.cache.build_cache(objects) for layer, objects in zip(layout.layers, layers)]
    for layer, c, objects in zip(layout.layers, cache, layers):
        layer.cache.append(c, objects)
    return cache


def all_finite(layers: list[dict[str, mx.array]]) -> bool:
    """Whether every engine object is finite (one evaluation for all of them). A NaN or an
    infinity makes its tensor's sum one too, and a sum is one pass over the tensor where
    `isfinite(...).all()` on a CPU is two and several times slower. Finite values whose sum
    overflows float32 (3.4e38) read as not finite: no usable cache holds them. float16
    tensors (whose sums pass 65504 easily) are summed in float32."""
    sums = [(v.astype(mx.float32) if v.dtype == mx.float16 else v).sum()
            for layer in layers for v in layer.values()]
    return not sums or bool(mx.isfinite(mx.stack(sums).sum()))


class _Stopped(Exception):
    """Raised after the last layer a partial forward needs."""


def recompute_first_layers(model: nn.Module, cache: list, before: list, tokens: mx.array,
                           layers: int) -> None:
    """The target's own first `layers` layers over `tokens` (1, T), in place of what `cache`
    holds for them (DroidSpeak's recompute): `before[i]` is layer i's cache before the tokens
    (a copy, or a fresh cache), which a forward stopped after layer `layers` - 1 extends and
    `cache[i]` becomes. The layers above keep their translation; the forward costs `layers`
    of the model's layers."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..capture.instrument import hook_module, language_model

    if layers <= 0:
        return
    stack = language_model(model).model.layers
    if layers > len(stack):
        raise ValueError(f"recompute {layers} layers: the model has {len(stack)}")
    throwaway = make_prompt_cache(model)[layers:]  # never reached
    working = list(before[:layers]) + throwaway

    def stop(module, args, kwargs, out):
        raise _Stopped

    try:
        with hook_module(stack[layers - 1], after=stop):
            model(tokens, cache=working)
    except _Stopped:
        pass
    mx.eval([c.state for c in working[:layers]])
    cache[:layers] = working[:layers]


# -- the step every switch runs ---------------------------------------------------------------
def translate_into(translator, source, target_model, tokens, offset: int = 0,
                   cache: list | None = None, all_rows: bool = False, finite: bool = False
                   ) -> tuple[list[dict], list[dict], list]:
    """Translate `source` (a capture of the tokens from `offset` on) and install it for
    `target_model`, whole or sharded: (the translated objects, their capture points, the
    caches: fresh ones, or `cache` grown in place). For a sharded target the objects are the
    whole model's layers this process holds (the others empty) and the caches its share;
    `finite` raises `NotFinite` on every process when any process's share is not. A
    translator's relay (`relay`) then reruns its layers from the source's recorded hidden
    state."""
    chosen = relay.relay_of(translator)
    shards = shards_of(target_model)
    if shards is None:
        layout = layout_of(target_model)
        objects, points = translator.translate(source, target_model, layout, tokens,
                                               all_rows=all_rows)
        residual = None if chosen is None else source.objects[chosen.source_layer].get(RESIDUAL)
        if chosen is not None and residual is None:  # before the cache grows
            raise ValueError(f"the source's hidden state entering its layer "
                             f"{chosen.source_layer} was not recorded: the relay reads it")
        cache = install(layout, objects, points, offset=offset, cache=cache, finite=finite)
        if chosen is not None:
            relay.run(target_model, cache, residual, chosen)
        return objects, points, cache
    if chosen is not None:
        raise ValueError("a translator with a relay switches into a whole model, not a "
                         "sharded one")
    failed = None
    try:
        objects, points = translator.translate(source, shards.skeleton, shards.whole, tokens,
                                               all_rows=all_rows, layers=shards.layers)
        held = shards.held()
        previous = None
        if cache is not None and shards.kind == "pipeline":  # its layers' states are whole
            previous = [layer.cache.read_engine(c) for layer, c in zip(held.layers, cache)]
        engine = shards.split(to_engine(held, [objects[i] for i in shards.layers],
                                        [points[i] for i in shards.layers], offset, previous))
    except ValueError as e:  # the span lacks what this process's layers read
        failed = e
    # one verdict for all: a process that fell back alone would leave the others waiting
    flags = mx.distributed.all_sum(
        mx.array([float(failed is not None),
                  float(failed is None and finite and not all_finite(engine))]),
        group=shards.group, stream=mx.cpu).tolist()
    if flags[0]:
        raise failed or ValueError("another process could not translate its layers")
    if flags[1]:
        raise NotFinite("objects to install are not finite")
    return objects, points, install(shards.local, engine, CapturePoint.ENGINE, offset=offset,
                                    cache=cache)
