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

The fidelity gate (`gate`): a switch translates the span except its last `gate_tokens` tokens,
which the target then reads itself, and compares its NLL on them with the source's; over the
translator's calibrated threshold, the target re-reads the span instead. The source's side comes
from the final-norm rows every model keeps of the last tokens it read (`CacheLine.tail`). A
translator that copies the source's recurrent state needs that state where the translation
stops, so a model with such a translator keeps a few snapshots of its fixed-size caches (every
`gate_tokens` positions, references to arrays, not copies), and the translation stops at one.

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
import copy
import time
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterator

import mlx.core as mx

from . import gate
from .capture import PREFILL_CHUNK, Capture, capture, tapped
from .instrument import hook_module, recording_final_rows
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
    translate_seconds: float = 0.0  # the whole switch: translation, read tail, gate, fallback
    recorded_bytes: int = 0  # per-token objects every model holds after the switch
    tokens_read: int = 0  # the span's last tokens, read by the target on the translated cache
    gate: str = ""  # passed, fired, uncalibrated, unchecked or off ("" when nothing translated)
    gate_note: str = ""  # why the gate did not judge (uncalibrated, unchecked)
    gate_gap: float | None = None  # nats/token: target's mean NLL on the tail - the source's
    gate_threshold: float | None = None
    gate_tokens: int = 0  # tokens the gap is taken over
    gate_seconds: float = 0.0  # the read tail and the comparison


def _covers(value, length: int) -> bool:
    """Whether a translated object holds every token of the span (conv rows may hold K-1)."""
    n = value.length if isinstance(value, RecurrentInputs) else value.shape[1]
    return n == length


def _nbytes(value) -> int:
    return sum(x.nbytes for x in value.arrays()) if isinstance(value, RecurrentInputs) \
        else value.nbytes


def _fixed_slots(cache: list) -> list[list]:
    """The arrays of each fixed-size cache (ArraysCache) as they are now: every forward replaces
    them, never writes into them, so holding the list holds this state."""
    return [list(c.cache) for c in cache if not c.is_trimmable()]


def _with_slots(cache: list, slots: list[list]) -> list:
    """`cache` with its fixed-size caches as `slots` had them (shallow copies; trimmable caches
    as they are)."""
    out, saved = [], iter(slots)
    for c in cache:
        if not c.is_trimmable():
            c = copy.copy(c)
            c.cache = list(next(saved))
        out.append(c)
    return out


