"""Held-out perplexity of a model, beside the unigram baseline it must beat."""

from __future__ import annotations

import math
import random

import mlx.core as mx
import numpy as np


def perplexity(model, ids: np.ndarray, length: int, windows: int = 64, seed: int = 0) -> float:
    """exp(mean next-token NLL) over `windows` random windows of `length` tokens of `ids`."""
    rng = random.Random(seed)
    total, count = 0.0, 0
    for _ in range(windows):
        start = rng.randrange(0, len(ids) - length - 1)
        x = mx.array(ids[start:start + length + 1])[None]
        logits = model(x[:, :-1]).astype(mx.float32)
        nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, x[:, 1:, None], -1)[..., 0]
        total += float(nll.sum())
        count += length
    return math.exp(total / count)


def unigram_perplexity(train_ids: np.ndarray, eval_ids: np.ndarray, vocab: int) -> float:
    """The baseline a model must beat: token frequencies of the training split (add-one)."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[eval_ids].mean()))
