"""The interface every layer's cache implements, whatever objects it holds.

A `LayerCache` is bound to one layer's mixer module of a loaded mlx-lm model. It knows:
- `objects`: what the engine caches there (`CacheObject`s);
- `taps`: which submodule outputs to record during a prefill to get the objects at raw and normed;
- `read_engine`: the engine objects out of an mlx-lm cache object;
- `to_engine`: raw or normed objects -> engine, applying this model's own norm / RoPE / recurrence;
- `build_cache`: an mlx-lm cache object holding given engine objects.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from .objects import CacheObject

# record(object name, capture point, value): called by taps during a prefill.
Record = Callable[[str, int, Any], None]
# A tap: after `module` runs, `on_call(record, args, output)`.
Tap = tuple[nn.Module, Callable[[Record, tuple, Any], None]]


def apply_rope(name: str, rope, x: mx.array, offset: int) -> mx.array:
    """How a layer rotates an object by default: its own RoPE, now. `install` passes another
    `rotate` that applies one RoPE to the same object of many layers at once."""
    return rope(x, offset=offset)


class LayerCache:
    mixer: str  # short name of the layer kind: gqa, mla, mla+indexer, gdn, kda
    cache_class: str  # the mlx-lm cache class that `make_prompt_cache` gives this layer
    objects: tuple[CacheObject, ...]

    def taps(self) -> list[Tap]:
        raise NotImplementedError

    def read_engine(self, cache) -> dict[str, mx.array]:
        raise NotImplementedError

    def to_engine(self, objects: dict[str, Any], point: int, offset: int = 0,
                  previous: dict[str, mx.array] | None = None,
                  rotate=apply_rope) -> dict[str, mx.array]:
        """Objects captured at `point` for tokens starting at position `offset` -> engine objects.

        `point`: one capture point for all objects (each is read at `obj.point_for(point)`, as
        `Capture.layer` gives them), or a point per object name (a translator's output).
        `previous`: the engine objects of the tokens before `offset`, for fixed-size objects that
        summarise the whole history (conv history, recurrent state). `rotate(name, rope, x,
        offset)` applies RoPE; the object is only cast after it.
        """
        raise NotImplementedError

    def build_cache(self, objects: dict[str, mx.array]):
        raise NotImplementedError

    def append(self, cache, objects: dict[str, mx.array]):
        """Grow `cache` by engine objects of the tokens after it (per-token objects are appended,
        fixed-size ones replaced); returns the cache."""
        raise NotImplementedError

    def point_of(self, name: str, point: int | dict[str, int]) -> int:
        return point[name] if isinstance(point, dict) else self.object(name).point_for(point)

    def object(self, name: str) -> CacheObject:
        return next(o for o in self.objects if o.name == name)

    def cast(self, name: str, value: mx.array) -> mx.array:
        return value.astype(getattr(mx, self.object(name).dtype))


def kv_cache(keys: mx.array, values: mx.array):
    """An mlx-lm `KVCache` holding `keys`/`values` `(B, heads, T, dim)`; offset drives RoPE and mask."""
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    cache.keys = keys
    cache.values = values
    cache.offset = keys.shape[2]
    return cache


def kv_append(cache, keys: mx.array, values: mx.array):
    """Append to a `KVCache` the way the engine does (offset advances, RoPE positions follow)."""
    cache.update_and_fetch(keys, values)
    return cache


def kv_contents(cache) -> tuple[mx.array, mx.array]:
    """Valid `(keys, values)` of a `KVCache`: its buffer grows in steps, only `:offset` is data."""
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


class CacheListLayer(LayerCache):
    """Several caches in one layer, as mlx-lm's `CacheList` (DSA: MLA + indexer keys)."""

    def __init__(self, parts: list[LayerCache]):
        self.parts = parts
        self.mixer = "+".join(p.mixer for p in parts)
        self.cache_class = "CacheList(" + ", ".join(p.cache_class for p in parts) + ")"
        self.objects = tuple(o for p in parts for o in p.objects)

    def taps(self):
        return [tap for p in self.parts for tap in p.taps()]

    def read_engine(self, cache):
        return {k: v for p, c in zip(self.parts, cache.caches) for k, v in p.read_engine(c).items()}

    def to_engine(self, objects, point, offset=0, previous=None, rotate=apply_rope):
        out = {}
        for p in self.parts:
            mine = {o.name: objects[o.name] for o in p.objects}
            out.update(p.to_engine(mine, point, offset, previous and
                                   {o.name: previous[o.name] for o in p.objects}, rotate))
        return out

    def build_cache(self, objects):
        from mlx_lm.models.cache import CacheList

        return CacheList(*(p.build_cache({o.name: objects[o.name] for o in p.objects})
                           for p in self.parts))

    def append(self, cache, objects):
        for part, c in zip(self.parts, cache.caches):
            part.append(c, {o.name: objects[o.name] for o in part.objects})
        return cache
