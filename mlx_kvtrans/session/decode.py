"""Reading and decoding: a model of a session reads the conversation, or continues it.

While it reads, it records the per-token objects its outgoing translators read (capture points
raw and normed), the final-norm rows of its last tokens (for the fidelity gate), and, when a
translator from it reads its recurrent state, snapshots of its fixed-size caches every r
positions (references to arrays, not copies).

Decoding is mlx-lm's own `generate_step` (prefill in its chunks, then pipelined steps), with the
recording taps installed once per turn. Convention: when a turn ends, the model has read every
token of the conversation but the last one generated (the next turn reads it first).
generate_step reads each token before yielding it, so a turn asks it for one token fewer and
takes the last one from its sampler; a turn that ends early (a stop token, a closed iterator)
takes back the model's last forward (trim the KV caches, restore the fixed-size ones).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import mlx.core as mx

from ..capture import PREFILL_CHUNK, Capture, capture, tapped
from ..capture.instrument import (fastest_recurrence, hook_module, short_reads,
                                  recording_final_rows)
from ..layouts import CapturePoint
from ..layouts.linear_attention import RecurrentInputs
from ..translators.gate import Tail, tail_of
from .line import CacheLine, fixed_slots, split

RECORD_POINTS = (CapturePoint.RAW, CapturePoint.NORMED)


def read(line: CacheLine, tokens: list[int], upto: int, whole: bool = False,
         split_at: int | None = None, generated: range | None = None) -> Tail | None:
    """Let `line`'s model read tokens [seen, upto) of `tokens` (the conversation as it reads
    it), keeping what its `recording` says: the objects it records, the
    final-norm rows of the last of them and (when it keeps states) a snapshot at each of its
    switch marks before the end.

    `whole`: in one forward (upto - seen <= PREFILL_CHUNK), keeping the logits of the last
    token (the next token's, for `decode`) and returning the final-norm rows of every token
    read (a switch's gate reads them); what it records is kept as two spans, split at
    `split_at` (where a switch's span ends), so that each can be dropped when read.
    `generated`: the positions of tokens this model sampled (a reply decoded elsewhere, read
    in now), which the gate's tail marks."""
    if upto <= line.seen:
        return None
    from mlx_lm.models.cache import make_prompt_cache

    if line.cache is None:
        line.cache = make_prompt_cache(line.lm.model)
    if whole:
        line.snapshot()
        rows = _read_part(line, tokens, upto, whole=True, split_at=split_at)
        line.snapshot()
        return rows
    if line.recording.keeps_states:
        # a snapshot at each place a translation from this line may stop (its marks)
        for mark in line.recording.marks:
            if upto - line.seen > mark:
                _read_part(line, tokens, upto - mark, generated=generated)
                line.snapshot()
    line.snapshot()
    _read_part(line, tokens, upto, generated=generated)
    line.snapshot()


def _read_part(line: CacheLine, tokens: list[int], upto: int, whole: bool = False,
               split_at: int | None = None, generated: range | None = None) -> Tail | None:
    start = line.seen
    keep = upto - start if whole else line.recording.tail_rows
    with contextlib.ExitStack() as stack:
        rows = (stack.enter_context(recording_final_rows(line.lm.model, keep))
                if line.recording.gate_tokens or whole else None)
        stack.enter_context(short_reads(line.lm.model))  # a turn, the gate's tail
        # linear attention over a read of many tokens: chunkwise off a Mac, not token by token
        stack.enter_context(fastest_recurrence())
        cap = line.whole(capture(line.lm.model, tokens[start:upto],
                                 points=RECORD_POINTS, layout=line.local_layout,
                                 cache=line.cache,
                                 select=line.local_select(set(line.recording.select)),
                                 chunk_size=PREFILL_CHUNK))
    if split_at is not None and start < split_at < upto:
        first, rest = split(cap, split_at - start)
        line.keep(start, first, own=True)
        line.keep(split_at, rest, own=True)
    else:
        line.keep(start, cap, own=True)
    line.seen = upto
    line.next_logits = cap.last_logits[0] if whole else None
    if rows is None:
        return None
    read_rows = tail_of(rows.last(min(keep, upto - start)), upto, generated)
    if read_rows is not None:
        line.keep_tail(read_rows.rows, upto, generated)
    return read_rows


def decode(line: CacheLine, tokens: list[int], max_tokens: int, temperature: float,
           stop: set[int], top_p: float = 1.0) -> Iterator[int]:
    """`line`'s model continues the conversation: up to `max_tokens` tokens, appended to
    `tokens` (its view of the conversation, `Session.view`) as they are yielded (none: it only
    reads what it has not). A line that has read the whole conversation holds its next token's
    logits (a switch's one forward, `read(whole=True)`): the first token is sampled from
    them."""
    from mlx_lm.sample_utils import make_sampler

    if max_tokens < 1:
        read(line, tokens, len(tokens))
        return
    if line.next_logits is not None and line.seen == len(tokens):
        logits, line.next_logits = line.next_logits, None
        sampler = make_sampler(temp=temperature, top_p=top_p)
        token = int(sampler((logits - mx.logsumexp(logits, keepdims=True))[None]).item())
        tokens.append(token)
        yield token
        if token in stop or max_tokens == 1:
            return  # the model has read every token but the one generated
        max_tokens -= 1
    yield from _continue(line, tokens, max_tokens, temperature, stop, top_p)


def _continue(line: CacheLine, tokens: list[int], max_tokens: int,
              temperature: float, stop: set[int], top_p: float) -> Iterator[int]:
    """The rest of `decode`: `tokens` is the line's view, taken before the turn began (asking
    for it again would give a token already sampled to the other views as a piece alone)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    line.next_logits = None
    r, recording = line.recording.gate_tokens, line.recording
    model, start = line.lm.model, line.seen
    if line.cache is None:
        line.cache = make_prompt_cache(model)
    sampler, drawn = make_sampler(temp=temperature, top_p=top_p), []

    def sample(logprobs):
        drawn[:] = [sampler(logprobs)]
        return drawn[0]

    select = set(recording.select)
    read_upto = prompt_end = len(tokens)
    # the prompt but its last r tokens is read first, so that the last r, read by
    # generate_step, are a forward of their own: their final-norm rows cost a few rows of
    # the last layer, and a state snapshot falls r tokens before the prompt's end
    marks = list(recording.marks) if recording.keeps_states else []
    tail = r or min(marks, default=0)  # without a gate, the dial's smallest R
    tail_from = prompt_end - tail if tail and prompt_end - start > tail + 1 else start
    broken = False
    with contextlib.ExitStack() as stack:
        rec = stack.enter_context(tapped(model, line.local_layout, set(RECORD_POINTS),
                                         line.local_select(select)))
        take_back = stack.enter_context(_taking_back(model, line.cache, rec))
        _read_prompt(stack, line, tokens, range(start, tail_from), marks, tail, rec)
        rows = (stack.enter_context(recording_final_rows(model, recording.tail_rows + 1))
                if r else None)  # one more: the last forward may go back
        # generate_step reads each token before yielding it: ask for one fewer, and take
        # the last from the sampler (sampled after the last read, not read itself)
        steps = generate_step(mx.array(tokens[tail_from:]), model, prompt_cache=line.cache,
                              max_tokens=max_tokens - 1, sampler=sample)
        try:
            for token, _ in steps:
                tokens.append(token)
                read_upto = len(tokens)
                yield token
                if token in stop:
                    return
            tokens.append(int(drawn[0].item()))
            yield tokens[-1]
        except GeneratorExit:
            raise  # closed at a yield: the cache is as `read_upto` says
        except BaseException:
            broken = True  # stopped inside a forward: the cache is unknown
            raise
        finally:
            steps.close()
            if broken:
                line.reset()
            else:
                if read_upto == len(tokens) > prompt_end:
                    take_back()  # the last token is read with the next turn
                    if rows is not None:
                        rows.drop_last()
                    read_upto -= 1
                objects = rec.joined()
                mx.eval([v.arrays() if isinstance(v, RecurrentInputs) else v
                         for layer in objects for v in layer.values()])
                part = line.whole(Capture(line.local_layout,
                                          mx.array([tokens[start:read_upto]]), objects,
                                          line.cache))
                line.keep(start, part, own=True)
                line.seen = read_upto
                if rows is not None:
                    line.keep_tail(rows.last(min(recording.tail_rows, read_upto - tail_from)),
                                   read_upto, range(prompt_end, len(tokens)))
                line.snapshot()


def _read_prompt(stack: contextlib.ExitStack, line: CacheLine, tokens: list[int], span: range,
                 marks: list[int], tail: int, rec) -> None:
    """Read the prompt's `span` (all of it but the tail generate_step reads), a forward
    starting at each of the switch marks, where the line keeps a state snapshot."""
    model, prompt_end = line.lm.model, len(tokens)
    cuts = [span.start]
    if marks:
        cuts += sorted(prompt_end - m for m in marks if span.start < prompt_end - m < span.stop)
        stack.enter_context(_snapshots(line, cuts[1] if len(cuts) > 1 else span.stop, tail))
    for begin, end in zip(cuts, cuts[1:] + [span.stop]):
        for at in range(begin, end, PREFILL_CHUNK):
            model(mx.array([tokens[at:min(at + PREFILL_CHUNK, end)]]), cache=line.cache)
            mx.eval([c.state for c in line.cache], rec.pending())


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


@contextlib.contextmanager
def _snapshots(line: CacheLine, first: int, every: int) -> Iterator[None]:
    """Within the block, `line` keeps a snapshot of its fixed-size caches before each forward
    at `first` and then every `every` positions (the first forward starting at or past each
    mark)."""
    position, mark = [line.seen], [first]

    def before(module, args, kwargs):
        if position[0] >= mark[0]:
            line.states[position[0]] = fixed_slots(line.cache)
            mark[0] = position[0] + every
        position[0] += args[0].shape[1]

    with hook_module(line.lm.model, before=before):
        yield
