"""Conversation caches shared by every model, keyed by token prefix.

An entry is one conversation: a `Session` over the models it can move between (those that share
a tokenizer, and those a translator across tokenizers joins to them), whose cache lines (one per
model) have each read some prefix of the entry's tokens (of its own tokens, where the models
tokenize differently). A request takes the entry whose lines hold the longest usable prefix of
its prompt. A line whose caches can all be trimmed is usable up to the common prefix; a line
with fixed-size state (the recurrent and conv state of a hybrid) only where it stands, or at a
checkpoint the engine took while reading: where a prompt's last message begins (an edited last
turn), every so many tokens of a long read, and at the end of a prompt, before the reply (a
client re-sends the reply as text, which may tokenise differently). A request that extends an
entry uses it in place; one that would discard tokens (a regenerated or edited reply, another
conversation branching off a shared prefix) gets a copy, so no conversation loses what another
continues. While a request works on an entry it is out of the store, so no other request sees
it. Over the byte budget, the least recently used line goes first, whichever model it belongs
to.
"""

from __future__ import annotations

import copy
import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..session import Session

KEEP_CHECKPOINTS = 8  # per line: a divergence falls in the latest turns, near the newest ones


def common_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return int(np.argmax(np.asarray(a[:n]) != np.asarray(b[:n])))


def trimmable(cache: list) -> bool:
    return all(c.is_trimmable() for c in cache)


