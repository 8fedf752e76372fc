"""Capture: what a model caches, read while it prefills.

`prefill` runs tokens through an mlx-lm model and records every cache object at capture points
raw, normed, engine (`capture`, `Capture`, `tapped`), and joins recorded parts of a conversation
(`join_recorded`); `instrument` holds every run-time tap and patch of mlx-lm it and the rest of
the library use (module and function hooks, the final-norm rows, the chunkwise recurrence).
"""

from .prefill import PREFILL_CHUNK, RESIDUAL, Capture, capture, join_recorded, tapped

__all__ = ["PREFILL_CHUNK", "RESIDUAL", "Capture", "capture", "join_recorded", "tapped"]
