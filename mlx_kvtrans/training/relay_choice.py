"""Choosing a translator's relay (`translators.relay`) on held-out text: whether the pair needs
one, and which block of the target's layers, fed from which source layer.

The measure is the copy probe's (`gate.copy_nll`): the target's NLL reading spans of the history
again, on the translated cache against its own. Where a translation copies the history
`NEEDED_FROM` worse, every block of up to `BUDGET` of the target's layers is run as a relay on
each window, and the cheapest that copies as well as the best is kept.
"""

from __future__ import annotations

import copy
import random

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask

from ..capture import RESIDUAL, capture
from ..capture.instrument import language_model
from ..evaluation.ablate import copy_reading
from ..translators.gate import COPY_LOSS, copy_probe, copy_spans

# the most of the target's layers a relay reruns: with the translation's few percent of a prefill
# beside it, a switch stays 5x faster than a re-read
BUDGET = 0.17
# a pair needs a relay where its translations copy the history this much worse (nats/token)
# than the target's own cache: half of what makes the gate refuse every switch
NEEDED_FROM = COPY_LOSS / 2
WINDOWS, LENGTH = 6, 512  # held-out windows `choose` reads, and their tokens


def applicable(source, target) -> str | None:
    """Why no relay can run between these mlx-lm models (None: one can): it needs the same
    hidden width, and attention caches that go back (`trim`) in every target layer."""
    from mlx_lm.models.cache import make_prompt_cache

    widths = {getattr(getattr(language_model(m), "args", None), "hidden_size", None)
              for m in (source, target)}
    if len(widths) > 1 or None in widths:
        return "the models' hidden widths differ"
    if not all(c.is_trimmable() for c in make_prompt_cache(target)):
        return "a target layer's cache cannot go back"
    return None


def _copy_loss(model, cache: list, probe: list[int], native: float) -> float:
    """The model's copy NLL of `probe` on `cache` minus `native`; every layer's cache goes
    back after the read."""
    nll = copy_reading(model, cache, probe)
    for c in cache:
        c.trim(len(probe))
    return nll - native


def _inputs(model, tokens: list[int], layers=None) -> dict[int, mx.array]:
    """The hidden state entering each of `model`'s `layers` (default: all) over `tokens`:
    layer -> (1, T, hidden)."""
    if layers is None:
        layers = range(len(language_model(model).model.layers))
    found = capture(model, tokens, points=(), residuals=layers).objects
    return {i: found[i][RESIDUAL] for i in layers}


def choose(translator, source, target, token_ids: list[int], windows: int = WINDOWS,
           length: int = LENGTH, seed: int = 0, progress=None) -> dict:
    """Whether the pair (mlx-lm models; one tokenizer) needs a relay, measured on held-out
    `token_ids`: the manifest's "relay" record. Per window the translation's copy loss (the
    copy probe's NLL on the translated cache minus on the target's own); where it is over
    `NEEDED_FROM`, every block of up to `BUDGET` of the target's layers, each fed the source
    layer whose entering hidden state is nearest its own (relative squared error); the
    cheapest block that copies as well as the best one (`_as_good`) is chosen, where the best
    one's loss is under `COPY_LOSS`. "chosen" is [first, last, source_layer] or None, with
    why. `progress(done, total)` follows the windows."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..translators.translator import measured_sink, translate_cache

    bare = copy.copy(translator)
    bare.info = {k: v for k, v in translator.info.items() if k != "relay"}
    record = {"windows": windows, "length": length, "needed_from": NEEDED_FROM,
              "budget": BUDGET, "chosen": None}
    why = "the models tokenize differently" if translator.across_tokenizers else \
        applicable(source, target)
    if why:
        return {**record, "why": why}
    length = min(length, len(token_ids))
    sink = measured_sink(translator)
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(token_ids) - length + 1) for _ in range(windows)]
    cases = []
    for start in starts:
        prefix = token_ids[start:start + length]
        probe = copy_probe(prefix, copy_spans(sink, length))
        own = make_prompt_cache(target)
        target(mx.array(prefix)[None], cache=own)
        native = copy_reading(target, own, probe)
        cases.append((prefix, probe, native, translate_cache(bare, source, target, prefix)))
    translated = float(np.mean([_copy_loss(target, c, p, n) for _, p, n, c in cases]))
    record["translated"] = round(translated, 4)
    if translated <= NEEDED_FROM:
        return {**record, "why": "the translation copies the history well enough"}
    aligned = _aligned(source, target, [c[0] for c in cases], sink)
    blocks = _scores(source, target, cases, aligned, sink, _budget(target), progress)
    record["blocks"] = {f"{m}-{M}": round(float(v.mean()), 4) for (m, M), v in blocks.items()}
    best = min(blocks, key=lambda b: blocks[b].mean())
    if blocks[best].mean() >= COPY_LOSS:
        return {**record, "why": f"no block of up to {_budget(target)} layers copies "
                                 f"within {COPY_LOSS} nats/token"}
    chosen = min(_as_good(blocks, best), key=lambda b: (b[1] - b[0], blocks[b].mean()))
    record["chosen"] = [chosen[0], chosen[1], aligned[chosen[0]]]
    record["copy_loss"] = round(float(blocks[chosen].mean()), 4)
    return record


def _as_good(blocks: dict, best: tuple) -> list[tuple]:
    """The blocks whose copy loss is not measurably over the best's: their mean difference
    over the windows within two standard errors of it."""
    out = []
    for b, v in blocks.items():
        diff = v - blocks[best]
        noise = 2 * diff.std(ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else 0.0
        if diff.mean() <= noise:
            out.append(b)
    return out


def _budget(target) -> int:
    return max(1, int(BUDGET * len(language_model(target).model.layers)))


def _aligned(source, target, prefixes: list[list[int]], sink: int) -> list[int]:
    """Per target layer, the source layer whose entering hidden state is nearest its own over
    the windows' tokens after the sink (relative squared error)."""
    errors = 0.0
    for prefix in prefixes:
        theirs = mx.stack([h[0, sink:] for h in _inputs(source, prefix).values()]
                          ).astype(mx.float32)  # (source layers, T, hidden)
        rows = []
        for h in _inputs(target, prefix).values():
            mine = h[0, sink:].astype(mx.float32)
            rows.append(((theirs - mine) ** 2).sum((1, 2)) / (mine ** 2).sum())
        errors = errors + mx.stack(rows)  # (target layers, source layers)
        mx.eval(errors)
    return [int(j) for j in mx.argmin(errors, axis=1).tolist()]


def _scores(source, target, cases: list, aligned: list[int], sink: int, budget: int,
            progress=None) -> dict:
    """Per block of up to `budget` target layers, its copy loss in each window, run as a relay
    over the window's translation (each block grown a layer at a time from its first)."""
    stack = language_model(target).model.layers
    scores = {}
    for done, (prefix, probe, native, translated) in enumerate(cases):
        if progress:
            progress(done, len(cases))
        inputs = _inputs(source, prefix, sorted(set(aligned)))
        for first in range(len(stack)):
            h = inputs[aligned[first]][:, sink:]
            cache, mask = list(translated), None
            for last in range(first, min(len(stack), first + budget)):
                cache[last] = copy.deepcopy(translated[last])
                cache[last].trim(h.shape[1])
                mask = create_attention_mask(h, cache[last]) if mask is None else mask
                h = stack[last](h, mask, cache[last])
                mx.eval(h, cache[last].state)
                scores.setdefault((first, last), []).append(
                    _copy_loss(target, cache, probe, native))
    return {b: np.array(v) for b, v in scores.items()}
