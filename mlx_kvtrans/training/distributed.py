"""Stage 1 under `mlx.launch`: every process streams its share of the fitting batches into
sums of its own, and the sums are combined once, before the solve.

The moments are sums, so the combined fit is the one-process fit up to the order of float64
additions: fixed-shape sums (moments, identity-table sums, covariances) are summed across
processes in float64 (`mx.distributed.all_sum`); what grows per batch (bilinear state pairs,
bigram codes) is gathered, each process's rows in rank order. Every process must have summed at
least one batch, so that all hold sums of the same shapes in the same order (checked).
"""

from __future__ import annotations

import zlib

import numpy as np

from ..backend.processes import gathered, summed
from ..errors import KvtransError
from ..translators.identity_tables import TableMoments
from ..translators.stats import Moments, SharedMoments


def check_batches(count: int, group) -> None:
    if group is not None and count < group.size():
        raise KvtransError(f"{count} fitting batches for {group.size()} processes: each needs "
                         "at least one (more windows, or fewer processes)")


def combine(stats: dict, group) -> None:
    """Replace every process's running sums in `stats` by the sums over all processes."""
    arrays: list = []
    _walk(stats, arrays.append)
    signature = zlib.crc32(repr([(type(a).__name__, getattr(a, "shape", None))
                                 for a in arrays]).encode())
    agreed = summed(np.array([signature], np.float64), group)
    if agreed[0] != signature * group.size():
        raise RuntimeError("the processes of this fit hold sums of different shapes: were they "
                           "given the same data and options?")
    _walk(stats, lambda _: None, group)


def _walk(entry, visit, group=None) -> None:
    """Visit (or, with `group`, combine) every sum in `entry`, in a fixed order."""
    if isinstance(entry, SharedMoments):
        for moments in entry.moments.values():
            _walk(moments, visit, group)
    elif isinstance(entry, Moments):
        for name in ("xx", "xy", "sx", "sy", "syy"):
            visit(getattr(entry, name))
            if group is not None:
                setattr(entry, name, summed(getattr(entry, name), group))
        if group is not None:
            entry.n = float(summed(np.array([entry.n]), group)[0])
    elif isinstance(entry, TableMoments):
        for sums in (entry.count, entry.sx, entry.sy):
            for lag in sorted(sums):
                visit(sums[lag])
                if group is not None:
                    sums[lag] = summed(sums[lag], group)
        if group is not None:
            entry.bigrams = gathered(entry.bigrams, group)
    elif isinstance(entry, dict):
        for value in entry.values():
            _walk(value, visit, group)
    elif isinstance(entry, tuple) and all(isinstance(v, list) for v in entry):
        for rows in entry:  # state pairs: a list of arrays per side
            if group is not None:
                rows[:] = gathered(rows, group)
