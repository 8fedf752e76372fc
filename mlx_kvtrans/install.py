"""Install: turn cache objects into mlx-lm cache objects the model continues from.

Objects given at (1) or (2) become (3) with the target's own norm and RoPE at the target's
positions (and, for recurrent states, by replaying the target's own recurrence). The result is a
list of plain mlx-lm caches (`KVCache`, `ArraysCache`, `CacheList`): `model(tokens, cache=...)`,
mlx-lm's generation and `save_prompt_cache` take it as they take their own.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .layouts import CapturePoint, ModelLayout, layout_of


def resolve_layout(model_or_layout) -> ModelLayout:
    return model_or_layout if isinstance(model_or_layout, ModelLayout) else layout_of(model_or_layout)


def to_engine(model_or_layout: nn.Module | ModelLayout, layers: list[dict[str, Any]],
              point: int | list[dict[str, int]], offset: int = 0,
              previous: list[dict[str, mx.array]] | None = None) -> list[dict[str, mx.array]]:
    """Per-layer objects captured at `point` -> per-layer (3) objects, tokens from `offset` on.

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


def install(model_or_layout: nn.Module | ModelLayout, layers: list[dict[str, Any]],
            point: int | list[dict[str, int]] = CapturePoint.ENGINE, offset: int = 0) -> list[Any]:
    """Fresh mlx-lm cache objects holding `layers` (per-layer objects at `point`).

    Build a new cache for every forward that should start from these objects: mlx-lm caches
    grow in place.
    """
    layout = resolve_layout(model_or_layout)
    if len(layers) != len(layout.layers):
        raise ValueError(f"{len(layers)} layers of objects for a model of {len(layout.layers)}")
    if point != CapturePoint.ENGINE:
        layers = to_engine(layout, layers, point, offset)
    return [layer.cache.build_cache(objects) for layer, objects in zip(layout.layers, layers)]
