"""Prefill tokens through an mlx-lm model and read every cache object at raw, normed, engine.

Nothing of the model is copied: submodules are tapped and the recurrence `gated_delta_update` is
observed through `instrument` (safe to nest with the chunkwise recurrence or any other hook);
everything is restored when the prefill ends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn

from ..layouts import CapturePoint, ModelLayout, layout_of
from ..layouts.linear_attention import RecurrentInputs
from .instrument import (head_on_last_token, hook_module, language_model, observe_function,
                         running_layer)

# the hidden state entering a layer (B, T, hidden), recorded as `objects[layer][RESIDUAL]` where
# asked for: what a relay's target layers read in place of their own earlier layers
RESIDUAL = ("residual", CapturePoint.RAW)


@dataclass
class Capture:
    """Cache objects of one prefill. `objects[layer][(name, point)]` holds each captured object:
    per-token objects at raw/normed as `(B, T, token_dim)`, recurrent inputs at normed as
    `RecurrentInputs`, and engine tensors as the engine caches them."""

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
    """Collects tapped outputs per (layer, object, point) while a prefill runs; with `select`,
    only those (layer, object name, point) triples."""

    def __init__(self, layout: ModelLayout, points: set[int],
                 select: set[tuple[int, str, int]] | None = None):
        self.layout = layout
        self.points = points
        self.select = select
        self.parts: list[dict[tuple[str, int], list]] = [{} for _ in layout.layers]

    def wants(self, layer: int, name: str | None = None, point: int | None = None) -> bool:
        """Whether anything of `layer` (of its object `name` at `point`, when given) is kept."""
        if point is not None and point not in self.points:
            return False
        if self.select is None:
            return True
        return any(l == layer and name in (None, n) and point in (None, p)
                   for l, n, p in self.select)

    def recorder(self, layer: int):
        """`record(name, point, value)` for the taps of one layer (they run every forward)."""
        parts, points = self.parts[layer], self.points
        wanted = None if self.select is None else {(n, p) for l, n, p in self.select
                                                   if l == layer}

        def record(name: str, point: int, value: Any) -> None:
            if point in points and (wanted is None or (name, point) in wanted):
                parts.setdefault((name, point), []).append(value)
        return record

    def keep_residual(self, layer: int, value: mx.array) -> None:
        self.parts[layer].setdefault(RESIDUAL, []).append(value)

    def drop_last(self) -> None:
        """Forget the last forward's objects (each forward appends one of each)."""
        for layer in self.parts:
            for key in list(layer):
                del layer[key][-1]
                if not layer[key]:
                    del layer[key]

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
def tapped(model: nn.Module, layout: ModelLayout, points: set[int],
           select: set[tuple[int, str, int]] | None = None, residuals: Iterable[int] = ()):
    """Within the block, running `model` records cache objects at `points` into the recorder
    (every forward appends; `rec.joined()` concatenates them). `select`: record only these
    (layer, object name, point) triples; no hook is installed where nothing is selected.
    The hidden state entering each of the `residuals` layers, and each layer `select` names
    with `RESIDUAL`, is recorded too."""
    rec = _Recorder(layout, set(points), select)
    residuals = set(residuals) | {l for l, n, p in select or () if (n, p) == RESIDUAL}
    with contextlib.ExitStack() as stack:
        stack_layers = language_model(model).model.layers if residuals else []
        for index in sorted(residuals):
            stack.enter_context(hook_module(
                stack_layers[index],
                before=lambda m, args, kw, i=index: rec.keep_residual(i, args[0])))
        records = [rec.recorder(index) for index in range(len(layout.layers))]
        for index, layer in enumerate(layout.layers):
            if not rec.wants(index):
                continue
            for module, on_call in layer.cache.taps():
                stack.enter_context(hook_module(
                    module, after=lambda m, args, kw, out, f=on_call, r=records[index]:
                    f(r, args, out)))

        # one observer per mlx-lm module: its layers share the function it looks up, so it
        # learns the calling layer from `running_layer`
        namespaces = {getattr(layer.cache, "recurrence_namespace", None)
                      for index, layer in enumerate(layout.layers)
                      if rec.wants(index, "state", CapturePoint.NORMED)} - {None}
        if namespaces:
            current = stack.enter_context(running_layer(model))

            def recording_update(q, k, v, a, b, *args, **kwargs):
                records[current["layer"]]("state", CapturePoint.NORMED,
                                          RecurrentInputs(q, k, v, a, b))

            for namespace in namespaces:
                stack.enter_context(observe_function(namespace, "gated_delta_update",
                                                     recording_update))
        yield rec