@dataclass
class Entry:
    """One conversation: a Session, and per model the snapshots of its fixed-size caches at
    message boundaries (position -> one item per cache, None where the cache is trimmable)."""

    id: str
    group: str  # the models it can move between (`conversation_groups`)
    session: Session
    conversation: str | None = None  # the client's conversation id, when it gave one
    checkpoints: dict[str, dict[int, list]] = field(default_factory=dict)
    # model -> position -> the line's gate tail and state snapshots there
    marks: dict[str, dict[int, tuple]] = field(default_factory=dict)
    used: dict[str, int] = field(default_factory=dict)  # model -> store clock at its last use
    # model -> `line_bytes`, as measured when the entry was last put in the store (where
    # nothing writes to it): eviction weighs every line at every check-in
    sizes: dict[str, int] = field(default_factory=dict)
    # (model, position, tokens) of the last reply, decoded on a copy of the cache: that model's
    # line reads it later (in idle time, or with the follow-up) and marks it as sampled
    reply: tuple[str, int, list[int]] | None = None

    def sampled(self, name: str) -> range | None:
        """The positions of the entry's tokens that `name` sampled as its last reply (a reply
        sent back as text may tokenise otherwise from some point: up to there)."""
        if self.reply is None or self.reply[0] != name:
            return None
        _, start, reply = self.reply
        return range(start, start + common_prefix(self.session.view(name)[start:], reply))

    @property
    def tokens(self) -> list[int]:
        return self.session.tokens

    def limit_for(self, name: str, model: str, position: int) -> int:
        """`name`'s tokens of what `model`'s first `position` tokens cover (models that
        tokenize differently read different tokens of one conversation)."""
        return self.session.mapped(model, position, name)

    def held(self, name: str, model: str, within: int) -> int:
        """How many of `model`'s first `within` tokens `name`'s line can keep, counted in
        `model`'s tokens: across tokenizers, up to a place where both split, where a line
        that cannot be trimmed must also hold a checkpoint."""
        kept = self.session.mapped(name, self.usable(name, self.limit_for(name, model, within)),
                                   model)
        return self.session.mapped(name, self.usable(name, self.limit_for(name, model, kept)),
                                   model)

    @property
    def last_used(self) -> int:
        return max(self.used.values(), default=0)

    def live(self) -> list[str]:
        """The models whose line holds a cache."""
        return [n for n, line in self.session.lines.items() if line.cache is not None]

    def usable(self, name: str, limit: int) -> int:
        """How many conversation tokens `name`'s line can keep when at most the first `limit`
        are wanted: where it stands, all of `limit` when its caches can be trimmed, else its
        latest checkpoint within `limit`."""
        line = self.session.lines[name]
        if line.cache is None or line.seen == 0:
            return 0
        if line.seen <= limit:
            return line.seen
        if trimmable(line.cache):
            return limit
        return max((p for p in self.checkpoints.get(name, {}) if p <= limit), default=0)

    def rewind(self, name: str, limit: int) -> None:
        """Put `name`'s line back to `usable(name, limit)` tokens (nothing left: dropped)."""
        line = self.session.lines[name]
        keep = self.usable(name, limit)
        if keep == line.seen:
            return
        # what it re-read ahead is cut (judge again), and what it was given ahead if cut into
        self.session.forget_ahead(name, self.session.forgets_ahead_at(name, keep))
        if keep == 0:
            self.drop(name)
            return
        points = self.checkpoints.get(name, {})
        snapshot = points.get(keep) or [None] * len(line.cache)
        for i, c in enumerate(line.cache):
            if c.is_trimmable():
                c.trim(line.seen - keep)
            else:  # a copy: the snapshot serves later rewinds too
                line.cache[i] = copy.deepcopy(snapshot[i])
        line.seen = keep
        line.cut(keep)
        if keep in self.marks.get(name, {}):  # what the gate reads, as it was there
            line.tail, line.states = self.marks[name][keep][0], dict(self.marks[name][keep][1])
        self.checkpoints[name] = {p: s for p, s in points.items() if p <= keep}
        self.marks[name] = {p: m for p, m in self.marks.get(name, {}).items() if p <= keep}

    def checkpoint(self, name: str) -> None:
        """Snapshot `name`'s fixed-size caches where its line stands."""
        line = self.session.lines[name]
        points = self.checkpoints.setdefault(name, {})
        points[line.seen] = [None if c.is_trimmable() else copy.deepcopy(c) for c in line.cache]
        marks = self.marks.setdefault(name, {})
        marks[line.seen] = (line.tail, dict(line.states))
        for p in sorted(points)[:-KEEP_CHECKPOINTS]:
            del points[p]
            marks.pop(p, None)

    def drop(self, name: str) -> None:
        self.sizes.pop(name, None)
        self.session.lines[name].reset()
        self.session.forget_ahead(name)
        self.checkpoints.pop(name, None)
        self.marks.pop(name, None)

    def line_bytes(self, name: str) -> int:
        """What `name`'s line holds: its cache, its recorded objects, the gate's rows and state
        snapshots it keeps for switching, and its checkpoints."""
        line = self.session.lines[name]
        if line.cache is None:
            return 0
        snapshots = sum(c.nbytes for s in self.checkpoints.get(name, {}).values()
                        for c in s if c is not None)
        return (sum(c.nbytes for c in line.cache) + line.recorded_bytes() + line.kept_bytes()
                + snapshots)

    def fork(self, new_id: str, session: Session, model: str, limit: int) -> "Entry":
        """A copy holding what each line can keep within `model`'s first `limit` tokens; lines
        that would keep nothing are not copied. Recorded spans, gate tails and snapshots are
        never written into, so the copy shares them."""
        twin = Entry(new_id, self.group, session, self.conversation, reply=self.reply)
        session.copy_conversation(self.session)
        for name, line in self.session.lines.items():
            if self.usable(name, self.limit_for(name, model, limit)) == 0:
                continue
            session.lines[name].copy_from(line)
            twin.checkpoints[name] = dict(self.checkpoints.get(name, {}))
            twin.marks[name] = dict(self.marks.get(name, {}))
            twin.used[name] = self.used.get(name, 0)
            session.adopt_ahead(self.session, name)  # translated or re-read ahead
        return twin


@dataclass
class Match:
    """What a request starts from."""

    entry: Entry
    position: int  # conversation tokens some line holds, rewound to
    holder: str  # the model whose line holds all of them
    own: int  # of them, what the requested model's own line holds


