"""Batched decoding: the requests decoding on one model step together.

Each model has at most one mlx-lm `GenerationBatch` (its forward, samplers and pipelining); a
request joins it once its prompt is read, with a copy of its conversation's cache (mlx-lm's
`merge` copies), and leaves it when it ends. The conversation's own line is not written by the
batch: after the reply, idle time reads the reply into it at prefill speed (`Engine`), where it
records what its translators need.

A `Decoding` is one request's side of it: detokenising, stop sequences, the end-of-turn tokens,
cancellation and the first token's time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from .records import Generation, RequestHistory, Started, StopText, Text

UNLIMITED = 1 << 30  # the batch never ends a request itself: `Decoding.feed` does


@dataclass
class Decoding:
    """One request decoding: what it emits, and how it ends."""

    job: Generation
    history: RequestHistory
    emit: Callable[[object], None]
    cancelled: threading.Event
    tokenizer: object
    lock: threading.Lock  # the tokenizer's (HF tokenizers refuse use from two threads at once)
    entry: object = None  # the conversation, back in the store while this decodes
    tokens: list[int] = field(default_factory=list)
    reason: str = ""

    def __post_init__(self):
        self.eos = set(self.tokenizer.eos_token_ids)
        with self.lock:
            self.detok = self.tokenizer.detokenizer
        self.stops = StopText(self.job.stop)

    def feed(self, token: int) -> bool:
        """Take the next token; True when the request has ended (`reason` says why)."""
        self.tokens.append(token)
        if len(self.tokens) == 1:
            self.history.ttft_seconds = time.perf_counter() - self.job.arrived
            self.emit(Started(self.history))
        if token in self.eos:
            self.reason = "stop"
        else:
            with self.lock:
                self.detok.add_token(token)
                piece = self.detok.last_segment
            text = self.stops.feed(piece)
            if text:
                self.emit(Text(text))
            if self.stops.stopped:
                self.reason = "stop"
            elif self.cancelled.is_set():
                self.reason = "cancelled"
            elif len(self.tokens) >= self.job.max_tokens:
                self.reason = "length"
        if self.reason and not self.stops.stopped and self.reason != "cancelled":
            with self.lock:
                self.detok.finalize()
                piece = self.detok.last_segment
            text = self.stops.feed(piece, final=True)
            if text:
                self.emit(Text(text))
        return bool(self.reason)


class Batches:
    """Per model, the requests decoding together."""

    def __init__(self):
        self._batches: dict[str, object] = {}  # model -> GenerationBatch
        self._members: dict[str, list[Decoding]] = {}  # model -> its requests, in batch order
        self._joining: dict[str, list] = {}  # model -> (model, cache, first, decoding) to start
        # model -> requests decoding on it: replaced whole on the worker, read by /metrics
        self.sizes: dict[str, int] = {}

    def __len__(self) -> int:
        return (sum(len(m) for m in self._members.values())
                + sum(len(w) for w in self._joining.values()))

    def _count(self) -> None:
        self.sizes = {name: len(self._members.get(name, ())) + len(self._joining.get(name, ()))
                      for name in {*self._members, *self._joining}}

    def join(self, model, name: str, cache: list, first: int, decoding: Decoding) -> None:
        """Queue `decoding` to start on `model` (named `name`) from `cache`, which has read
        every token but the prompt's last, `first`: it joins at the next `step`, together
        with every other request that joined `name` meanwhile (one forward reads all their
        last prompt tokens). The copy of `cache` it decodes on is taken now: the conversation
        may read on meanwhile."""
        self._joining.setdefault(name, []).append((model, _copy_for_batch(cache), first,
                                                   decoding))
        self._count()

    def _admit(self) -> list[tuple[Decoding, Exception]]:
        """Start the queued requests, a model's in one GenerationBatch (a request with its own
        seed alone, its seed set just before); those whose first forward failed, with the
        error."""
        from mlx_lm.generate import GenerationBatch, StopSequences, greedy_sampler
        from mlx_lm.sample_utils import make_sampler

        failed = []
        joining, self._joining = self._joining, {}
        for name, waiting in joining.items():
            seeded = [[w] for w in waiting if w[3].job.seed is not None]
            shared = [w for w in waiting if w[3].job.seed is None]
            for group in seeded + ([shared] if shared else []):
                model, decodings = group[0][0], [w[3] for w in group]
                if decodings[0].job.seed is not None:
                    mx.random.seed(decodings[0].job.seed)
                samplers = [None if d.job.temperature == 0 else
                            make_sampler(temp=d.job.temperature, top_p=d.job.top_p)
                            for d in decodings]
                n = len(group)
                try:
                    batch = GenerationBatch(
                        model, [id(d) for d in decodings], mx.array([w[2] for w in group]),
                        _joined([w[1] for w in group]), [[] for _ in group], samplers,
                        greedy_sampler, [[] for _ in group], [StopSequences() for _ in group],
                        [UNLIMITED] * n)
                except Exception as e:  # these requests fail; the others go on
                    failed += [(d, e) for d in decodings]
                    continue
                if name in self._batches:
                    self._batches[name].extend(batch)
                    self._members[name] += decodings
                else:
                    self._batches[name], self._members[name] = batch, decodings
        return failed

    def step(self) -> tuple[list[Decoding], list[tuple[Decoding, Exception]]]:
        """One token for every request decoding: the requests that ended with it, and those
        whose model's forward failed (with the error; that model's batch is dropped)."""
        ended: list[Decoding] = []
        failed = self._admit()
        for name, batch in list(self._batches.items()):
            members = self._members[name]
            try:
                responses = batch.next()
            except Exception as e:  # that model's requests fail; the others go on
                del self._batches[name], self._members[name]
                failed += [(member, e) for member in members]
                continue
            keep = []
            for i, response in enumerate(responses):
                if members[i].feed(response.token):
                    ended.append(members[i])
                else:
                    keep.append(i)
            if not keep:
                del self._batches[name], self._members[name]
            elif len(keep) < len(members):
                batch.filter(keep)
                self._members[name] = [members[i] for i in keep]
        self._count()
        return ended, failed


def _copy_for_batch(cache: list) -> list:
    """`cache` (one conversation's) as mlx-lm's batch caches: copies, which the batch writes
    into while the conversation's own stay as they are."""
    return [type(c).merge([c]) for c in cache]


def _joined(copies: list[list]) -> list:
    """Batch caches of one conversation each (`_copy_for_batch`) as one batch, in order."""
    first = copies[0]
    for other in copies[1:]:
        for layer, more in zip(first, other):
            layer.extend(more)
    return first