PREFILL_CHUNK = 2048  # mlx-lm generation's default prefill step


def capture(model: nn.Module, tokens, points=tuple(CapturePoint), chunk_size: int | None = None,
            layout: ModelLayout | None = None, cache: list | None = None,
            select: set[tuple[int, str, int]] | None = None,
            residuals: Iterable[int] = ()) -> Capture:
    """Prefill `tokens` ((T,) or (B, T) ids) and capture every cache object at `points`.

    `chunk_size` prefills in chunks (as mlx-lm's generation does), which bounds memory on long
    prompts; the captured objects are the same. With `cache` (an mlx-lm cache that has read
    earlier tokens) the prefill continues it: raw/normed objects cover the new tokens, engine objects
    are the whole cache. `select`: capture only these (layer, object name, point) triples
    (None: every object at `points`). `residuals`: layers whose entering hidden state is
    recorded too (`RESIDUAL`).
    """
    from mlx_lm.models.cache import make_prompt_cache

    layout = layout or layout_of(model)
    tokens = mx.array(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    points = {CapturePoint(p) for p in points}
    engine = cache if cache is not None else make_prompt_cache(model)
    step = chunk_size or tokens.shape[1]
    with tapped(model, layout, points - {CapturePoint.ENGINE}, select, residuals) as rec, \
            head_on_last_token(model):
        for start in range(0, tokens.shape[1], step):
            logits = model(tokens[:, start:start + step], cache=engine)
            mx.eval(logits[:, -1], rec.pending(), [c.state for c in engine])
    objects = rec.joined()
    if CapturePoint.ENGINE in points:
        for index, (found, layer, cache) in enumerate(zip(objects, layout.layers, engine)):
            for name, value in layer.cache.read_engine(cache).items():
                if select is None or (index, name, CapturePoint.ENGINE) in select:
                    found[(name, CapturePoint.ENGINE)] = value
    return Capture(layout, tokens, objects, engine, logits[:, -1])


def join_recorded(parts: list[Capture], start: int, stop: int, base: int) -> list[dict]:
    """Per layer, (name, point) -> objects of conversation tokens [start, stop), for the objects
    every part recorded (a translated span holds what its translator produced); `base`: the
    conversation position of the first part."""
    layers = [{} for _ in parts[0].objects]
    spanned = 0
    for part, offset in zip(parts, offsets(parts, base)):
        lo, hi = max(start, offset) - offset, min(stop, offset + part.tokens.shape[1]) - offset
        if hi <= lo:
            continue
        spanned += 1
        for layer, found in zip(layers, part.objects):
            for key, value in found.items():
                if key[1] == CapturePoint.ENGINE:
                    continue
                piece = value.slice(lo, hi) if isinstance(value, RecurrentInputs) \
                    else value[:, lo:hi]
                layer.setdefault(key, []).append(piece)
    joined = []
    for layer in layers:
        out = {}
        for key, pieces in layer.items():
            if len(pieces) != spanned:
                continue  # some part of the span lacks it
            out[key] = (RecurrentInputs.concatenate(pieces)
                        if isinstance(pieces[0], RecurrentInputs)
                        else mx.concatenate(pieces, axis=1))
        joined.append(out)
    return joined


def offsets(parts: list[Capture], base: int) -> list[int]:
    """The conversation position of each recorded part's first token."""
    out, offset = [], base
    for part in parts:
        out.append(offset)
        offset += part.tokens.shape[1]
    return out