class ConversationStore:
    """Entries of every tokenizer group under one byte budget.

    `new_session(model)`: a fresh Session over `model`'s tokenizer group; `group_of`: model ->
    group. Entries are checked out for the length of a request and checked in after it."""

    def __init__(self, new_session: Callable[[str], Session], group_of: dict[str, str],
                 budget_bytes: int, shared_sizes: Callable[[list[int]], list[float]] | None = None):
        self.new_session = new_session
        self.group_of = group_of
        self.budget_bytes = budget_bytes
        # sharded in step: each line's bytes averaged over the processes, so that every
        # process evicts the same lines (a pipeline's processes hold different layers)
        self.shared_sizes = shared_sizes
        self.evictions = 0
        self._entries: list[Entry] = []
        self._lock = threading.Lock()  # the worker changes entries; /metrics reads them
        self._clock = itertools.count(1)
        self._ids = itertools.count(1)

    def _new_entry(self, model: str, conversation: str | None) -> Entry:
        return Entry(f"c{next(self._ids)}", self.group_of[model], self.new_session(model),
                     conversation)

    def checkout(self, model: str, prompt: list[int], conversation: str | None = None) -> Match:
        """The entry to answer `prompt` with, taken out of the store and rewound to the longest
        prefix of `prompt` one of its lines can keep (never the last prompt token: reading it
        gives the first reply token). With `conversation`, only that conversation's entries are
        searched; without, only those of clients that gave no id."""
        limit = len(prompt) - 1
        with self._lock:
            best, best_key = None, None
            for entry in self._entries:
                if entry.group != self.group_of[model] or entry.conversation != conversation:
                    continue
                within = min(common_prefix(entry.session.view(model), prompt), limit)
                # a line translated ahead serves the model it was made for, not a way back
                holds = {name: entry.held(name, model, within) for name in entry.live()
                         if name == model or not entry.session.handed_ahead(name)}
                holder = max(holds, key=lambda n: (holds[n], n == model), default=None)
                if holder is None or holds[holder] == 0:
                    continue
                key = (holds[holder], holds.get(model, 0), entry.last_used)
                if best_key is None or key > best_key:
                    best, best_key = (entry, holder), key
            if best is None:
                return Match(self._new_entry(model, conversation), 0, model, 0)
            entry, holder = best
            # where every model's tokens of the conversation end together
            position = entry.session.common(model, best_key[0])
            if any(entry.session.lines[n].seen > entry.limit_for(n, model, position)
                   for n in entry.live()):
                entry = entry.fork(f"c{next(self._ids)}", self.new_session(model), model,
                                   position)
            else:
                self._entries.remove(entry)
        for name in entry.live():
            entry.rewind(name, entry.limit_for(name, model, position))
        entry.session.cut(model, position)
        return Match(entry, position, holder, entry.session.lines[model].seen)

    def take(self, entry: Entry) -> bool:
        """Take `entry` out for idle work (translating ahead); False when a request has it or
        it was evicted."""
        with self._lock:
            for i, held in enumerate(self._entries):
                if held is entry:
                    del self._entries[i]
                    return True
            return False

    def checkin(self, entry: Entry, models: set[str]) -> None:
        """Put `entry` back, `models` just used, and evict down to the budget."""
        with self._lock:
            tick = next(self._clock)
            for name in models:
                entry.used[name] = tick
            entry.sizes = {name: entry.line_bytes(name) for name in entry.live()}
            if entry.live():
                self._entries.append(entry)
            self._evict()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def _evict(self) -> None:
        lines = [(e, n) for e in self._entries for n in e.live()]
        sizes = [e.sizes[n] for e, n in lines]
        if self.shared_sizes is not None:
            sizes = self.shared_sizes(sizes)
        size_of = {(id(e), n): size for (e, n), size in zip(lines, sizes)}
        total = sum(sizes)
        while total > self.budget_bytes:
            entry, name = min(((e, n) for e in self._entries for n in e.live()),
                              key=lambda pair: pair[0].used.get(pair[1], 0))
            total -= size_of[(id(entry), name)]
            entry.drop(name)
            self.evictions += 1
            if not entry.live():
                self._entries.remove(entry)

    # -- what /metrics shows ----------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            lines: dict[str, int] = {}
            for entry in self._entries:
                for name in entry.live():
                    lines[name] = lines.get(name, 0) + 1
            return {"bytes": sum(sum(e.sizes.values()) for e in self._entries),
                    "conversations": len(self._entries), "lines": lines,
                    "evictions": self.evictions}

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries)
