"""Needle recall: held-out needles, their exact recall and answer-digit loss, and the
distillation needle rows with the prose filler they are drawn from.

Needle recall is exact: all six digits right under greedy decoding. With the answer fed in
(teacher forcing), greedy decoding reproduces it exactly when every answer position's argmax is the
answer token, so one forward pass per needle decides it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import mlx.core as mx

from . import tasks

HELD_OUT_SEED = 900_000_000  # needle seeds at and above this are never drawn in training
NEEDLE_SEED = 700_000_000  # distillation needles: below the held-out seeds
FILLER_FILE = Path(__file__).with_name("needle_filler.txt")


def held_out_filler() -> list[str]:
    """Filler sentences from the corpus's validation split (never trained on), shipped with
    the package so that every model is measured on the same needles."""
    return FILLER_FILE.read_text().splitlines()


def filler_sentences(docs: list[str], limit: int = 50_000, seed: int = 0) -> list[str]:
    """Sentences of plain prose (no digits, 30-240 characters) from `docs`, shuffled: needle
    filler."""
    out = []
    for d in docs:
        for s in re.split(r"(?<=[.!?])\s+", d.replace("\n\n", " ")):
            if 30 <= len(s) <= 240 and not re.search(r"\d", s):
                out.append(s)
    random.Random(seed).shuffle(out)
    return out[:limit]


def needle_prompt_tokens(encode, seed: int, n_tokens: int, filler: list[str]):
    """A held-out needle whose prompt + answer is close to (at most) `n_tokens` tokens."""
    n_chars = int(n_tokens * 3.6)
    for _ in range(8):
        s = tasks.needle(seed, n_chars=n_chars, filler=filler)
        prompt, answer = encode(s.prompt), encode(s.answer)
        total = len(prompt) + len(answer)
        if total <= n_tokens and total >= 0.9 * n_tokens:
            break
        n_chars = max(60, int(n_chars * n_tokens / total * (0.97 if total > n_tokens else 1.0)))
    return prompt, answer


@dataclass(frozen=True)
class NeedleConfig:
    """Which held-out needles a report reads: the same config, the same needles."""
    samples: int = 50  # needles at the length
    seed: int = HELD_OUT_SEED  # the first needle's seed; the rest follow it
    filler: list[str] | None = None  # raw-text needles' prose; None: `held_out_filler()`


def needle_recall(model, encode, lengths: list[int], samples: int = 50, filler=None,
                  seed: int = HELD_OUT_SEED, cache_for=None, progress=None,
                  make=None) -> dict[int, float]:
    """Exact six-digit recall at each prompt length (tokens), on held-out needles.

    `cache_for(prompt_ids)`, when given, builds the cache the model continues from (a translated
    cache); by default the model reads the prompt itself. `progress(done, total, what)` follows
    the needles. `make(seed, length)` -> (prompt ids, answer ids) draws needles of another
    format (`chat_needles.ChatNeedles`); by default, the raw-text needles of `tasks.needle`.
    """
    out = {}
    for n, length in enumerate(lengths):
        step = progress and (lambda i, length=length, n=n: progress(
            n * samples + i, len(lengths) * samples, f"{length:,} tokens"))
        out[length] = needle_report(model, encode, length, NeedleConfig(samples, seed, filler),
                                    cache_for, step, make=make)["recall"]
    return out


def needle_scores(model, encode, length: int, samples: int = 50, filler=None,
                  seed: int = HELD_OUT_SEED, cache_for=None, progress=None, make=None
                  ) -> tuple[float, float]:
    """(exact recall, mean loss of the answer digits in nats) at one prompt length.

    The digit loss shows copying long before recall does: chance is ln 10 = 2.30."""
    report = needle_report(model, encode, length, NeedleConfig(samples, seed, filler),
                           cache_for, progress, make=make)
    return report["recall"], report["digit_nll"]


def needle_report(model, encode, length: int, config: NeedleConfig = NeedleConfig(),
                  cache_for=None, progress=None, group=None, make=None) -> dict:
    """{"recall", "digit_nll", "digit_accuracy"} at one prompt length: exact recall, the answer
    digits' mean loss, and the share of answer digits whose greedy prediction is right (with
    the earlier digits given). `group`: the processes of `mlx.launch`, which read their share
    of the needles each and all return the whole report."""
    from ..backend.processes import mine, summed

    samples, seed = config.samples, config.seed
    filler = config.filler or (None if make else held_out_filler())
    hits = 0
    nll = 0.0
    right = 0
    digits_seen = 0
    for i in range(samples):
        if not mine(i, group):
            continue
        if progress:
            progress(i)
        prompt, answer = make(seed + i, length) if make else \
            needle_prompt_tokens(encode, seed + i, length, filler)
        digits = len(answer) - 1  # the answer is the code and a full stop
        if cache_for is None:
            x = mx.array(prompt + answer[:digits - 1])[None]
            cache = None
            first = len(prompt) - 1
        else:  # the cache holds all but the last prompt token, which the model then reads
            x = mx.array(prompt[-1:] + answer[:digits - 1])[None]
            cache, first = cache_for(prompt[:-1]), 0
        logits = model(x, cache=cache)[0, first:].astype(mx.float32)
        target = mx.array(answer[:digits])
        nll += float((mx.logsumexp(logits, axis=-1)
                      - mx.take_along_axis(logits, target[:, None], -1)[:, 0]).mean())
        predicted = mx.argmax(logits, axis=-1).tolist()
        hits += predicted == answer[:digits]
        right += sum(a == b for a, b in zip(predicted, answer[:digits]))
        digits_seen += digits
    if group is not None:
        hits, nll, right, digits_seen = summed(np.array([hits, nll, right, digits_seen]),
                                               group).tolist()
    return {"recall": hits / samples, "digit_nll": nll / samples,
            "digit_accuracy": right / max(digits_seen, 1)}


def needle_rows(encode, filler: list[str], length: int, count: int = 2000,
                seed: int = NEEDLE_SEED) -> list[list[int]]:
    """`count` needles (prompt + answer) of at least `length` tokens each, as token ids."""
    return [encode(text) for text in needle_texts(encode, filler, length, count, seed)]


def needle_texts(encode, filler: list[str], length: int, count: int = 2000,
                 seed: int = NEEDLE_SEED) -> list[str]:
    """`needle_rows` as text (prompt + answer), at least `length` tokens of `encode` each."""
    texts = []
    for i in range(count):
        n_chars = int(length * 4.5)
        while True:
            sample = tasks.needle(seed + i, n_chars=n_chars, filler=filler)
            text = sample.prompt + sample.answer
            if len(encode(text)) >= length:
                break
            n_chars = int(n_chars * 1.3)
        texts.append(text)
    return texts
