"""Handoff sessions: one conversation, several models, one cache line per model.

The active model reads and writes the conversation; while it does, the per-token objects it
caches are recorded (capture points (1) and (2)), so that on a switch the target receives only
the spans it has not seen, translated and appended to its own cache line (segment-wise transfer,
KV-Lingo section 4.7). Strategies: `segment` (the default), `naive` (re-translate the whole prefix
at every switch), `refresh` (segment-wise, but re-prefill the target every N switches). A switch
falls back to re-prefilling the unseen span, visibly, when there is no translator for the pair,
when the translated tensors are not finite, or when the context is longer than the translator
allows. Every switch yields a `SwitchStatus` record that the chat, the benchmark and the tests
all read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx

from .capture import Capture, capture
from .layouts import CapturePoint, layout_of
from .layouts.linear_attention import RecurrentInputs

STRATEGIES = ("segment", "naive", "refresh")
RECORD_POINTS = (CapturePoint.RAW, CapturePoint.NORMED)


@dataclass
class SwitchStatus:
    source: str
    target: str
    status: str  # applied, fallback_reprefill, unsupported
    reason: str = ""
    strategy: str = "segment"
    tokens_translated: int = 0
    tokens_reprefilled: int = 0
    translate_seconds: float = 0.0


def _covers(value, length: int) -> bool:
    """Whether a translated object holds every token of the span (conv rows may hold K-1)."""
    n = value.length if isinstance(value, RecurrentInputs) else value.shape[1]
    return n == length


@dataclass
class CacheLine:
    """One model's view of the conversation: its cache and what it has read."""

    name: str
    lm: object  # LoadedModel
    cache: list | None = None
    seen: int = 0  # conversation tokens in `cache`
    recorded: list[Capture] = field(default_factory=list)  # per-token objects it computed itself
    recorded_from: int = 0  # conversation position of the first recorded token

    @property
    def layout(self):
        return layout_of(self.lm.model)


def _join_recorded(parts: list[Capture], start: int, stop: int, base: int) -> dict:
    """Per layer, (name, point) -> objects of conversation tokens [start, stop), for the objects
    every part recorded (a translated span holds what its translator produced)."""
    layers = [{} for _ in parts[0].objects]
    spanned = 0
    for part, offset in zip(parts, _offsets(parts, base)):
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
            out[key] = (RecurrentInputs.concatenate(pieces) if isinstance(pieces[0], RecurrentInputs)
                        else mx.concatenate(pieces, axis=1))
        joined.append(out)
    return joined


def _offsets(parts: list[Capture], base: int) -> list[int]:
    out, offset = [], base
    for part in parts:
        out.append(offset)
        offset += part.tokens.shape[1]
    return out


