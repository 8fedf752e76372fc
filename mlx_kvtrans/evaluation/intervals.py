"""How far a figure measured on a few held-out windows can be trusted: 95% intervals.

A share of yes / no outcomes (first token, needle recall, switches applied) gets Wilson's score
interval, which stays inside [0, 1] and is not empty at 0 or 1 (n = 16 all right still leaves
[0.81, 1]). A statistic of several per-window columns (the recovered share is a ratio of two
means over the same windows) gets a percentile bootstrap: the windows are redrawn with
replacement, the columns together, so what pairs them is kept.
"""

from __future__ import annotations

import math

import numpy as np

from ..translators.frontier import history_recovered

Z95 = 1.959964  # the normal quantile of a two-sided 95% interval
DRAWS = 2000  # bootstrap redraws: the interval's ends move by well under 0.01 beyond this


def wilson(share: float, n: int) -> tuple[float, float]:
    """The 95% score interval of a share of `n` yes / no outcomes."""
    if n <= 0:
        return (0.0, 1.0)
    z2 = Z95 * Z95
    centre = (share + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(share * (1 - share) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap(statistic, columns: list[list[float]], draws: int = DRAWS,
              seed: int = 0) -> tuple[float, float]:
    """The 95% percentile interval of `statistic(*column_means)` over windows redrawn with
    replacement; `columns` hold one value per window each, in the same order."""
    data = np.asarray(columns, dtype=np.float64)  # (columns, windows)
    n = data.shape[1]
    picks = np.random.default_rng(seed).integers(0, n, size=(draws, n))
    means = data[:, picks].mean(axis=2)  # (columns, draws)
    values = np.array([statistic(*means[:, d]) for d in range(draws)], dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return (math.nan, math.nan)
    low, high = np.percentile(values, [2.5, 97.5])
    return (float(low), float(high))


def recovered_share(agreement: float, floor: float) -> float:
    """`history_recovered`, not finite (rather than None) where the floor is 1."""
    share = history_recovered(agreement, floor)
    return math.nan if share is None else share


def window_intervals(agree: list[float], floor: list[float], match: list[float],
                     first: list[float], recall: float | None, needles: int,
                     applied: float | None, switches: int) -> dict[str, list[float]]:
    """The 95% intervals of one frontier row's figures, from its per-window values."""
    out = {"history_recovered": bootstrap(recovered_share, [agree, floor]),
           "agreement": bootstrap(lambda a: a, [agree]),
           "greedy_match": bootstrap(lambda m: m, [match]),
           "first_token": wilson(sum(first) / len(first), len(first))}
    if recall is not None and needles:
        out["recall_translated"] = wilson(recall, needles)
    if applied is not None and switches:
        out["applied"] = wilson(applied, switches)
    return {k: [round(lo, 4), round(hi, 4)] for k, (lo, hi) in out.items()}


def paired_gain(pairs: list[tuple[list[float], list[float], list[float]]], draws: int = DRAWS,
                seed: int = 0) -> tuple[float, float, float]:
    """(gain, low, high): how much more of the history's worth one translator recovers than
    another measured on the same windows, averaged over lengths, with its 95% interval.
    `pairs`: per length, (its agreement, the other's, the floor) per window: the floor is the
    native target's and the same for both. The windows are redrawn together, so what makes a
    window hard for both cancels out of the difference."""
    rng = np.random.default_rng(seed)
    gains, draws_of = [], []
    for mine, theirs, floor in pairs:
        data = np.asarray([mine, theirs, floor], dtype=np.float64)
        gains.append((data[0].mean() - data[1].mean()) / max(1e-9, 1.0 - data[2].mean()))
        picks = rng.integers(0, data.shape[1], size=(draws, data.shape[1]))
        m = data[:, picks].mean(axis=2)
        draws_of.append((m[0] - m[1]) / np.maximum(1e-9, 1.0 - m[2]))
    low, high = np.percentile(np.mean(draws_of, axis=0), [2.5, 97.5])
    return float(np.mean(gains)), float(low), float(high)
