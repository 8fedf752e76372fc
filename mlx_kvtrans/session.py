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

What is recorded: per model, only what its outgoing translators read (`Translator.reads`); a
model with no translator from it records nothing. Under `segment` and `refresh` a recorded span
is dropped once every model this one has a translator to has read it; `naive` keeps everything.

Decoding is mlx-lm's own `generate_step` (prefill in its chunks, then pipelined steps), with the
recording taps installed once per turn. Convention: when a turn ends, the model has read every
token of the conversation but the last one generated (the next turn reads it first).
generate_step reads each token before yielding it, so a turn asks it for one token fewer and
takes the last one from its sampler; a turn that ends early (a stop token, a closed iterator)
takes back the model's last forward (trim the KV caches, restore the fixed-size ones).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterator

import mlx.core as mx

from .capture import PREFILL_CHUNK, Capture, capture, tapped
from .instrument import hook_module
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
    recorded_bytes: int = 0  # per-token objects every model holds after the switch


def _covers(value, length: int) -> bool:
    """Whether a translated object holds every token of the span (conv rows may hold K-1)."""
    n = value.length if isinstance(value, RecurrentInputs) else value.shape[1]
    return n == length


def _nbytes(value) -> int:
    return sum(x.nbytes for x in value.arrays()) if isinstance(value, RecurrentInputs) \
        else value.nbytes


@dataclass
class CacheLine:
    """One model's view of the conversation: its cache and what it has read."""

    name: str
    lm: object  # LoadedModel
    cache: list | None = None
    seen: int = 0  # conversation tokens in `cache`
    recorded: list[Capture] = field(default_factory=list)  # per-token objects, contiguous spans
    recorded_from: int = 0  # conversation position of the first recorded token
    own_recorded: list[int] = field(default_factory=lambda: [0, 0])  # bytes, tokens it computed

    @cached_property
    def layout(self):
        return layout_of(self.lm.model)

    @property
    def recorded_tokens(self) -> int:
        return sum(part.length for part in self.recorded)

    def recorded_bytes(self) -> int:
        """Bytes of the per-token objects held now (its own spans and translated ones)."""
        return sum(_nbytes(v) for part in self.recorded for layer in part.objects
                   for v in layer.values())

    @property
    def bytes_per_token(self) -> float:
        """Bytes recorded per token this model read itself (0 when it records nothing)."""
        size, tokens = self.own_recorded
        return size / tokens if tokens else 0.0


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


