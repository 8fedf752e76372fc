"""Which BLAS MLX runs on, and making it a fast one on Linux.

The Linux `mlx-cpu` wheel bundles the reference BLAS (a few GFLOP/s). MLX resolves `cblas_sgemm`
when `mlx.core` is first imported, so loading a system OpenBLAS into the global symbol scope before
that import makes every MLX matmul use it (results unchanged, far faster: `kvtrans doctor`
measures it). This module must be imported before `mlx.core`: `mlx_kvtrans/__init__.py`
imports it first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

OPENBLAS_CANDIDATES = [
    f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libopenblas.so.0",
    f"/usr/lib/{platform.machine()}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
]
FIX = (
    "install Debian's libopenblas0-pthread (apt-get install libopenblas0-pthread) and import "
    "mlx_kvtrans before mlx, or start Python with "
    "LD_PRELOAD=/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libopenblas.so.0"
)


def _mapped_openblas() -> str | None:
    """Path of an OpenBLAS already mapped into this process, if any."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if "libopenblas" in line:
                return line.split()[-1]
    except OSError:
        pass
    return None


def _preload_openblas() -> str | None:
    if os.environ.get("KVTRANS_NO_OPENBLAS"):
        return None
    found = _mapped_openblas()
    if found:
        return found
    names = list(OPENBLAS_CANDIDATES)
    if (lib := ctypes.util.find_library("openblas")) is not None:
        names.append(lib)
    for name in names:
        try:
            ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
        except OSError:
            continue
        return _mapped_openblas() or name
    return None


def _configure() -> tuple[str, str | None]:
    """Returns (blas name, library path) as MLX will see it."""
    if sys.platform == "darwin":
        return "accelerate", None
    if "mlx.core" in sys.modules:
        # Too late to change what MLX bound to; only an LD_PRELOAD'ed OpenBLAS counts.
        path = _mapped_openblas() if "openblas" in os.environ.get("LD_PRELOAD", "") else None
        return ("openblas", path) if path else ("reference", None)
    path = _preload_openblas()
    return ("openblas", path) if path else ("reference", None)


BLAS_NAME, BLAS_PATH = _configure()
if BLAS_NAME == "reference" and "mlx.core" in sys.modules and not os.environ.get(
        "KVTRANS_NO_OPENBLAS"):
    # mlx.core was imported first and bound its bundled BLAS: say so once, here
    warnings.warn("mlx.core was imported before mlx_kvtrans, so MLX keeps its bundled reference "
                  "BLAS (far slower matmuls on Linux; `kvtrans doctor` measures it). Fix: "
                  + FIX, RuntimeWarning, stacklevel=2)


@dataclass(frozen=True)
class BlasReport:
    name: str  # "openblas", "accelerate" or "reference"
    path: str | None
    gflops: float  # measured float32 matmul throughput
    slow: bool

    @property
    def fix(self) -> str | None:
        return FIX if self.slow else None

    def __str__(self) -> str:  # as every results file names it
        return f"{self.name}, float32 matmul {self.gflops:.0f} GFLOP/s"


def machine_memory() -> int:
    """Bytes of memory this machine has."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    """Median wall time of `fn` over `repeats` runs, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_gflops(n: int = 1024, repeats: int = 8, dtype=None) -> float:
    """Measured float32 (or `dtype`) n x n matmul throughput on the default device, GFLOP/s
    (median of `repeats`)."""
    import mlx.core as mx

    dtype = dtype or mx.float32
    a = mx.random.normal((n, n)).astype(dtype)
    b = mx.random.normal((n, n)).astype(dtype)
    mx.eval(a, b)
    return 2 * n**3 / median_seconds(lambda: mx.eval(a @ b), repeats) / 1e9


def memory_bandwidth_gbs(mib: int = 256, repeats: int = 5, fresh: bool = False) -> float:
    """Measured memory bandwidth through MLX on the default device, GB/s: the median time of
    copying a `mib` MiB float32 array (`a + 0`: every byte read once and written once), counting
    bytes read + written.

    The output buffer is reused from MLX's cache (its limit raised for the measurement, then
    restored), unless `fresh`: on Linux a fresh 256 MiB buffer costs page faults (several times
    the copy), which measure the allocator, not the memory (`buffer_cache`)."""
    import mlx.core as mx

    a = mx.arange(mib * 2**20 // 4, dtype=mx.float32)
    mx.eval(a)
    limit = mx.set_cache_limit(0 if fresh else mx.get_cache_memory() + 2 * a.nbytes)
    try:
        seconds = median_seconds(lambda: mx.eval(a + 0), repeats)
    finally:
        mx.set_cache_limit(limit)
        mx.clear_cache()
    return 2 * a.nbytes / seconds / 1e9


def blas_report(measure: bool = True) -> BlasReport:
    gflops = matmul_gflops() if measure else float("nan")
    return BlasReport(BLAS_NAME, BLAS_PATH, gflops, slow=BLAS_NAME == "reference")
