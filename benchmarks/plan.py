"""How well `kvtrans plan` projects the time of `kvtrans fit`: per fit size, the projection
(`fit_time`, timed briefly on the two models) beside the whole fit run right after it, gate
calibration included, on the default pair (zoo kimi-linear -> kimi-vl).

Only the time is measured, so the fitting text is the shipped validation split. Small fits are
dominated by fixed costs the projection does not scale (loading, the first calls' kernel
setup), so the ratio is reported per size. Each size is measured on a quiet machine and under
the load of one other job (a process multiplying matrices on every core, started before the
projection and stopped after the fit). Writes benchmarks/results/plan.{json,md}.

    python benchmarks/plan.py [--sizes 16x64 64x128 256x256] [--gate-windows 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS

from mlx_kvtrans.training.fit_time import fit_time
from mlx_kvtrans.models import load_config_only, weights_dir
from mlx_kvtrans.training.fit import FitConfig
from mlx_kvtrans.training.workflows import fit_translator, plan_and_cost

OUT = Path(__file__).resolve().parent / "results"
SOURCE, TARGET = "kimi-linear", "kimi-vl"


def measure(windows: int, length: int, gate_windows: int) -> dict:
    text = weights_dir() / "corpus" / "validation.txt"
    config = FitConfig(windows=windows, length=length)
    src, tgt = load_config_only(SOURCE), load_config_only(TARGET)
    _, cost = plan_and_cost(src, tgt, config)
    projected = fit_time(src, tgt, cost, config, gate_windows=gate_windows)
    start = time.perf_counter()
    fit_translator(kv.load(SOURCE), kv.load(TARGET), [text], config, validation=text,
                   gate_windows=gate_windows)
    took = time.perf_counter() - start
    row = {"windows": windows, "length": length, "gate_windows": gate_windows,
           "projected_s": round(projected.seconds, 2), "took_s": round(took, 2),
           "projected_over_took": round(projected.seconds / took, 2),
           "projection": projected.to_json()}
    print(f"{windows}x{length}: projected {row['projected_s']} s, took {row['took_s']} s, "
          f"ratio {row['projected_over_took']}", flush=True)
    return row


LOAD = """
import mlx_kvtrans, mlx.core as mx
a = mx.random.normal((1024, 1024))
while True:
    mx.eval(a @ a)
"""


@contextlib.contextmanager
def load(on: bool):
    """Another job on every core while the block runs (`on`), as a busy machine has."""
    if not on:
        yield
        return
    job = subprocess.Popen([sys.executable, "-c", LOAD])
    try:
        time.sleep(2)  # running before the projection starts
        yield
    finally:
        job.kill()
        job.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["16x64", "64x128", "256x256"],
                        help="fits as WINDOWSxLENGTH")
    parser.add_argument("--gate-windows", type=int, default=4)
    args = parser.parse_args()
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes]
    rows = []
    for w, n in sizes:
        for loaded in (False, True):
            with load(loaded):
                rows.append({**measure(w, n, args.gate_windows), "under_load": loaded})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "plan.json").write_text(json.dumps({"pair": f"{SOURCE}__{TARGET}", "rows": rows},
                                              indent=2) + "\n")
    lines = ["# `kvtrans plan` against the fit it projects\n",
             f"Pair {SOURCE} -> {TARGET}; each fit run right after its projection, the gate "
             f"calibrated over {args.gate_windows} windows per kind and band.\n",
             "| fit (windows x length) | machine | projected | took | projected / took |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['windows']} x {r['length']} | "
              f"{'one other job' if r['under_load'] else 'quiet'} | {r['projected_s']} s | "
              f"{r['took_s']} s | {r['projected_over_took']} |" for r in rows]
    (OUT / "plan.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
