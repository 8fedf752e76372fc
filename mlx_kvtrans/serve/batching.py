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

from .records import Generation, Handoff, Started, StopText, Text

UNLIMITED = 1 << 30  # the batch never ends a request itself: `Decoding.feed` does


@dataclass
class Decoding:
    """One request decoding: what it emits, and how it ends."""

    job: Generation
    handoff: Handoff
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
            self.handoff.ttft_ms = (time.perf_counter() - self.job.arrived) * 1000
            self.emit(Started(self.handoff))
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
        # model -> requests decoding on it: replaced whole on the worker, read by /metrics
        self.sizes: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(len(m) for m in self._members.values())

    def _count(self) -> None:
        self.sizes = {name: len(members) for name, members in self._members.items()}

    def join(self, model, name: str, cache: list, first: int, decoding: Decoding) -> None:
        """Start decoding `decoding` on `model` (named `name`) from `cache`, which has read
        every token but the prompt's last, `first`."""
        from mlx_lm.generate import GenerationBatch, StopSequences, greedy_sampler
        from mlx_lm.sample_utils import make_sampler

        job = decoding.job
        if job.seed is not None:
            mx.random.seed(job.seed)
        sampler = (None if job.temperature == 0 else
                   make_sampler(temp=job.temperature, top_p=job.top_p))
        joining = GenerationBatch(model, [id(decoding)], mx.array([first]),
                                  _copy_for_batch(cache),
                                  [[]], [sampler], greedy_sampler, [[]], [StopSequences()],
                                  [UNLIMITED])
        if name in self._batches:
            self._batches[name].extend(joining)
            self._members[name].append(decoding)
        else:
            self._batches[name], self._members[name] = joining, [decoding]
        self._count()

    def step(self) -> tuple[list[Decoding], list[tuple[Decoding, Exception]]]:
        """One token for every request decoding: the requests that ended with it, and those
        whose model's forward failed (with the error; that model's batch is dropped)."""
        ended: list[Decoding] = []
        failed: list[tuple[Decoding, Exception]] = []
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