class Session:
    """A conversation that can move between models without re-reading.

    `models`: name -> LoadedModel; `translators`: (source, target) -> Translator.
    """

    def __init__(self, models: dict, translators: dict | None = None, active: str | None = None,
                 strategy: str = "segment", refresh_every: int = 4, max_context: int | None = None):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}")
        self.lines = {name: CacheLine(name, lm) for name, lm in models.items()}
        self.translators = {pair: tr.prepare() for pair, tr in (translators or {}).items()}
        self.active = active or next(iter(models))
        self.strategy, self.refresh_every = strategy, refresh_every
        self.max_context = max_context
        self.tokens: list[int] = []
        self.switches: list[SwitchStatus] = []

    # -- reading and writing ----------------------------------------------------------------
    def _read(self, line: CacheLine, upto: int) -> mx.array | None:
        """Let `line`'s model read conversation tokens [seen, upto); returns the last logits."""
        if upto <= line.seen:
            return None
        from mlx_lm.models.cache import make_prompt_cache

        if line.cache is None:
            line.cache = make_prompt_cache(line.lm.model)
        if not line.recorded:
            line.recorded_from = line.seen
        cap = capture(line.lm.model, self.tokens[line.seen:upto], points=RECORD_POINTS,
                      layout=line.layout, cache=line.cache)
        line.recorded.append(cap)
        line.seen = upto
        return cap.last_logits

    def add(self, token_ids: list[int]) -> None:
        """Append tokens to the conversation (a user turn, a generation prompt)."""
        self.tokens.extend(int(t) for t in token_ids)

    def generate(self, max_tokens: int = 256, temperature: float = 0.0,
                 stop: set[int] | None = None) -> Iterator[int]:
        """The active model continues the conversation, token by token (appended as it goes)."""
        line = self.lines[self.active]
        logits = self._read(line, len(self.tokens))
        if logits is None:
            raise ValueError("nothing new to respond to: add tokens first")
        for i in range(max_tokens):
            if temperature > 0:
                token = int(mx.random.categorical(logits / temperature))
            else:
                token = int(mx.argmax(logits, axis=-1))
            self.tokens.append(token)
            yield token
            if (stop and token in stop) or i == max_tokens - 1:
                break  # the last token is read with the next turn
            logits = self._read(line, len(self.tokens))

    # -- switching ----------------------------------------------------------------------------
    def switch(self, target: str) -> SwitchStatus:
        """Make `target` the active model, giving it what it has not seen."""
        if target not in self.lines:
            raise ValueError(f"unknown model {target!r}")
        source = self.active
        src, tgt = self.lines[source], self.lines[target]
        n = src.seen
        status = SwitchStatus(source, target, "applied", strategy=self.strategy)
        started = time.perf_counter()
        translator = self.translators.get((source, target))
        number = sum(1 for s in self.switches if s.target == target) + 1
        refresh = self.strategy == "refresh" and number % self.refresh_every == 0
        if source == target or n <= tgt.seen and self.strategy != "naive":
            status.status = "applied"
        elif translator is None:
            self._fallback(tgt, status, "no translator for this pair")
        elif refresh:
            self._fallback(tgt, status, f"refresh every {self.refresh_every} switches", full=True)
        elif self.max_context is not None and n > self.max_context:
            self._fallback(tgt, status, f"context {n} tokens is longer than the translator "
                                        f"allows ({self.max_context})")
        else:
            start = 0 if self.strategy == "naive" else tgt.seen
            if start < src.recorded_from:
                self._fallback(tgt, status, "the source did not record the span the target "
                                            "has not seen")
            else:
                try:
                    ok = self._translate(translator, src, tgt, start, n, status)
                except ValueError as e:  # the recorded span lacks what the translator reads
                    self._fallback(tgt, status, f"cannot translate the source's cache: {e}")
                else:
                    if not ok:
                        self._fallback(tgt, status, "translated tensors are not finite")
        status.translate_seconds = time.perf_counter() - started
        self.active = target
        self.switches.append(status)
        return status

    def _translate(self, translator, src: CacheLine, tgt: CacheLine, start: int, stop: int,
                   status: SwitchStatus) -> bool:
        from mlx_lm.models.cache import make_prompt_cache

        span = Capture(src.layout, mx.array([self.tokens[start:stop]]),
                       _join_recorded(src.recorded, start, stop, src.recorded_from), src.cache)
        for found, layer, cache in zip(span.objects, src.layout.layers, src.cache):
            for name, value in layer.cache.read_engine(cache).items():
                # fixed-size objects: the source's current state
                found[(name, CapturePoint.ENGINE)] = value
        target_layout = tgt.layout
        objects, points = translator.translate(span, tgt.lm.model, target_layout, span.tokens,
                                               all_rows=True)
        fresh = start == 0 or tgt.cache is None
        cache = make_prompt_cache(tgt.lm.model) if fresh else tgt.cache
        previous = None if fresh else [layer.cache.read_engine(c)
                                       for layer, c in zip(target_layout.layers, cache)]
        from .install import to_engine

        engine = to_engine(target_layout, objects, points, offset=start, previous=previous)
        if not all(bool(mx.isfinite(v).all()) for layer in engine for v in layer.values()):
            return False
        if fresh:
            cache = [layer.cache.build_cache(objs)
                     for layer, objs in zip(target_layout.layers, engine)]
        else:
            for layer, c, objs in zip(target_layout.layers, cache, engine):
                layer.cache.append(c, objs)
        if fresh:
            tgt.recorded, tgt.recorded_from = [], start
        # What the target now holds for the span, at the points the translator produced it:
        # a later switch away (naive) translates it onwards, errors and all.
        held = [{(name, points[i][name]): value for name, value in objs.items()
                 if points[i][name] != CapturePoint.ENGINE and _covers(value, stop - start)}
                for i, objs in enumerate(objects)]
        tgt.recorded.append(Capture(target_layout, span.tokens, held, cache))
        tgt.cache, tgt.seen = cache, stop
        status.tokens_translated = stop - start
        return True

    def _fallback(self, tgt: CacheLine, status: SwitchStatus, reason: str, full=False) -> None:
        """Re-prefill: the target reads what it has not seen (everything, when `full`)."""
        status.status, status.reason = "fallback_reprefill", reason
        if full:
            tgt.cache, tgt.seen, tgt.recorded = None, 0, []
        n = self.lines[self.active].seen
        status.tokens_reprefilled = n - tgt.seen
        self._read(tgt, n)

    def refresh(self, name: str | None = None) -> None:
        """Re-prefill a model's cache line from the conversation (on request)."""
        line = self.lines[name or self.active]
        line.cache, line.seen, line.recorded = None, 0, []
        self._read(line, self.lines[self.active].seen if line.name != self.active
                   else len(self.tokens))
