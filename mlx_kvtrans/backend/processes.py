"""The processes `mlx.launch` starts for one command: which share of the work is each one's, and
sums and gathers across them (float64 sums, so a result does not depend on how many there are).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def launched_group():
    """The processes `mlx.launch` started for this command, or None when it runs alone."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def mine(index: int, group) -> bool:
    """Whether batch `index` is this process's: batches are dealt round-robin."""
    return group is None or index % group.size() == group.rank()


def summed(value: np.ndarray, group) -> np.ndarray:
    """`value` summed over every process, in float64."""
    total = mx.distributed.all_sum(mx.array(np.asarray(value, np.float64), dtype=mx.float64),
                                   group=group, stream=mx.cpu)
    return np.array(total)


def gathered(rows: list[np.ndarray], group) -> list[np.ndarray]:
    """Every process's `rows` (arrays of one shape past the first axis), concatenated in rank
    order: one array."""
    local = np.ascontiguousarray(np.concatenate(rows))
    raw = local.view(np.uint8).reshape(-1)
    sizes = np.zeros(group.size())
    sizes[group.rank()] = raw.size
    sizes = summed(sizes, group).astype(np.int64)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: raw.size] = raw
    every = np.array(mx.distributed.all_gather(mx.array(padded), group=group, stream=mx.cpu))
    every = every.reshape(group.size(), -1)
    parts = [np.frombuffer(every[r, : sizes[r]].tobytes(), local.dtype) for r in
             range(group.size())]
    return [np.concatenate(parts).reshape(-1, *local.shape[1:])]
