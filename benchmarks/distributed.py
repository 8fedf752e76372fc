"""Stage 1 across processes: `kvtrans fit` of the zoo kimi pair run by one process and by two
under `mlx.launch --backend ring`, side by side: the wall times and the largest difference
between the translators' weights.

The two-process fit runs each process on one thread. It is compared with a one-process fit on
one thread (the same arithmetic per batch: what the split alone changes) and on every core
(the fastest single fit here; its BLAS sums a batch in another order, which the solve
amplifies).

Both fits read the zoo corpus (the command's default) and calibrate their gate on the shipped
validation split. Writes benchmarks/results/distributed.{json,md} and the fit figures block of
docs/distributed.md.

    python benchmarks/distributed.py [--windows 256] [--length 256] [--gate-windows 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx_kvtrans  # noqa: F401  first: fast BLAS
import mlx.core as mx

from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.models import weights_dir

HERE = Path(__file__).resolve().parent
OUT = HERE / "results"
DOC = HERE.parent / "docs" / "distributed.md"
BEGIN, END = "<!-- fit-figures:begin -->", "<!-- fit-figures:end -->"
SOURCE, TARGET = "kimi-linear", "kimi-vl"
BAR = 1e-4  # the largest weight difference the two fits may show


def fit(processes: int, threads: int, windows: int, length: int, gate_windows: int,
        root: Path) -> dict:
    launcher = [] if processes == 1 else [
        shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or "mlx.launch",
        "-n", str(processes), "--backend", "ring", "--starting-port", "47911", "--"]
    run = f"{processes}x{threads}"
    out = root / f"fit-{run}"
    command = [*launcher, sys.executable, "-m", "mlx_kvtrans.cli", "fit", "--from", SOURCE,
               "--to", TARGET, "--out", str(out), "--workdir", str(root / f"work-{run}"),
               "--windows", str(windows), "--length", str(length),
               "--validation", str(weights_dir() / "corpus" / "validation.txt"),
               "--gate-windows", str(gate_windows), "--json"]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    took = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"the {processes}-process fit failed: {done.stderr.strip()[-800:]}")
    manifest = json.loads((out / "manifest.json").read_text())["fit"]
    print(f"{processes} process(es), {threads} thread(s) each: {took:.1f} s", flush=True)
    return {"processes": processes, "threads_each": threads, "wall_s": round(took, 1),
            "tokens": manifest["tokens"], "weights": str(out / "weights.safetensors")}


def largest_difference(a: Path, b: Path) -> tuple[float, int]:
    one, two = mx.load(str(a)), mx.load(str(b))
    if one.keys() != two.keys():
        sys.exit("the two fits wrote different parameters")
    worst = max(mx.abs(one[k].astype(mx.float32) - two[k].astype(mx.float32)).max().item()
                for k in one)
    return worst, len(one)


def markdown(result: dict) -> str:
    one = result["runs"][0]
    return "\n".join([
        f"`kvtrans fit` of the zoo {SOURCE} -> {TARGET} pair ({result['windows']} windows of "
        f"{result['length']} tokens, {one['tokens']:,} tokens; gate calibrated on "
        f"{result['gate_windows']} windows) on this machine ({result['cores']} cores, "
        f"{result['blas']}), by one process and by two under `mlx.launch --backend ring` "
        "(`python benchmarks/distributed.py`):",
        "",
        "| processes | threads each | wall s | largest weight difference from the two-process "
        "fit |",
        "|---|---|---|---|",
        *(f"| {r['processes']} | {r['threads_each']} | {r['wall_s']} | "
          + ("-" if r["processes"] == 2 else f"{r['max_weight_difference']:.2e}") + " |"
          for r in result["runs"]),
        "",
        f"Over the translators' {result['parameters']} weight arrays. Against the one-process "
        f"fit on one thread (the same arithmetic per batch) the bar ({BAR:.0e}) is "
        f"{'met' if result['runs'][0]['max_weight_difference'] <= BAR else 'not met'}. Two "
        "processes on one machine share its cores, so the wall times compare the work's split, "
        "not two Macs' speed.",
        ""])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=256)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--gate-windows", type=int, default=16)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        runs = [fit(n, t, args.windows, args.length, args.gate_windows, Path(tmp))
                for n, t in ((1, 1), (1, cores), (2, 1))]
        for run in runs[:2]:
            run["max_weight_difference"], count = largest_difference(
                Path(run["weights"]), Path(runs[2]["weights"]))
    for run in runs:
        del run["weights"]
    result = {"pair": f"{SOURCE}__{TARGET}", "windows": args.windows, "length": args.length,
              "gate_windows": args.gate_windows, "cores": os.cpu_count(),
              "blas": blas_report(measure=False).name, "runs": runs, "parameters": count}
    print("largest weight differences from the two-process fit: "
          + ", ".join(f"{r['max_weight_difference']:.2e}" for r in runs[:2]))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "distributed.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (OUT / "distributed.md").write_text("# Stage 1 across processes\n\n" + table)
    text = DOC.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + table + text[stop:])


if __name__ == "__main__":
    main()
