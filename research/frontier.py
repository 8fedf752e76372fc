"""The fidelity frontier of every shipped translator direction: how close the switched cache
stays to native, and the warm switch's speed-up over re-reading, per re-read setting R, at 1x-8x
each translator's fitting length, on held-out prose and needles.

Writes research/results/frontier.{json,md,png} (`--results DIR`: there instead); `--translators`
measures only those and keeps the other translators' rows (when measured with the same settings).

    python research/frontier.py [--translators a,b] [--prompts N] [--needles N]
                                  [--lengths 256,512] [--rereads 8,32] [--repeats N]
    python research/frontier.py --tabulate
"""

from __future__ import annotations

import argparse
import json
import time
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # common.py

import mlx_kvtrans  # noqa: F401  first: fast BLAS

from mlx_kvtrans.evaluation import frontier as fr
from mlx_kvtrans.models import held_out_split
from mlx_kvtrans.translators import artifact

from common import ZOO_LENGTHS, cell, ints, loaded, merge_and_write, shipped_directions

OUT = Path(__file__).resolve().parent / "results"
AGREEMENTS = (0.9, 0.95)  # the cheapest setting meeting each, per length, in the summary


def measure(name: str, models: dict, args) -> dict:
    translator, src, tgt = loaded(name, models)
    ids = tgt.tokenizer.encode(held_out_split("test").read_text())
    start = time.perf_counter()
    frontier = fr.measure_translator(artifact.resolve(name), src, tgt, translator, ids,
                                     fr.FrontierConfig(args.lengths or ZOO_LENGTHS, args.rereads,
                                                       args.prompts, args.needles, args.repeats))
    return {**frontier.to_json(), "stage": translator.info.get("stage", 1),
            "minutes": round((time.perf_counter() - start) / 60, 2)}


def write_markdown(results: dict, settings: dict, blas: str, out: Path):
    generated, floor = fr.GENERATED, fr.FLOOR_TOKENS
    lines = ["# Fidelity frontier\n",
             "Per translator, prompt length L (256-2,048: 1x-8x the zoo's fitting length) and "
             "setting R (the translator builds the cache of the first L - 1 - R prompt tokens; "
             "the target reads the R after them, then the last token, itself): on held-out "
             "prose windows of the test split, the native target generates "
             f"{generated} tokens greedily; **agreement** is the share of them the switched "
             f"cache's argmax predicts when fed them (teacher forcing), beside the **floor**: "
             f"the target reading only the last {floor} prompt tokens. **Recovered** = "
             "(agreement - floor) / (1 - floor), the history's worth the switched cache keeps. "
             f"**Match**: tokens of the {generated} generated greedily from the switched cache "
             f"equal to native's (mean), **all**: share of windows with all {generated} equal; "
             "**first**: first-token agreement; **KL**: nats per continuation token; **recall**: "
             "exact six-digit recall of held-out needles, native / switched. **Speed-up**: "
             "the target re-reading the L tokens over the warm switch (the source has read "
             "them; translate, install, the target reads the rest), alternated in one process, "
             f"medians of {settings['repeats']}. {settings['prompts']} windows and "
             f"{settings['needles']} needles per length. Regenerate with "
             "`python research/frontier.py`; one translator's frontier is "
             "`kvtrans eval frontier --translator NAME [--record]`.\n",
             f"BLAS: {blas}\n", "## Cheapest setting meeting an agreement\n",
             "The fastest R whose agreement meets the bar at that length, faster than re-reading "
             "(`mlx_kvtrans.evaluation.frontier.cheapest`); - : re-reading.\n",
             "| translator | length | " + " | ".join(f"agreement >= {a}" for a in AGREEMENTS)
             + " |", "|---|---|" + "---|" * len(AGREEMENTS)]
    for name, r in results.items():
        frontier = fr.Frontier.from_json(r)
        for length in sorted({row.length for row in frontier.rows}):
            picks = [fr.cheapest_row(frontier, a, length) for a in AGREEMENTS]
            lines.append(f"| {name} | {length:,} | " + " | ".join(
                "-" if p is None else f"R={p.setting.reread} ({p.speedup:.1f}x)" for p in picks)
                + " |")
    lines.append("")
    for name, r in results.items():
        lines += [f"## {name}\n", f"{r['source']} -> {r['target']}, stage {r['stage']}, "
                  f"fitting length {r['fit_length']:,}; {r['minutes']} min.\n",
                  "| L | R | agreement | floor | recovered | match | all | first | KL | "
                  "recall | applied | speed-up |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            lines.append(
                f"| {row['length']:,} | {row['setting']['reread']} | {row['agreement']:.3f} | "
                f"{row['agreement_last16']:.3f} | {cell(row['history_recovered'], '.2f')} | "
                f"{row['greedy_match']:.1f} | {row['greedy_exact']:.2f} | "
                f"{row['first_token']:.2f} | {row['kl']:.4f} | "
                f"{cell(row['recall_native'], '.2f')} / "
                f"{cell(row['recall_translated'], '.2f')} | {cell(row.get('applied'), '.2f')} "
                f"| {row['speedup']:.2f}x |")
        lines.append("")
    (out / "frontier.md").write_text("\n".join(lines))
    print("\n".join(lines))


