"""How well `kvtrans plan` projects the time of `kvtrans fit`: per fit size, the command
`kvtrans plan --data TEXT --json` beside `kvtrans fit --data TEXT` run right after it (wall
time, loading and the gate's calibration included), on the default pair (zoo kimi-linear ->
kimi-vl) at the fit's defaults but for its windows.

The fitting text is the shipped validation split (only time is measured). Each size is measured
on a quiet machine and under the load of one other job (a process multiplying matrices on every
core, started before the plan and stopped after the fit). Writes benchmarks/results/plan.{json,md}.

    python benchmarks/plan.py [--windows 64 256]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx_kvtrans  # noqa: F401  first: fast BLAS

from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.models import weights_dir
from mlx_kvtrans.training.fit import FitConfig

OUT = Path(__file__).resolve().parent / "results"
SOURCE, TARGET = "kimi-linear", "kimi-vl"
KVTRANS = [sys.executable, "-m", "mlx_kvtrans.cli"]


def measure(windows: int) -> dict:
    text = str(weights_dir() / "corpus" / "validation.txt")
    tokens = windows * FitConfig().length
    plan = subprocess.run([*KVTRANS, "plan", "--from", SOURCE, "--to", TARGET, "--tokens",
                           str(tokens), "--data", text, "--json"],
                          check=True, capture_output=True, text=True)
    projected = json.loads(plan.stdout)["fit_seconds"]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run([*KVTRANS, "fit", "--from", SOURCE, "--to", TARGET, "--windows",
                        str(windows), "--data", text, "--validation", text, "--out",
                        f"{tmp}/translator", "--workdir", f"{tmp}/work"],
                       check=True, capture_output=True, text=True)
        took = time.perf_counter() - start
    row = {"windows": windows, "tokens": tokens, "projected_s": round(projected, 2),
           "took_s": round(took, 2), "projected_over_took": round(projected / took, 2)}
    print(f"{windows} windows: projected {row['projected_s']} s, took {row['took_s']} s, "
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
    parser.add_argument("--windows", nargs="+", type=int, default=[64, FitConfig().windows],
                        help="fits of this many windows (the default fit's is the last)")
    args = parser.parse_args()
    rows = []
    for windows in args.windows:
        for loaded in (False, True):
            with load(loaded):
                rows.append({**measure(windows), "under_load": loaded})
    OUT.mkdir(parents=True, exist_ok=True)
    blas = str(blas_report())
    (OUT / "plan.json").write_text(json.dumps({"pair": f"{SOURCE}__{TARGET}", "blas": blas,
                                               "rows": rows}, indent=2) + "\n")
    lines = ["# `kvtrans plan` against the fit it projects\n",
             f"Pair {SOURCE} -> {TARGET}, `kvtrans plan --data` then `kvtrans fit --data` "
             f"(wall time) at the fit's defaults but for its windows, on the validation split. "
             f"{blas}. Written by `python benchmarks/plan.py`.\n",
             "| fit windows (tokens) | machine | projected | took | projected / took |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['windows']} ({r['tokens']:,}) | "
              f"{'one other job' if r['under_load'] else 'quiet'} | {r['projected_s']} s | "
              f"{r['took_s']} s | {r['projected_over_took']} |" for r in rows]
    (OUT / "plan.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