@contextlib.contextmanager
def _taking_back(model, cache: list, rec) -> Iterator[Callable[[], None]]:
    """Within the block, the function yielded takes back `model`'s last forward of one token:
    trimmable caches lose that token, the others (ArraysCache, whose slots every forward
    replaces and never writes into) get their slots back, and the recorder forgets what it
    recorded during that forward."""
    fixed = [c for c in cache if not c.is_trimmable()]
    before: list[list] = []

    def remember(module, args, kwargs):
        before[:] = [list(c.cache) for c in fixed]

    def take_back():
        for c in cache:
            if c.is_trimmable():
                c.trim(1)
        for c, slots in zip(fixed, before):
            c.cache = slots
        rec.drop_last()

    with hook_module(model, before=remember):
        yield take_back


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
        self._turn = None  # weak reference to a generation not yet finished

    # -- what is recorded ---------------------------------------------------------------------
    def receivers(self, name: str) -> list[str]:
        """The models `name` has a translator to."""
        return [t for (s, t) in self.translators if s == name and t != name and t in self.lines]

    def selection(self, name: str) -> set[tuple[int, str, int]]:
        """(layer, object, capture point) that `name` records per token: the union of what its
        outgoing translators read."""
        layout = self.lines[name].layout
        return set().union(*(self.translators[(name, t)].reads(layout)
                             for t in self.receivers(name)))

    def _keep(self, line: CacheLine, start: int, part: Capture, own: bool) -> None:
        """Hold `part` (conversation tokens from `start`) as recorded by `line`."""
        if not self.selection(line.name):
            line.recorded = []  # records nothing, holds nothing
            return
        if line.recorded and start != line.recorded_from + line.recorded_tokens:
            line.recorded = []  # spans are contiguous: a gap starts a new run
        if not line.recorded:
            line.recorded_from = start
        line.recorded.append(part)
        if own:
            line.own_recorded[0] += sum(_nbytes(v) for layer in part.objects
                                        for v in layer.values())
            line.own_recorded[1] += part.length

    def _drop_received(self) -> None:
        """Segment-wise transfer sends a span once: when every model a line has a translator to
        has read a span, the line's recorded objects of it go (`naive` keeps everything). Whole
        spans go: every model's `seen` is where some span ends."""
        if self.strategy == "naive":
            return
        for name, line in self.lines.items():
            receivers = self.receivers(name)
            if not receivers:
                line.recorded = []
                continue
            cut = min(self.lines[t].seen for t in receivers)
            while line.recorded and line.recorded_from + line.recorded[0].length <= cut:
                line.recorded_from += line.recorded.pop(0).length

    def recorded_bytes(self) -> dict[str, int]:
        """Per model: bytes of per-token objects held now."""
        return {name: line.recorded_bytes() for name, line in self.lines.items()}

    # -- reading and writing ----------------------------------------------------------------
    def _read(self, line: CacheLine, upto: int) -> mx.array | None:
        """Let `line`'s model read conversation tokens [seen, upto); returns the last logits."""
        if upto <= line.seen:
            return None
        from mlx_lm.models.cache import make_prompt_cache

        if line.cache is None:
            line.cache = make_prompt_cache(line.lm.model)
        start = line.seen
        cap = capture(line.lm.model, self.tokens[start:upto], points=RECORD_POINTS,
                      layout=line.layout, cache=line.cache, select=self.selection(line.name),
                      chunk_size=PREFILL_CHUNK)
        self._keep(line, start, cap, own=True)
        line.seen = upto
        return cap.last_logits

    def _finish_turn(self) -> None:
        """End a generation whose iterator is still open (as closing it would)."""
        turn = self._turn() if self._turn is not None else None
        if turn is not None:
            turn.close()
        self._turn = None

    def add(self, token_ids: list[int]) -> None:
        """Append tokens to the conversation (a user turn, a generation prompt)."""
        self._finish_turn()
        self.tokens.extend(int(t) for t in token_ids)

    def generate(self, max_tokens: int = 256, temperature: float = 0.0,
                 stop: set[int] | None = None, top_p: float = 1.0) -> Iterator[int]:
        """The active model continues the conversation, token by token (appended as it goes).

        mlx-lm's `generate_step` decodes (temperature > 0: mlx-lm's sampler, nucleus-filtered
        when `top_p` < 1); a stop token ends the turn. The turn ends when the iterator is
        exhausted or closed, or when the session is next used (add, generate, switch)."""
        self._finish_turn()
        line = self.lines[self.active]
        if len(self.tokens) <= line.seen:
            raise ValueError("nothing new to respond to: add tokens first")
        turn = self._decode(line, max_tokens, temperature, set(stop or ()), top_p)
        self._turn = weakref.ref(turn)
        return turn

    def _decode(self, line: CacheLine, max_tokens: int, temperature: float,
                stop: set[int], top_p: float = 1.0) -> Iterator[int]:
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.sample_utils import make_sampler

        if max_tokens < 1:
            self._read(line, len(self.tokens))
            return
        model, start = line.lm.model, line.seen
        if line.cache is None:
            line.cache = make_prompt_cache(model)
        sampler, drawn = make_sampler(temp=temperature, top_p=top_p), []

        def sample(logprobs):
            drawn[:] = [sampler(logprobs)]
            return drawn[0]

        select = self.selection(line.name)
        read = prompt_end = len(self.tokens)
        broken = False
        with tapped(model, line.layout, set(RECORD_POINTS), select) as rec, \
                _taking_back(model, line.cache, rec) as take_back:
            # generate_step reads each token before yielding it: ask for one fewer, and take
            # the last from the sampler (sampled after the last read, not read itself)
            steps = generate_step(mx.array(self.tokens[start:]), model,
                                  prompt_cache=line.cache, max_tokens=max_tokens - 1,
                                  sampler=sample)
            try:
                for token, _ in steps:
                    self.tokens.append(token)
                    read = len(self.tokens)
                    yield token
                    if token in stop:
                        return
                self.tokens.append(int(drawn[0].item()))
                yield self.tokens[-1]
            except GeneratorExit:
                raise  # closed at a yield: the cache is as `read` says
            except BaseException:
                broken = True  # stopped inside a forward: the cache is unknown
                raise
            finally:
                steps.close()
                if broken:
                    line.cache, line.seen, line.recorded = None, 0, []
                else:
                    if read == len(self.tokens) > prompt_end:
                        take_back()  # the last token is read with the next turn
                        read -= 1
                    objects = rec.joined()
                    mx.eval([v.arrays() if isinstance(v, RecurrentInputs) else v
                             for layer in objects for v in layer.values()])
                    part = Capture(line.layout, mx.array([self.tokens[start:read]]), objects,
                                   line.cache)
                    self._keep(line, start, part, own=True)
                    line.seen = read

    # -- switching ----------------------------------------------------------------------------
    def switch(self, target: str) -> SwitchStatus:
        """Make `target` the active model, giving it what it has not seen."""
        if target not in self.lines:
            raise ValueError(f"unknown model {target!r}")
        self._finish_turn()
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
        self._drop_received()
        status.recorded_bytes = sum(self.recorded_bytes().values())
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
            tgt.recorded = []
        # What the target now holds for the span, at the points the translator produced it and
        # its own translators read: a later switch away translates it onwards, errors and all.
        select = self.selection(tgt.name)
        held = [{(name, points[i][name]): value for name, value in objs.items()
                 if (i, name, points[i][name]) in select and _covers(value, stop - start)}
                for i, objs in enumerate(objects)]
        self._keep(tgt, start, Capture(target_layout, span.tokens, held, cache), own=False)
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
        self._finish_turn()
        line = self.lines[name or self.active]
        line.cache, line.seen, line.recorded = None, 0, []
        self._read(line, self.lines[self.active].seen if line.name != self.active
                   else len(self.tokens))
        self._drop_received()
