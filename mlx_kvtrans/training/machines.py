"""The machine a plan is for: this one, measured, or the Mac a user will fit on.

A user plans on a laptop for the Mac Studio that will fit the translator, so `kvtrans plan`
takes a named preset or the figures themselves (memory, matmul rate, bandwidth). Only figures
with a source are preset; a plan for another machine projects at its rates (the brief timed
fit `fit_time` runs measures this machine only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..errors import KvtransError


@dataclass(frozen=True)
class Machine:
    name: str
    memory_bytes: int
    matmul_gflops: float
    bandwidth_gbs: float
    source: str  # where the figures come from
    measured: bool = False  # this machine, its rates timed now


PRESETS = {
    "m3-ultra": Machine(
        "Mac Studio M3 Ultra, 512 GB", 512 * 2**30, 17_400.0, 819.0,
        "memory and bandwidth: Apple's M3 Ultra announcement (up to 512 GB, 819 GB/s); matmul: "
        "MLX float16 matmul as users report it on the M3 Ultra (about 17.4 TFLOP/s)"),
}


def this_machine() -> Machine:
    from ..backend.blas import machine_memory, matmul_gflops, memory_bandwidth_gbs

    return Machine("this machine", machine_memory(), matmul_gflops(), memory_bandwidth_gbs(),
                   "measured now", measured=True)


def parse_bytes(text: str) -> int:
    """'512GiB', '192 GB', '64g' -> bytes (GB and G read as GiB, as Macs' memory is sold)."""
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(t|g|m)(?:i?b)?\s*", text.lower())
    if not found:
        raise KvtransError(f"--memory {text!r}: give a size such as 512GiB or 192GB")
    value = float(found.group(1)) * {"t": 2**40, "g": 2**30, "m": 2**20}[found.group(2)]
    if value <= 0:
        raise KvtransError(f"--memory {text!r}: a machine has some memory")
    return int(value)


def machine_for(preset: str | None = None, memory: str | None = None,
                matmul_tflops: float | None = None, bandwidth_gbs: float | None = None
                ) -> Machine:
    """The machine a plan projects for: `preset` (or this machine, measured), with any figure
    given in its place."""
    if preset is not None and preset not in PRESETS:
        raise KvtransError(f"--machine takes {', '.join(PRESETS)}, not {preset!r}")
    base = PRESETS[preset] if preset else this_machine()
    changes = {}
    if memory is not None:
        changes["memory_bytes"] = parse_bytes(memory)
    if matmul_tflops is not None:
        changes["matmul_gflops"] = matmul_tflops * 1000.0
    if bandwidth_gbs is not None:
        changes["bandwidth_gbs"] = bandwidth_gbs
    if not changes:
        return base
    given = ", ".join({"memory_bytes": "memory", "matmul_gflops": "matmul rate",
                       "bandwidth_gbs": "bandwidth"}[k] for k in changes)
    rates_kept = not {"matmul_gflops", "bandwidth_gbs"} & set(changes)
    return replace(base, **changes, name=f"{base.name} ({given} as given)",
                   measured=base.measured and rates_kept,
                   source=f"{base.source}; {given}: as given")
