"""MLX's buffer cache on the CPU, sized so that repeated work reuses its buffers.

Without Metal, MLX keeps at most 32 MiB of freed buffers for reuse (on a Mac, Metal keeps up to
its memory limit). A buffer freed beyond that goes back to malloc, and glibc returns large ones
to the OS, so the next array of that size is page-faulted in anew: a 64 MiB elementwise op costs
several times its arithmetic (`kvtrans doctor` measures both). A prefill, a translation and a
decode step free and allocate the same few shapes again and again, so a larger cache keeps them:
1/8 of MLX's memory limit, at most 4 GiB. `KVTRANS_CPU_CACHE_MB` sets another size (0 leaves
MLX's own); the cache only holds memory the process had already used.
"""

from __future__ import annotations

import os
import warnings

import mlx.core as mx

DEFAULT_SHARE, DEFAULT_MAX = 1 / 8, 4 << 30
ENV = "KVTRANS_CPU_CACHE_MB"


def cpu_cache_limit() -> int | None:
    """The cache limit this package sets in bytes, or None where it leaves MLX's (Metal, or
    `KVTRANS_CPU_CACHE_MB=0`)."""
    if mx.metal.is_available():
        return None
    asked = os.environ.get(ENV)
    if asked is not None:
        try:
            megabytes = float(asked)
        except ValueError:
            warnings.warn(f"{ENV}={asked!r} is not a number of MiB: MLX keeps its own cache limit",
                          RuntimeWarning, stacklevel=2)
            return None
        return int(megabytes * 2**20) if megabytes > 0 else None
    return int(min(DEFAULT_SHARE * mx.get_memory_limit(), DEFAULT_MAX))


def configure() -> int | None:
    """Set the CPU cache limit (once, at import); returns what was set, if anything."""
    limit = cpu_cache_limit()
    if limit is not None:
        mx.set_cache_limit(limit)
    return limit


CPU_CACHE_LIMIT = configure()
