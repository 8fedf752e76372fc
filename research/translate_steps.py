"""Where a warm switch's translation spends its time, step by step, against the bound's terms.

The bound (`switch.md`) counts a translation's FLOPs at the measured matmul peak and the
installed bytes at the measured memory bandwidth. This times each step of the translation
(`Translator.translate(lap=...)`: each step evaluated before the next starts) and the install,
on held-out text, beside the whole translation and install run without the pauses, so that it
shows which steps the bound leaves out: the gathers, the nonlinearity and the layout copies of
the fused maps (`translators/fused.py`), which run at the CPU's elementwise rate, not its
matmul peak. Writes results/translate-steps.md and .json.

    python research/translate_steps.py [--translators A,B] [--lengths 1024,4096] [--tabulate]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import mlx_kvtrans as kv
import mlx.core as mx
from mlx_kvtrans.backend.blas import blas_report, matmul_gflops, memory_bandwidth_gbs
from mlx_kvtrans.translators.install import install
from mlx_kvtrans.models import held_out_split
from mlx_kvtrans.timing.switch import cache_nbytes, source_prefill, translation_flops

OUT = Path(__file__).resolve().parent / "results"
TRANSLATORS = ["kimi-linear__kimi-vl-distilled", "qwen3-small__qwen3-large-distilled"]
LENGTHS = [1024, 4096]
STEPS = ["features", "matmul", "gather", "gelu", "layout", "group matmul", "rest", "install"]


def measure(name: str, lengths: list[int], repeats: int) -> list[dict]:
    translator = kv.load_translator(name).prepare()
    src = kv.load(translator.info["source"]["name"])
    tgt = kv.load(translator.info["target"]["name"])
    source_layout, target_layout = kv.layout_of(src.model), kv.layout_of(tgt.model)
    ids = tgt.tokenizer.encode(held_out_split("test").read_text())
    peak, bandwidth = matmul_gflops(), memory_bandwidth_gbs()
    rows = []
    for length in lengths:
        prompt = mx.array([ids[:length - 1]])
        recorded = source_prefill(translator, src.model, prompt, source_layout)

        def switch(lap=None):
            objects, points = translator.translate(recorded, tgt.model, target_layout, prompt,
                                                   lap=lap)
            cache = install(target_layout, objects, points)
            mx.eval([c.state for c in cache])
            if lap:
                lap("install", [])
            return cache

        installed = cache_nbytes(switch())
        whole = []
        steps = defaultdict(list)
        for _ in range(repeats):  # the two in turn, so that both see the same load
            start = time.perf_counter()
            switch()
            whole.append(time.perf_counter() - start)
            spent, last = defaultdict(float), [time.perf_counter()]

            def lap(step, arrays):
                mx.eval(arrays)
                now = time.perf_counter()
                spent[step] += now - last[0]
                last[0] = now
            switch(lap)
            for step in STEPS:
                steps[step].append(spent.get(step, 0.0))
        flops = translation_flops(translator, length - 1, target_layout)
        rows.append({"translator": name, "tokens": length,
                     "steps_ms": {s: round(statistics.median(v) * 1e3, 2)
                                  for s, v in steps.items()},
                     "stepped_ms": round(sum(statistics.median(v) for v in steps.values())
                                         * 1e3, 2),
                     "whole_ms": round(statistics.median(whole) * 1e3, 2),
                     "flops_at_peak_ms": round(flops / peak / 1e6, 2),
                     "installed_at_bandwidth_ms": round(installed / bandwidth / 1e6, 2),
                     "peak_gflops": round(peak, 1), "bandwidth_gbs": round(bandwidth, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def write_markdown(saved: dict, out: Path) -> None:
    lines = ["# Where a translation's time goes\n",
             "Each step of a warm switch's translation and install, evaluated before the next "
             "starts (median of the runs), on held-out text; `whole`: the same run without the "
             "pauses, in turn with it. Features: the source's features and token "
             "identities; matmul: the fused maps' input (features and identities side by "
             "side, built lazily with it) and their one GEMM, the residuals' hidden units "
             "included; gather: the identity tables' rows; gelu: the residuals' "
             "nonlinearity; layout: the table rows and hidden units of each group of maps "
             "copied into its batched matmul's layout; group matmul: the groups' table and "
             "residual terms; rest: maps not fused and each object's shape from the maps' "
             "outputs. The bound's terms "
             "beside them: the translation's FLOPs at the measured matmul peak and the "
             "installed bytes at the measured memory bandwidth. Regenerate with "
             f"`python research/translate_steps.py`.\n\nBLAS: {saved['blas']}\n",
             "| translator | tokens | " + " | ".join(STEPS) + " | stepped | whole | "
             "FLOPs at peak | installed bytes at bandwidth |",
             "|---|---|" + "---|" * (len(STEPS) + 4)]
    for r in saved["rows"]:
        cells = [f"{r['steps_ms'][s]:.1f}" for s in STEPS]
        lines.append(f"| {r['translator']} | {r['tokens']:,} | " + " | ".join(cells)
                     + f" | {r['stepped_ms']:.1f} | {r['whole_ms']:.1f} | "
                     f"{r['flops_at_peak_ms']:.1f} | {r['installed_at_bandwidth_ms']:.1f} |")
    lines.append("\nAll figures in ms.")
    (out / "translate-steps.md").write_text("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--translators", default=",".join(TRANSLATORS))
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--results", type=Path, default=OUT)
    parser.add_argument("--tabulate", action="store_true", help="only rebuild the .md")
    args = parser.parse_args()
    if args.tabulate:
        return write_markdown(json.loads((args.results / "translate-steps.json").read_text()),
                              args.results)
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    for name in args.translators.split(","):
        rows += measure(name, lengths, args.repeats)
    saved = {"blas": str(blas_report()), "repeats": args.repeats, "rows": rows}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "translate-steps.json").write_text(json.dumps(saved, indent=1))
    write_markdown(saved, args.results)


if __name__ == "__main__":
    main()
