"""`kvtrans doctor`: what MLX runs on here, and whether it is fast enough to trust timings."""

from __future__ import annotations

import platform

from ..backend import buffer_cache
from ..backend.blas import blas_report, matmul_gflops, median_seconds, memory_bandwidth_gbs


def diagnose() -> dict:
    import mlx.core as mx
    import mlx_lm

    from ..backend import fast_math
    from ..layouts.gated_delta import metal_recurrence_available

    report = blas_report()
    return {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "device": str(mx.default_device()),
        "metal_available": bool(mx.metal.is_available()),
        "metal_recurrence_kernel": metal_recurrence_available(),
        "blas": report.name,
        "blas_library": report.path,
        "matmul_float32_gflops": round(report.gflops, 1),
        # bf16 is what Macs run; on a CPU it is far slower than float32.
        "matmul_bfloat16_gflops": round(matmul_gflops(n=512, repeats=4, dtype=mx.bfloat16), 1),
        # a 256 MiB float32 copy, bytes read + written: what installing a cache moves at
        "memory_bandwidth_gbs": round(memory_bandwidth_gbs(), 1),
        # the same copy into a fresh buffer each time: what a buffer cache too small costs
        "fresh_buffer_bandwidth_gbs": round(memory_bandwidth_gbs(fresh=True), 1),
        "cpu_buffer_cache_mb": (None if buffer_cache.CPU_CACHE_LIMIT is None
                                else round(buffer_cache.CPU_CACHE_LIMIT / 2**20)),
        # a decode step's rows, a gated switch's (the gate's tail and the last token) and 16:
        # a few rows need not cost one row's time times the rows
        "short_read_matmul_ms": short_read_matmul_ms(),
        # float32 exponentials per second: MLX's own, and fast_math's that a CPU runs instead
        "exp_mlx_mvalues_per_s": round(exp_rate(mx.exp), 1),
        "exp_fast_math_mvalues_per_s": round(exp_rate(fast_math.exp), 1),
        "blas_is_slow_reference": report.slow,
        "fix": report.fix,
    }


def exp_rate(exp, n: int = 2**20, repeats: int = 5) -> float:
    """Millions of float32 values per second `exp` computes (median of `repeats`)."""
    import mlx.core as mx

    x = mx.random.normal((n,))
    mx.eval(x)
    return n / median_seconds(lambda: mx.eval(exp(x)), repeats) / 1e6


def short_read_matmul_ms(rows: tuple[int, ...] | None = None, width: int = 4096,
                         out: int = 16384, repeats: int = 5) -> dict[str, float]:
    """Milliseconds of a float32 (rows x `width`) @ (`width` x `out`) matmul per row count, a
    real checkpoint's layer: by default a decode step's 1 row, a gated switch's forward (the
    gate's tail and the last token) and 16; median of `repeats`."""
    import mlx.core as mx

    from ..translators.gate import GATE_TOKENS

    rows = rows or (1, GATE_TOKENS + 1, 16)
    weight = mx.random.normal((width, out))
    mx.eval(weight)
    timed = {}
    for n in rows:
        x = mx.random.normal((n, width))
        mx.eval(x)
        timed[str(n)] = round(median_seconds(lambda: mx.eval(x @ weight), repeats) * 1e3, 3)
    return timed
