"""Translating between models that tokenize differently: the source's capture seen at the
target's tokens.

Each model reads the same text as its own tokens. `alignment.align` groups them (the fewest
tokens of each side covering the same characters); each target token then reads its group's
source tokens pooled (mean, first or last), so that a source capture becomes one with the
target's token count (`realigned`). Everything downstream is a same-tokenizer translator's:
the maps read the realigned features per target token, keys are rotated at the target's own
positions, and a recurrent state is rebuilt by replaying the target's recurrence over its own
tokens (copying a state between two models that read different tokens has no meaning, so a
cross-tokenizer plan replays). Token identity is the target's own ids: the target tokenizes
the text itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .alignment import POOLINGS, align, char_spans
from ..capture import RESIDUAL, Capture, capture
from ..layouts import CapturePoint
from ..layouts.linear_attention import RecurrentInputs
from .features import feature_point

# what a cross-tokenizer plan builds each recurrent state with (see above)
RECIPES = {"recurrent_state": "replay"}


@dataclass(frozen=True)
class AlignedText:
    """One text as both models read it: each side's ids (1, T), and per target token the source
    tokens its group pools (`sources`, (T_target, G) indices) with their weights (`weights`,
    (T_target, G); G: the largest group's source tokens)."""

    source: mx.array
    target: mx.array
    sources: mx.array
    weights: mx.array
    one_to_one: float  # share of groups one token on each side
    how: str = "mean"  # the pooling (`POOLINGS`)


def batch_ids(batch) -> tuple:
    """The token ids a fitting batch names (both sides of an `AlignedText`), for hashing."""
    return (batch.source, batch.target) if isinstance(batch, AlignedText) else (batch,)


def aligned_text(source_tokenizer, target_tokenizer, text: str, how: str = "mean",
                 target_tokens: int | None = None) -> AlignedText:
    """`text` tokenized by both tokenizers (no special tokens added), with its pooling.
    `target_tokens`: only the first that many of the target's tokens, and the source's tokens
    of the characters they cover (all of a character whose bytes the cut splits)."""
    target_ids, target_spans = char_spans(target_tokenizer, text)
    if target_tokens is not None:
        target_ids, target_spans = target_ids[:target_tokens], target_spans[:target_tokens]
        text = text[:max((end for _, end in target_spans), default=0)]
    source_ids, source_spans = char_spans(source_tokenizer, text)
    alignment = align(source_spans, target_spans)
    sources, weights = pooling(alignment, how)
    return AlignedText(mx.array([source_ids]), mx.array([target_ids]), mx.array(sources),
                       mx.array(weights), alignment.one_to_one(), how)


def aligned_ids(source_tokenizer, target_tokenizer, target_ids: list[int], how: str = "mean"
                ) -> AlignedText:
    """A text given as the target's tokens `target_ids` (a prompt, a fitting window): the
    source's tokens of its text, and their pooling onto `target_ids`."""
    from .alignment import Views

    views = Views({"source": source_tokenizer, "target": target_tokenizer})
    views.tokens["target"].extend(target_ids)
    views.sync()
    alignment = views.alignment("source", "target")
    sources, weights = pooling(alignment, how)
    return AlignedText(mx.array([views.tokens["source"]]), mx.array([list(target_ids)]),
                       mx.array(sources), mx.array(weights), alignment.one_to_one(), how)


def aligned_windows(source_tokenizer, target_tokenizer, text: str, windows: int, length: int,
                    how: str = "mean", needles: list[str] | None = None,
                    needle_share: float = 0.0) -> list[AlignedText]:
    """`windows` windows of about `length` target tokens, evenly spread over `text`, as both
    models read them (each window's text tokenized afresh by both); with `needles` (texts
    ending in their answer), that share of the windows are needles' last `length` target
    tokens, as `fit.token_windows` mixes them."""
    first = _first_tokens(target_tokenizer, text, length)
    room = len(text) - 2 * len(first or "")  # starts past it may not hold a whole window
    pieces, stride = [first] if first else [], max(1, room // max(1, windows))
    for start in range(stride, max(1, room), stride):  # no tokenizing the whole text
        if len(pieces) == windows:
            break
        piece = _first_tokens(target_tokenizer, text[start:], length)
        if piece is not None:
            pieces.append(piece)
    if not pieces:
        raise ValueError(f"the fitting text holds fewer than {length} target tokens")
    if needles and needle_share:
        every = max(1, round(1 / needle_share))
        pieces = [_last_tokens(target_tokenizer, needles[(i // every) % len(needles)], length)
                  if i % every == 0 else piece for i, piece in enumerate(pieces)]
    return [aligned_text(source_tokenizer, target_tokenizer, piece, how) for piece in pieces]


def _first_tokens(tokenizer, text: str, length: int) -> str | None:
    """The start of `text` that holds its first `length` tokens (None: it has fewer)."""
    chars = 8 * length
    while True:
        _, spans = char_spans(tokenizer, text[:chars])
        if len(spans) > length or chars >= len(text):
            break
        chars *= 2
    return text[:spans[length - 1][1]] if len(spans) >= length else None


def _last_tokens(tokenizer, text: str, length: int) -> str:
    """The end of `text` that holds its last `length` tokens."""
    _, spans = char_spans(tokenizer, text)
    return text[spans[max(0, len(spans) - length)][0]:]


def pooling(alignment, how: str = "mean") -> tuple[np.ndarray, np.ndarray]:
    """Per target token, the source tokens of its group and their weights, (T_target, G) each:
    the group's mean, its first or its last source token."""
    if how not in POOLINGS:
        raise ValueError(f"pooling must be {', '.join(POOLINGS)}, not {how!r}")
    group = alignment.target_group()
    first = alignment.source_starts[:-1][group]
    count = np.diff(alignment.source_starts)[group]
    width = int(count.max(initial=1))
    slot = np.arange(width)[None, :]
    sources = first[:, None] + np.minimum(slot, count[:, None] - 1)
    if how == "mean":
        weights = (slot < count[:, None]) / count[:, None]
    else:
        weights = slot == (0 if how == "first" else count[:, None] - 1)
    return sources.astype(np.int32), np.broadcast_to(weights, sources.shape).astype(np.float32)


def realigned(capture: Capture, text: AlignedText) -> Capture:
    """`capture` (the source's prefill of `text`) with every per-token object pooled onto the
    target's tokens; fixed-size objects (states, conv histories at the engine point) kept."""
    objects = []
    for layer, found in zip(capture.layout.layers, capture.objects):
        pooled = {}
        for (name, point), value in found.items():
            if (name, point) == RESIDUAL:  # a relay's, which runs on one tokenizer only
                continue
            per_token = feature_point(layer.cache.object(name), point) is not None
            pooled[(name, point)] = (_pooled(value, text, 2 if point == CapturePoint.ENGINE
                                             else 1) if per_token else value)
        objects.append(pooled)
    return Capture(capture.layout, text.target, objects, capture.engine, capture.last_logits)


def _pooled(value, text: AlignedText, axis: int = 1):
    """`value`'s rows along its token `axis` pooled onto the target's tokens: a gather of each
    group's few source rows, weighted, so memory grows with the tokens, not their square."""
    if isinstance(value, RecurrentInputs):
        return type(value)(*(_pooled(x, text) for x in value.arrays()))
    rows = mx.take(value.astype(mx.float32), text.sources, axis=axis)  # (..., T_t, G, ...)
    shape = [1] * rows.ndim
    shape[axis], shape[axis + 1] = text.weights.shape
    return (rows * text.weights.reshape(shape)).sum(axis=axis + 1).astype(value.dtype)


def translate_text(translator, source_model, target_model, text: AlignedText) -> list:
    """The source reads its tokens of `text`, the translator builds the target's caches of the
    target's tokens of it: mlx-lm caches for the target."""
    from .sharding import capture_whole

    source = capture_whole(source_model, text.source, translator.source_points())
    return translate_captured(translator, source, target_model, text)


def translate_captured(translator, source: Capture, target_model, text: AlignedText) -> list:
    """The target's caches of `text` from `source`, the source's capture of it (what a switch
    does once the source has read the text)."""
    from .install import translate_into

    fitted = translator.info.get("alignment", {}).get("pooling", text.how)
    if fitted != text.how:
        raise ValueError(f"the text's groups are pooled by {text.how}; the translator was "
                         f"fitted on {fitted} (aligned_text(..., how={fitted!r}))")
    return translate_into(translator, realigned(source, text), target_model, text.target)[2]


def across_capture(translator, source, tokenizers: tuple, ids: mx.array) -> Capture:
    """The source's capture of each row's text, its own tokens of it read, pooled onto the
    target's tokens `ids` (B, T) as the translator was fitted: a batch of target positions.
    `tokenizers`: (the source's, the target's)."""
    how = translator.info["alignment"]["pooling"]
    rows = []
    for row in ids.tolist():
        text = aligned_ids(*tokenizers, row, how)
        rows.append(realigned(capture(source, text.source, points=translator.source_points()),
                              text))
    objects = [{key: _stacked([r.objects[i][key] for r in rows]) for key in layer}
               for i, layer in enumerate(rows[0].objects)]
    return Capture(rows[0].layout, ids, objects, None)


def _stacked(values: list):
    """Rows of one object (each batch 1) as one batch."""
    if isinstance(values[0], RecurrentInputs):
        return type(values[0]).concatenate(values, axis=0)
    return mx.concatenate(values, axis=0)
