"""MLX's buffer cache on the CPU, sized so that repeated work reuses its buffers.

On the CPU MLX keeps at most 32 MiB of freed buffers for reuse (Metal and CUDA keep up to their
memory limit). A buffer freed beyond that goes back to malloc, and glibc returns large ones to
the OS, so the next array of that size is page-faulted in anew: a copy into a fresh 256 MiB
buffer runs several times slower than into a reused one (`kvtrans doctor` measures both). A
prefill, a translation and a decode step free and allocate the same few shapes again and again,
so a larger cache keeps them: 1/8 of MLX's memory limit, at most 4 GiB, set at import where
the limit is still MLX's own (a limit the program set first stays). `KVTRANS_CPU_CACHE_MB` sets
another size (0 leaves MLX's). The cache holds only memory the process has used and freed, and
MLX's `clear_cache()` empties it.
"""

from __future__ import annotations

import math
import os
import warnings

import mlx.core as mx

DEFAULT_SHARE, DEFAULT_MAX = 1 / 8, 4 << 30
MLX_CPU_DEFAULT = 32 << 20  # MLX's own cache limit on the CPU
ENV = "KVTRANS_CPU_CACHE_MB"


def _on_a_gpu() -> bool:
    cuda = getattr(mx, "cuda", None)
    return mx.metal.is_available() or bool(cuda is not None and cuda.is_available())


def cpu_cache_limit() -> int | None:
    """The cache limit this package sets in bytes, or None where it leaves MLX's (a GPU, or
    `KVTRANS_CPU_CACHE_MB=0`)."""
    if _on_a_gpu():
        return None
    asked = os.environ.get(ENV)
    if asked is not None:
        try:
            megabytes = float(asked)
        except ValueError:
            megabytes = math.nan
        if not math.isfinite(megabytes) or megabytes < 0:
            warnings.warn(f"{ENV}={asked!r} is not a number of MiB: MLX keeps its own cache "
                          "limit", RuntimeWarning, stacklevel=2)
            return None
        return int(megabytes * 2**20) if megabytes > 0 else None
    return int(min(DEFAULT_SHARE * mx.get_memory_limit(), DEFAULT_MAX))


def configure() -> int | None:
    """Set the CPU cache limit (once, at import) unless the program has set its own; returns
    what was set, if anything."""
    limit = cpu_cache_limit()
    if limit is None:
        return None
    before = mx.set_cache_limit(limit)
    if before != MLX_CPU_DEFAULT:  # the program's own: keep it
        mx.set_cache_limit(before)
        return None
    return limit


CPU_CACHE_LIMIT = configure()