def _head(part: Capture, n: int) -> Capture:
    """The first `n` tokens of a recorded span."""
    objects = [{key: value.slice(0, n) if isinstance(value, RecurrentInputs) else value[:, :n]
                for key, value in layer.items()} for layer in part.objects]
    return Capture(part.layout, part.tokens[:, :n], objects, part.engine)


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
    tail: gate.Tail | None = None  # final-norm rows of the last tokens it read
    states: dict[int, list] = field(default_factory=dict)  # position -> `_fixed_slots` there

    @cached_property
    def layout(self):
        return layout_of(self.lm.model)

    def reset(self) -> None:
        """Forget everything: no cache, nothing read."""
        self.cache, self.seen, self.recorded, self.tail, self.states = None, 0, [], None, {}

    def cut(self, stop: int) -> None:
        """Forget what was recorded of conversation tokens from `stop` on (the cache itself is
        the caller's to trim)."""
        kept, offset = [], self.recorded_from
        for part in self.recorded:
            if offset + part.length <= stop:
                kept.append(part)
            elif offset < stop:
                kept.append(_head(part, stop - offset))
            offset += part.length
        self.recorded = kept
        self.tail = self.tail.cut(stop) if self.tail is not None else None
        self.states = {p: s for p, s in self.states.items() if p <= stop}

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

    `models`: name -> LoadedModel; `translators`: (source, target) -> Translator;
    `gate_tokens`: r, the span's last tokens the target reads itself at a switch and the gate
    compares (0: translate everything, no gate).
    """

    def __init__(self, models: dict, translators: dict | None = None, active: str | None = None,
                 strategy: str = "segment", refresh_every: int = 4, max_context: int | None = None,
                 gate_tokens: int = gate.GATE_TOKENS):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}")
        if gate_tokens < 0:
            raise ValueError("gate_tokens must be 0 (no gate) or more")
        self.lines = {name: CacheLine(name, lm) for name, lm in models.items()}
        self.translators = {pair: tr.prepare() for pair, tr in (translators or {}).items()}
        self.active = active or next(iter(models))
        self.strategy, self.refresh_every = strategy, refresh_every
        self.max_context = max_context
        self.gate_tokens = gate_tokens
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

    def keeps_states(self, name: str) -> bool:
        """Whether `name` keeps snapshots of its fixed-size caches: a translator from it reads
        its state, which the gate needs where the translation stops, r tokens back."""
        return self.gate_tokens > 0 and any(
            CapturePoint.ENGINE in self.translators[(name, t)].source_points()
            for t in self.receivers(name))

    @property
    def _tail_rows(self) -> int:
        # a translation that stops at a state snapshot leaves up to 2r tokens to the target
        return 2 * self.gate_tokens

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

    def _keep_tail(self, line: CacheLine, rows, end: int, first_generated: int | None = None):
        """Hold the final-norm `rows` of the tokens `line` read up to `end`."""
        tail = gate.tail_of(rows, end, first_generated)
        if tail is not None:
            line.tail = tail if line.tail is None else line.tail.then(tail, self._tail_rows)

    def _snapshot(self, line: CacheLine) -> None:
        """Keep `line`'s fixed-size state where it stands, and of the older snapshots only those
        a translation could still stop at (the last one at least r tokens back, and later)."""
        if not self.keeps_states(line.name) or line.cache is None:
            return
        line.states[line.seen] = _fixed_slots(line.cache)
        back = [p for p in line.states if p <= line.seen - self.gate_tokens]
        floor = max(back, default=0)
        line.states = {p: s for p, s in line.states.items() if floor <= p <= line.seen}

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
    def _read(self, line: CacheLine, upto: int) -> None:
        """Let `line`'s model read conversation tokens [seen, upto), keeping what it records,
        the final-norm rows of the last of them and (when it keeps states) a snapshot r tokens
        before the end."""
        if upto <= line.seen:
            return
        from mlx_lm.models.cache import make_prompt_cache

        if line.cache is None:
            line.cache = make_prompt_cache(line.lm.model)
        if self.keeps_states(line.name) and upto - line.seen > self.gate_tokens:
            self._capture(line, upto - self.gate_tokens)
        self._snapshot(line)
        self._capture(line, upto)
        self._snapshot(line)

    def _capture(self, line: CacheLine, upto: int) -> None:
        start = line.seen
        with contextlib.ExitStack() as stack:
            rows = (stack.enter_context(recording_final_rows(line.lm.model, self._tail_rows))
                    if self.gate_tokens else None)
            cap = capture(line.lm.model, self.tokens[start:upto], points=RECORD_POINTS,
                          layout=line.layout, cache=line.cache,
                          select=self.selection(line.name), chunk_size=PREFILL_CHUNK)
        self._keep(line, start, cap, own=True)
        line.seen = upto
        if rows is not None:
            self._keep_tail(line, rows.last(upto - start), upto)

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
        # the prompt but its last r tokens is read first, so that the last r, read by
        # generate_step, are a forward of their own: their final-norm rows cost a few rows of
        # the last layer, and a state snapshot falls r tokens before the prompt's end
        tail_from = prompt_end - self.gate_tokens if self.gate_tokens and \
            prompt_end - start > self.gate_tokens + 1 else start
        broken = False
        with contextlib.ExitStack() as stack:
            rec = stack.enter_context(tapped(model, line.layout, set(RECORD_POINTS), select))
            take_back = stack.enter_context(_taking_back(model, line.cache, rec))
            if self.keeps_states(line.name):
                stack.enter_context(_snapshots(self, line, tail_from))
            for begin in range(start, tail_from, PREFILL_CHUNK):
                model(mx.array([self.tokens[begin:min(begin + PREFILL_CHUNK, tail_from)]]),
                      cache=line.cache)
                mx.eval([c.state for c in line.cache], rec.pending())
            rows = (stack.enter_context(recording_final_rows(model, self._tail_rows + 1))
                    if self.gate_tokens else None)  # one more: the last forward may go back
            # generate_step reads each token before yielding it: ask for one fewer, and take
            # the last from the sampler (sampled after the last read, not read itself)
            steps = generate_step(mx.array(self.tokens[tail_from:]), model,
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
                    line.reset()
                else:
                    if read == len(self.tokens) > prompt_end:
                        take_back()  # the last token is read with the next turn
                        if rows is not None:
                            rows.drop_last()
                        read -= 1
                    objects = rec.joined()
                    mx.eval([v.arrays() if isinstance(v, RecurrentInputs) else v
                             for layer in objects for v in layer.values()])
                    part = Capture(line.layout, mx.array([self.tokens[start:read]]), objects,
                                   line.cache)
                    self._keep(line, start, part, own=True)
                    line.seen = read
                    if rows is not None:
                        self._keep_tail(line, rows.last(min(self._tail_rows, read - tail_from)),
                                        read, first_generated=prompt_end)
                    self._snapshot(line)

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
                self._hand_over(translator, src, tgt, start, n, status)
        status.translate_seconds = time.perf_counter() - started
        self.active = target
        self._drop_received()
        status.recorded_bytes = sum(self.recorded_bytes().values())
        self.switches.append(status)
        return status

    def _handoff_point(self, translator, src: CacheLine, start: int, n: int) -> tuple[int, str]:
        """(C, why the gate cannot run): the translation covers [start, C), the target reads
        [C, n) itself. C = n - r; a translator that reads the source's state stops at a state
        snapshot between n - 2r and n - 2; a span of r tokens or fewer is read, not translated."""
        r = self.gate_tokens
        if r == 0:
            return n, ""
        if n - start <= r:
            return start, "the target read the whole span itself"
        if CapturePoint.ENGINE not in translator.source_points():
            return n - r, ""
        back = [p for p in src.states if start <= p <= n - r and n - p <= 2 * r]
        ahead = [p for p in src.states if max(start, n - r) < p <= n - 2]
        if back or ahead:
            return (max(back) if back else min(ahead)), ""
        return n, "the source kept no state a few tokens back (the translator reads its state)"

    def _hand_over(self, translator, src: CacheLine, tgt: CacheLine, start: int, n: int,
                   status: SwitchStatus) -> None:
        """Translate [start, C), let the target read [C, n), and let the gate judge: over its
        threshold, the target re-reads [start, n) instead."""
        handoff, why = self._handoff_point(translator, src, start, n)
        before = None if tgt.cache is None or start == 0 else _fixed_slots(tgt.cache)
        if handoff > start:
            try:
                ok = self._translate(translator, src, tgt, start, handoff, status)
            except ValueError as e:  # the recorded span lacks what the translator reads
                self._fallback(tgt, status, f"cannot translate the source's cache: {e}")
                return
            if not ok:
                self._fallback(tgt, status, "translated tensors are not finite")
                return
            self._snapshot(tgt)
        if self.gate_tokens == 0:
            status.gate = "off"
            return
        if handoff == n:
            status.gate, status.gate_note = "unchecked", why
            return
        started = time.perf_counter()
        self._read(tgt, n)
        status.tokens_read = n - handoff
        if handoff == start:
            status.gate, status.gate_note = "unchecked", why
            status.gate_seconds = time.perf_counter() - started
            return
        reading = gate.compare(src.lm.model, src.tail, tgt.lm.model, tgt.tail, self.tokens,
                               handoff, n)
        status.gate_seconds = time.perf_counter() - started
        if reading is None:
            status.gate, status.gate_note = "unchecked", ("the source holds no predictions of "
                                                          "the span's last tokens")
            return
        threshold, why = gate.threshold(translator.info.get("gate"), self.gate_tokens,
                                        reading.generated, n)
        status.gate_gap, status.gate_tokens, status.gate_threshold = (
            reading.gap, reading.tokens, threshold)
        if threshold is None:
            status.gate, status.gate_note = "uncalibrated", why
        elif reading.gap <= threshold:
            status.gate = "passed"
        else:
            status.gate = "fired"
            self._take_back(tgt, start, before)
            status.tokens_translated = status.tokens_read = 0
            self._fallback(tgt, status, f"fidelity gate: the target's NLL on the last "
                                        f"{reading.tokens} tokens is {reading.gap:+.2f} "
                                        f"nats/token from the source's, over the translator's "
                                        f"threshold {threshold:.2f}")

    def _take_back(self, line: CacheLine, start: int, fixed: list | None) -> None:
        """Put `line` back where it stood at `start`, before a switch wrote into it (`fixed`:
        its fixed-size caches' slots then; None when it had nothing)."""
        if fixed is None:
            line.reset()
            return
        for c in line.cache:
            if c.is_trimmable():
                c.trim(line.seen - start)
        for c, slots in zip((c for c in line.cache if not c.is_trimmable()), fixed):
            c.cache = slots
        line.cut(start)
        line.seen = start

    def _translate(self, translator, src: CacheLine, tgt: CacheLine, start: int, stop: int,
                   status: SwitchStatus) -> bool:
        from mlx_lm.models.cache import make_prompt_cache

        span = Capture(src.layout, mx.array([self.tokens[start:stop]]),
                       _join_recorded(src.recorded, start, stop, src.recorded_from), src.cache)
        # fixed-size objects: the source's state where the span ends (a snapshot, when the
        # translation stops before the source's end)
        snapshot = src.states.get(stop) if stop < src.seen else None
        engine = src.cache if snapshot is None else _with_slots(src.cache, snapshot)
        for found, layer, cache in zip(span.objects, src.layout.layers, engine):
            if stop < src.seen and snapshot is None and not cache.is_trimmable():
                continue  # no state there (a translator that reads it stops at a snapshot)
            for name, value in layer.cache.read_engine(cache).items():
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
            tgt.recorded, tgt.tail, tgt.states = [], None, {}
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
            tgt.reset()
        n = self.lines[self.active].seen
        status.tokens_reprefilled = n - tgt.seen
        self._read(tgt, n)

    def refresh(self, name: str | None = None) -> None:
        """Re-prefill a model's cache line from the conversation (on request)."""
        self._finish_turn()
        line = self.lines[name or self.active]
        line.reset()
        self._read(line, self.lines[self.active].seen if line.name != self.active
                   else len(self.tokens))
        self._drop_received()


@contextlib.contextmanager
def _snapshots(session: Session, line: CacheLine, first: int) -> Iterator[None]:
    """Within the block, `line` keeps a snapshot of its fixed-size caches before each forward
    at `first` and then every r positions (the first forward starting at or past each mark)."""
    position, mark = [line.seen], [first]

    def before(module, args, kwargs):
        if position[0] >= mark[0]:
            line.states[position[0]] = _fixed_slots(line.cache)
            mark[0] = position[0] + session.gate_tokens
        position[0] += args[0].shape[1]

    with hook_module(line.lm.model, before=before):
        yield
