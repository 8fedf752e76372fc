"""The cache line: one model's view of a conversation (its cache, what it has read, and the
per-token objects it recorded), and the arithmetic on recorded spans.

A recorded span is a `Capture` of consecutive conversation tokens; a line holds contiguous
spans, the first at `recorded_from`. Fixed-size caches (mlx-lm's `ArraysCache`) are replaced,
never written into, by every forward: a list of their arrays is a snapshot of their state.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cached_property

import mlx.core as mx

from ..capture import Capture, join_recorded
from ..layouts import CapturePoint, layout_of
from ..layouts.linear_attention import RecurrentInputs
from ..translators.gate import Tail, tail_of


def covers(value, length: int) -> bool:
    """Whether a translated object holds every token of the span (conv rows may hold K-1)."""
    n = value.length if isinstance(value, RecurrentInputs) else value.shape[1]
    return n == length


def nbytes(value) -> int:
    """Bytes of one recorded object (an array, or a state's per-token inputs)."""
    return sum(x.nbytes for x in value.arrays()) if isinstance(value, RecurrentInputs) \
        else value.nbytes


def capture_bytes(part: Capture) -> int:
    """Bytes of every object a recorded span holds."""
    return sum(nbytes(v) for layer in part.objects for v in layer.values())


def fixed_slots(cache: list) -> list[list]:
    """The arrays of each fixed-size cache (ArraysCache) as they are now: every forward replaces
    them, never writes into them, so holding the list holds this state."""
    return [list(c.cache) for c in cache if not c.is_trimmable()]


def with_slots(cache: list, slots: list[list]) -> list:
    """`cache` with its fixed-size caches as `slots` had them (shallow copies; trimmable caches
    as they are)."""
    out, saved = [], iter(slots)
    for c in cache:
        if not c.is_trimmable():
            c = copy.copy(c)
            c.cache = list(next(saved))
        out.append(c)
    return out


def head(part: Capture, n: int) -> Capture:
    """The first `n` tokens of a recorded span."""
    return _tokens(part, 0, n)


def split(part: Capture, n: int) -> tuple[Capture, Capture]:
    """A recorded span as its first `n` tokens and the rest."""
    return _tokens(part, 0, n), _tokens(part, n, part.length)


def _tokens(part: Capture, lo: int, hi: int) -> Capture:
    objects = [{key: value.slice(lo, hi) if isinstance(value, RecurrentInputs)
                else value[:, lo:hi] for key, value in layer.items()} for layer in part.objects]
    return Capture(part.layout, part.tokens[:, lo:hi], objects, part.engine)


@dataclass
@dataclass(frozen=True)
class Recording:
    """What a line keeps as its model reads, as the translators from it need: the objects they
    read (`select`; none: it keeps no span), the places a translation from it may stop
    (`marks`, largest first), whether it snapshots its fixed-size caches there (`keeps_states`),
    and the fidelity gate's tail (`gate_tokens`)."""

    select: frozenset = frozenset()
    marks: tuple[int, ...] = ()
    keeps_states: bool = False
    gate_tokens: int = 0

    @property
    def tail_rows(self) -> int:
        """Final-norm rows a line keeps: a translation that stops at a state snapshot leaves up
        to 2r tokens to the target."""
        return 2 * self.gate_tokens


@dataclass
class CacheLine:
    """One model's view of the conversation: its cache, what it has read and what it keeps
    (`recording`)."""

    name: str
    lm: object  # LoadedModel
    cache: list | None = None
    seen: int = 0  # conversation tokens in `cache`
    recorded: list[Capture] = field(default_factory=list)  # per-token objects, contiguous spans
    recorded_from: int = 0  # conversation position of the first recorded token
    own_recorded: list[int] = field(default_factory=lambda: [0, 0])  # bytes, tokens it computed
    tail: Tail | None = None  # final-norm rows of the last tokens it read
    states: dict[int, list] = field(default_factory=dict)  # position -> `fixed_slots` there
    next_logits: mx.array | None = field(default=None, repr=False)  # (vocab,) after token seen-1
    recording: Recording = field(default_factory=Recording)

    @cached_property
    def shards(self):
        """How mlx-lm sharded the model across processes (None: held whole here)."""
        from ..translators.sharding import shards_of

        return shards_of(self.lm.model)

    @cached_property
    def layout(self):
        """The whole model's layout: what is recorded and translated, sharded or not."""
        return layout_of(self.lm.model) if self.shards is None else self.shards.whole

    @property
    def local_layout(self):
        """The layout of what this process runs and caches."""
        return self.layout if self.shards is None else self.shards.local

    def local_select(self, select: set | None) -> set | None:
        return select if self.shards is None else self.shards.local_select(select)

    def whole(self, part: Capture) -> Capture:
        """A capture of this process's model -> the whole model's (sharded: a collective)."""
        return part if self.shards is None else self.shards.whole_capture(part)

    def reset(self) -> None:
        """Forget everything: no cache, nothing read."""
        self.cache = None
        self.seen = 0
        self.recorded = []
        self.tail = None
        self.states = {}
        self.next_logits = None

    def copy_from(self, other: "CacheLine") -> None:
        """Hold what `other` holds: its cache copied; its recorded spans, gate rows and state
        snapshots shared, since no line writes into them (it replaces them)."""
        self.cache, self.seen = copy.deepcopy(other.cache), other.seen
        self.recorded, self.recorded_from = list(other.recorded), other.recorded_from
        self.own_recorded = list(other.own_recorded)
        self.tail, self.states = other.tail, dict(other.states)

    def cut(self, stop: int) -> None:
        """Forget what was recorded of conversation tokens from `stop` on (the cache itself is
        the caller's to trim)."""
        self.next_logits = None
        kept, offset = [], self.recorded_from
        for part in self.recorded:
            if offset + part.length <= stop:
                kept.append(part)
            elif offset < stop:
                kept.append(head(part, stop - offset))
            offset += part.length
        self.recorded = kept
        self.tail = self.tail.cut(stop) if self.tail is not None else None
        self.states = {p: s for p, s in self.states.items() if p <= stop}

    def rewind(self, start: int, fixed: list | None) -> None:
        """Put the line back where it stood at `start`, before a switch wrote into it (`fixed`:
        its fixed-size caches' slots then; None when it had nothing)."""
        if fixed is None:
            self.reset()
            return
        for c in self.cache:
            if c.is_trimmable():
                c.trim(self.seen - start)
        for c, slots in zip((c for c in self.cache if not c.is_trimmable()), fixed):
            c.cache = slots
        self.cut(start)
        self.seen = start

    def peek(self, ids: list[int]) -> mx.array | None:
        """(len(ids), V) logits of the model reading `ids` after what it holds, its cache left
        as it was (attention caches trimmed back, fixed-size states put back) and nothing else
        of the line changed. None where that cannot be promised: a cache that is neither
        trimmable nor an `ArraysCache` (a rotating window, a list holding a state), or a
        sharded model (each process would decide alone whether to read)."""
        from mlx_lm.models.cache import ArraysCache

        from ..capture.instrument import fastest_recurrence, short_reads

        if self.cache is None or self.shards is not None:
            return None
        states = [isinstance(c, ArraysCache) for c in self.cache]
        if not all(state or c.is_trimmable() and not hasattr(c, "max_size")
                   for c, state in zip(self.cache, states)):
            return None
        before = [list(c.cache) if state else None for c, state in zip(self.cache, states)]
        with short_reads(self.lm.model), fastest_recurrence():  # as a turn is read
            logits = self.lm.model(mx.array(ids)[None], cache=self.cache)[0]
            mx.eval(logits)
        for c, slots in zip(self.cache, before):
            if slots is None:
                c.trim(len(ids))
            else:
                c.cache = slots
        return logits

    def keep(self, start: int, part: Capture, own: bool) -> None:
        """Hold `part` (conversation tokens from `start`) as recorded (`own`: this line's model
        computed it, rather than a translator)."""
        if not self.recording.select:
            self.recorded = []  # records nothing, holds nothing
            return
        if self.recorded and start != self.recorded_from + self.recorded_tokens:
            self.recorded = []  # spans are contiguous: a gap starts a new run
        if not self.recorded:
            self.recorded_from = start
        self.recorded.append(part)
        if own:
            self.own_recorded[0] += capture_bytes(part)
            self.own_recorded[1] += part.length

    def keep_tail(self, rows, end: int, generated: range | None = None) -> None:
        """Hold the final-norm `rows` of the tokens read up to `end` (`generated`: the positions
        of tokens this model sampled)."""
        tail = tail_of(rows, end, generated)
        if tail is not None:
            self.tail = tail if self.tail is None else self.tail.then(tail,
                                                                       self.recording.tail_rows)

    def snapshot(self) -> None:
        """Keep the fixed-size state where it stands, and of the older snapshots only those a
        translation could still stop at: the last one at least the largest mark back and the
        later ones, thinned so that a snapshot of age a lies within the smallest mark m >= a / 2
        of the next one kept (a switch with mark m stops between 2m and m tokens back)."""
        if not self.recording.keeps_states or self.cache is None:
            return
        self.states[self.seen] = fixed_slots(self.cache)
        marks = sorted(self.recording.marks)
        back = [p for p in self.states if p <= self.seen - marks[-1]]
        floor = max(back, default=0)
        newest_first = sorted((p for p in self.states if floor <= p <= self.seen), reverse=True)
        kept = [newest_first[0]]
        for p, older in zip(newest_first[1:], newest_first[2:] + [None]):
            age = self.seen - p
            spacing = next((m for m in marks if 2 * m >= age), marks[-1])
            if age < 2 * marks[0] or older is None or kept[-1] - older > spacing:
                kept.append(p)  # near the end, the floor, or a gap it alone bridges
        self.states = {p: self.states[p] for p in kept}

    @property
    def recorded_tokens(self) -> int:
        return sum(part.length for part in self.recorded)

    def recorded_bytes(self) -> int:
        """Bytes of the per-token objects held now (its own spans and translated ones)."""
        return sum(capture_bytes(part) for part in self.recorded)

    def kept_bytes(self) -> int:
        """Bytes held beside the cache for switching: the final-norm rows the gate reads and the
        fixed-size state snapshots (arrays shared with the cache, or between snapshots, once)."""
        arrays = {} if self.tail is None else {id(self.tail.rows): self.tail.rows}
        live = {id(a) for c in (self.cache or []) if not c.is_trimmable() for a in c.cache
                if a is not None}
        for slots in self.states.values():
            for a in (a for layer in slots for a in layer if a is not None):
                if id(a) not in live:
                    arrays[id(a)] = a
        return sum(a.nbytes for a in arrays.values())

    @property
    def bytes_per_token(self) -> float:
        """Bytes recorded per token this model read itself (0 when it records nothing)."""
        size, tokens = self.own_recorded
        return size / tokens if tokens else 0.0

    def span(self, tokens: list[int], start: int, stop: int) -> Capture:
        """What the line recorded of conversation tokens [start, stop) (`tokens`: the
        conversation), with its engine objects where the span ends: its fixed-size state there
        (a snapshot, when the span stops before what it read), its per-token caches as they
        are. A layer whose state there was not kept gives no engine objects."""
        span = Capture(self.layout, mx.array([tokens[start:stop]]),
                       join_recorded(self.recorded, start, stop, self.recorded_from), self.cache)
        snapshot = self.states.get(stop) if stop < self.seen else None
        engine = self.cache if snapshot is None else with_slots(self.cache, snapshot)
        read = [{} for _ in engine]
        for found, layer, cache in zip(read, self.local_layout.layers, engine):
            if stop < self.seen and snapshot is None and not cache.is_trimmable():
                continue  # no state there (a translator that reads it stops at a snapshot)
            for name, value in layer.cache.read_engine(cache).items():
                found[(name, CapturePoint.ENGINE)] = value
        if self.shards is not None:
            read = self.shards.whole_engine(read)
        for found, objects in zip(span.objects, read):
            found.update(objects)
        return span
