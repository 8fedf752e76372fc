"""Capture: prefill tokens through an mlx-lm model and read every cache object at (1), (2), (3).

Nothing of the model is copied: submodules are tapped and the recurrence `gated_delta_update` is
observed through `instrument` (safe to nest with the chunkwise recurrence or any other hook);
everything is restored when the prefill ends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .instrument import hook_module, observe_function, running_layer
from .layouts import CapturePoint, ModelLayout, layout_of
from .layouts.linear_attention import RecurrentInputs


@dataclass
class Capture:
    """Cache objects of one prefill. `objects[layer][(name, point)]` holds each captured object:
    per-token objects at (1)/(2) as `(B, T, token_dim)`, recurrent inputs at (2) as
    `RecurrentInputs`, and (3) tensors as the engine caches them."""

    layout: ModelLayout
    tokens: mx.array  # (B, T)
    objects: list[dict[tuple[str, int], Any]]
    engine: list[Any] = field(repr=False)  # the mlx-lm cache the prefill filled
    last_logits: mx.array | None = None  # (B, vocab) after the last token

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    def layer(self, index: int, point: int) -> dict[str, Any]:
        """Layer `index`'s objects, each at `obj.point_for(point)`."""
        found = self.objects[index]
        return {o.name: found[(o.name, o.point_for(point))]
                for o in self.layout.layers[index].objects}

    def at(self, point: int) -> list[dict[str, Any]]:
        return [self.layer(i, point) for i in range(len(self.objects))]


def _join(parts: list[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], RecurrentInputs):
        return RecurrentInputs.concatenate(parts)
    return mx.concatenate(parts, axis=1)


class _Recorder:
    """Collects tapped outputs per (layer, object, point) while a prefill runs."""

    def __init__(self, layout: ModelLayout, points: set[int]):
        self.layout, self.points = layout, points
        self.layer = -1
        self.parts: list[dict[tuple[str, int], list]] = [{} for _ in layout.layers]

    def record(self, name: str, point: int, value: Any) -> None:
        if point in self.points:
            self.parts[self.layer].setdefault((name, point), []).append(value)

    def pending(self) -> list[mx.array]:
        out = []
        for layer in self.parts:
            for values in layer.values():
                last = values[-1]
                out.extend(last.arrays() if isinstance(last, RecurrentInputs) else [last])
        return out

    def joined(self) -> list[dict[tuple[str, int], Any]]:
        return [{key: _join(values) for key, values in layer.items()} for layer in self.parts]


@contextlib.contextmanager
def tapped(model: nn.Module, layout: ModelLayout, points: set[int]):
    """Within the block, running `model` records cache objects at `points` into the recorder."""
    rec = _Recorder(layout, points)
    with contextlib.ExitStack() as stack:
        current = stack.enter_context(running_layer(model))

        def record(name, point, value):
            rec.layer = current["layer"]
            rec.record(name, point, value)

        for layer in layout.layers:
            for module, on_call in layer.cache.taps():
                stack.enter_context(hook_module(
                    module, after=lambda m, args, kw, out, f=on_call: f(record, args, out)))

        def recording_update(q, k, v, a, b, *args, **kwargs):
            record("state", CapturePoint.NORMED, RecurrentInputs(q, k, v, a, b))

        # one observer per mlx-lm module: its layers share the function it looks up
        for namespace in {getattr(layer.cache, "recurrence_namespace", None)
                          for layer in layout.layers} - {None}:
            stack.enter_context(observe_function(namespace, "gated_delta_update",
                                                 recording_update))
        yield rec


def capture(model: nn.Module, tokens, points=tuple(CapturePoint), chunk_size: int | None = None,
            layout: ModelLayout | None = None, cache: list | None = None) -> Capture:
    """Prefill `tokens` ((T,) or (B, T) ids) and capture every cache object at `points`.

    `chunk_size` prefills in chunks (as mlx-lm's generation does), which bounds memory on long
    prompts; the captured objects are the same. With `cache` (an mlx-lm cache that has read
    earlier tokens) the prefill continues it: (1)/(2) objects cover the new tokens, (3) objects
    are the whole cache.
    """
    from mlx_lm.models.cache import make_prompt_cache

    layout = layout or layout_of(model)
    tokens = mx.array(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    points = {CapturePoint(p) for p in points}
    engine = cache if cache is not None else make_prompt_cache(model)
    step = chunk_size or tokens.shape[1]
    with tapped(model, layout, points - {CapturePoint.ENGINE}) as rec:
        for start in range(0, tokens.shape[1], step):
            logits = model(tokens[:, start:start + step], cache=engine)
            mx.eval(logits[:, -1], rec.pending(), [c.state for c in engine])
    objects = rec.joined()
    if CapturePoint.ENGINE in points:
        for found, layer, cache in zip(objects, layout.layers, engine):
            for name, value in layer.cache.read_engine(cache).items():
                found[(name, CapturePoint.ENGINE)] = value
    return Capture(layout, tokens, objects, engine, logits[:, -1])