def plot(results: dict, path: Path) -> Path | None:
    """Agreement against speed-up, a line per length, R by each point, the floor dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    columns = min(4, len(results))
    rows = -(-len(results) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.6 * rows), squeeze=False)
    for ax, (name, r) in zip(axes.flat, results.items()):
        for i, length in enumerate(sorted({row["length"] for row in r["rows"]})):
            points = [row for row in r["rows"] if row["length"] == length]
            color = f"C{i}"
            ax.plot([p["speedup"] for p in points], [p["agreement"] for p in points],
                    marker="o", color=color, label=f"L={length:,}")
            ax.axhline(points[0]["agreement_last16"], color=color, linestyle="--", alpha=0.5)
            for p in points:
                ax.annotate(f"R={p['setting']['reread']}", (p["speedup"], p["agreement"]),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axvline(1.0, color="gray", linestyle=":", alpha=0.7)  # re-reading's own speed
        ax.set_title(f"{r['source']} -> {r['target']}", fontsize=9)
        ax.set_xlabel("speed-up over re-reading")
        ax.set_ylabel("teacher-forced agreement")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(results):]:
        ax.axis("off")
    fig.suptitle(f"fidelity frontier (dashed: the last-{fr.FLOOR_TOKENS}-tokens floor; "
                 "dotted: re-reading)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--translators", help="a,b (default: every shipped direction)")
    parser.add_argument("--prompts", type=int, default=16, help="held-out windows per length")
    parser.add_argument("--needles", type=int, default=16, help="held-out needles per length")
    parser.add_argument("--lengths", type=ints, help="default: 256, 512, 1,024, 2,048, 1x-8x "
                        "the zoo's fitting length (every translator at the same lengths)")
    parser.add_argument("--rereads", type=ints, help="R values (default: 8, 32, 128, ... "
                        "below each length)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting")
    parser.add_argument("--results", type=Path, default=OUT, help="where to write frontier.*")
    parser.add_argument("--tabulate", action="store_true",
                        help="only rebuild frontier.md and the PNG from frontier.json")
    args = parser.parse_args()
    if args.tabulate:
        saved = json.loads((args.results / "frontier.json").read_text())
        (args.results / "frontier.json").write_text(json.dumps(saved, indent=2) + "\n")
        write_markdown(saved["translators"], saved["settings"], saved["blas"], args.results)
        plot(saved["translators"], args.results / "frontier.png")
        return
    names = args.translators.split(",") if args.translators else shipped_directions()
    settings = {"prompts": args.prompts, "needles": args.needles, "lengths": args.lengths,
                "rereads": args.rereads, "repeats": args.repeats}
    models, measured = {}, {}
    for name in names:
        measured[name] = measure(name, models, args)
        print(f"{name}: {measured[name]['minutes']} min", flush=True)
    results, blas = merge_and_write(args.results / "frontier.json", settings, measured)
    write_markdown(results, settings, blas, args.results)
    if plot(results, args.results / "frontier.png"):
        print(f"wrote {args.results / 'frontier.png'}")


if __name__ == "__main__":
    main()
