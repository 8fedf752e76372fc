"""Time to first token after a switch versus re-reading, for the zoo pairs and for random-weight
models with real checkpoints' per-layer sizes; tabulated into benchmarks/results/switch.md.

Each configuration runs `kvtrans bench` (warm switch, cold switch and re-reading side by side in
one process, medians of repeats, peak memory, translation GFLOP/s against the measured matmul
peak, and the bound a warm switch could reach, measured beside each row), which writes its JSON
and PNG under benchmarks/results/. `--tabulate` only rebuilds the
table from the JSON files already there. The real family's translators
(`kvtrans zoo real-translators`, FAMILY/translators/NAME) run too where they are built.

    python benchmarks/switch.py [--only NAME ...] [--lengths 1024,2048,4096] [--tabulate]
                                [--family runs/real-family]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from mlx_kvtrans.timing.report import describe_fit

RESULTS = Path(__file__).resolve().parent / "results"

RUNS = {  # name -> `kvtrans bench` arguments (lengths added unless given)
    "kimi-linear__kimi-vl": ["--from", "kimi-linear", "--to", "kimi-vl"],
    "kimi-vl__kimi-linear": ["--from", "kimi-vl", "--to", "kimi-linear"],
    "qwen3.5-a__qwen3.5-b": ["--from", "qwen3.5-a", "--to", "qwen3.5-b"],
    "qwen3-small__qwen3-large": ["--from", "qwen3-small", "--to", "qwen3-large"],
    "realistic-kimi": ["--realistic", "kimi"],
    # with token ids (5,120 columns) its fit passed 24 GB here (killed by the OS)
    "realistic-qwen3.5": ["--realistic", "qwen3.5", "--token-identity", "off"],
    "realistic-dsa": ["--realistic", "dsa"],
    "kimi-linear__kimi-vl bf16": ["--from", "kimi-linear", "--to", "kimi-vl",
                                  "--dtype", "bfloat16", "--lengths", "1024,2048"],
}


def real_runs(family: Path) -> dict:
    """name -> `kvtrans bench` arguments of each translator built in FAMILY/translators."""
    built = sorted(p for p in (family / "translators").glob("*__*") if
                   (p / "manifest.json").is_file())
    return {p.name: ["--translator", str(p)] for p in built}


def run(runs: dict, names: list[str], lengths: str, repeats: int):
    for name in names:
        args = list(runs[name])
        if "--lengths" not in args:
            args += ["--lengths", lengths]
        command = [sys.executable, "-m", "mlx_kvtrans.cli", "bench", *args,
                   "--repeats", str(repeats), "--out-dir", str(RESULTS)]
        print("$", " ".join(command[2:]), flush=True)
        if subprocess.run(command).returncode != 0:
            print(f"{name}: failed (see above)", flush=True)


def tabulate():
    lines = ["# Time to first token after a switch\n",
             "Prompts are held-out text for the zoo's models and the real family's "
             "(`smollm2*`, `kvtrans zoo real`), random ids for `realistic-*`. "
             "Warm switch: translate the source's cache and install it, then the target's first "
             "decode step. Gated switch: what a session does, all but the last R tokens "
             "translated (R: the gate's tail r = 8, or the fidelity dial's default setting "
             "where that is longer; column `read`), the target reading those R and the "
             "prompt's last token in one forward whose last logits give the first token, the "
             "fidelity gate comparing its NLL on the last r with the source's; a gated switch "
             "whose gate fired is marked (fell back): "
             "its time is a full re-read's. Step / read + gate: what each spends beyond "
             "translating, the warm switch's first decode step and the gated switch's one "
             "forward of the tokens it reads with the gate's comparison. Cold switch: a user's first, the translator loaded "
             "and run for the first time (the source has read the prompt). Prefill + switch: "
             "the source's recording prefill and the warm switch (fastest recurrence on the "
             "device: Metal kernel on a Mac, chunkwise form elsewhere). Re-reading: the target "
             "reads the prompt itself in plain mlx-lm; re-reading chunked: the same under the "
             "chunkwise recurrence (targets with linear attention only). Bound: the target's "
             "first decode step on the installed cache + translation FLOPs at the measured "
             "matmul peak + installed bytes at the measured memory bandwidth. Side by side in "
             "one process, median of the repeats (since the warm and gated switches were "
             "taken in turn, more runs, up to 25 within a second, for timings of "
             "milliseconds: each JSON's `repeats` and `quick`); peak memory is the extra "
             "memory above the resident models. `realistic-*` rows are random-weight models "
             "with real checkpoints' per-layer sizes (fewer layers, MoE off) and a "
             "translator fitted in closed form on them (features `attention`, token ids; "
             "values meaningless, cost real; its fit is listed below the table). "
             "Regenerate with `python benchmarks/switch.py`.\n",
             "| pair | dtype | BLAS (peak GFLOP/s) | tokens | re-reading ms | re-reading "
             "chunked ms | warm switch ms | speed-up | gated switch ms | read | speed-up | "
             "step / read + gate ms | bound ms | "
             "warm / bound | cold switch ms | speed-up | prefill + switch ms | speed-up | "
             "translate GFLOP/s | peak MB switch / prefill |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(value):  # results written before a column existed show "-"
        return "-" if value is None else f"{value * 1000:.1f}"

    def times(value):
        return "-" if value is None else f"x{value:.1f}"

    for path in sorted(RESULTS.glob("bench-*.json")):
        r = json.loads(path.read_text())
        # realistic rows measured before translators were fitted on them: random shaped maps
        pair = r["pair"] + (" (shaped maps)" if r["pair"].startswith("realistic") and
                            "fit" not in r else "")
        for row in r["rows"]:
            # rows written before the cold switch was a user's first: theirs was prefill + switch
            cold = row["cold_switch_s"] if "prefill_and_switch_s" in row else None
            prefill_switch = row.get("prefill_and_switch_s", row["cold_switch_s"])
            outcome = row.get("gated_outcome") or "applied"
            fell_back = "" if outcome.startswith("applied") else " (fell back)"
            lines.append(
                f"| {pair} | {r['dtype']} | {r['blas']} ({r['matmul_peak_gflops']:.0f}) | "
                f"{row['length']} | {ms(row['reread_s'])} | "
                f"{ms(row.get('reread_chunked_s'))} | "
                f"{ms(row['warm_switch_s'])} | x{row['speedup_warm']:.1f} | "
                f"{ms(row.get('gated_switch_s'))}{fell_back} | "
                f"{row.get('gated_read') or row.get('gate_tokens') or '-'} | "
                f"{times(row.get('speedup_gated'))} | "
                f"{ms(row.get('first_step_s'))} / {ms(row.get('gated_read_s'))} | "
                f"{ms(row.get('bound_s'))} | {times(row.get('warm_over_bound'))} | "
                f"{ms(cold)} | {times(cold and row['reread_s'] / cold)} | "
                f"{ms(prefill_switch)} | x{row['reread_s'] / prefill_switch:.2f} | "
                f"{row['translate_gflops']:.1f} | {row['peak_mb_switch']:.0f} / "
                f"{row['peak_mb_reread']:.0f} |")
    fits = []
    for path in sorted(RESULTS.glob("bench-*.json")):
        r = json.loads(path.read_text())
        f = r.get("fit")
        if not f:
            continue
        line = f"- {r['pair']} ({r['dtype']}): {describe_fit(f)}"
        fits.append(line)
    if fits:
        lines += ["", "Realistic translators' closed-form fits:", "", *fits]
    (RESULTS / "switch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="run only these (of RUNS and the family's)")
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tabulate", action="store_true", help="only rebuild switch.md")
    parser.add_argument("--family", type=Path, default=Path("runs/real-family"),
                        help="the real family whose built translators run too")
    args = parser.parse_args()
    runs = {**RUNS, **real_runs(args.family)}
    unknown = sorted(set(args.only or ()) - set(runs))
    if unknown:
        parser.error(f"--only {unknown[0]}: choose among {', '.join(runs)}")
    if not args.tabulate:
        run(runs, args.only or list(runs), args.lengths, args.repeats)
    tabulate()


if __name__ == "__main__":
    main()
