"""Every shipped direction at its default setting, against the bars users hold it to, with
enough held-out windows and needles that a figure says which side of its bar it is on.

Through a `Session` as users switch (gate on), at each translator's default R
(`session/dial.py`), on the test split: per length, 64 prose windows and 96 needles by default
(the frontier's grid of lengths and settings reads 8 of each; at 32 needles a recall of 0.8 has
an interval of 0.63-0.90, too wide to tell it from the bar), each figure with its 95% interval
(`mlx_kvtrans/evaluation/intervals.py`). A bar is **met** where the figure reaches it, **missed**
where even the interval's top does not, and **open** where the interval straddles it.

Writes benchmarks/results/bars.{json,md} (`--results DIR`: there instead); `--translators`
measures only those and keeps the other translators' rows (when measured with the same settings).

    python benchmarks/bars.py [--translators a,b] [--prompts 64] [--needles 96]
    python benchmarks/bars.py --tabulate
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_kvtrans  # noqa: F401  first: fast BLAS

from mlx_kvtrans.evaluation import frontier as fr
from mlx_kvtrans.models import held_out_split
from mlx_kvtrans.session import dial
from mlx_kvtrans.translators import artifact

from common import OUT, cell as table_cell, loaded, merge_and_write, shipped_directions

LENGTHS = (256, 512)  # where the bars are read
LONG = 1024  # 4x the zoo's fitting length: recall only informs there
BARS = {"recovered": 0.8, "first": 0.85, "match": 16, "applied": 0.8, "recall_margin": 0.10}
NATIVE_RECALL = 0.5  # the recall bar holds where native recall reaches this


def measure(name: str, models: dict, args) -> dict:
    translator, src, tgt = loaded(name, models)
    reread, how = dial.default_reread(translator)  # as a session switches by default
    ids = tgt.tokenizer.encode(held_out_split("test").read_text())
    start = time.perf_counter()
    frontier = fr.measure_translator(artifact.resolve(name), src, tgt, translator, ids,
                                     fr.FrontierConfig(list(LENGTHS) + [LONG], [reread],
                                                       args.prompts, args.needles, repeats=1))
    return {"source": src.name, "target": tgt.name, "reread": reread, "how": how,
            "weights_sha256": frontier.weights_sha256,
            "rows": [row.to_json() for row in frontier.rows],
            "minutes": round((time.perf_counter() - start) / 60, 2)}


def verdict(value: float | None, interval, bar: float) -> str:
    """met / missed / open (the 95% interval straddles the bar), or "" where not measured."""
    if value is None:
        return ""
    if value >= bar:
        return "met"
    return "open" if interval and interval[1] >= bar else "missed"


def checks(row: dict) -> dict[str, tuple[str, str]]:
    """bar -> (the figure as written, met / missed / open) for one row."""
    spans = row.get("intervals") or {}

    def cell(key, spec):
        value, span = row.get(key), spans.get(key)
        if value is None:
            return "-"
        text = format(value, spec)
        return text + (f" [{format(span[0], spec)}, {format(span[1], spec)}]" if span else "")

    native, got = row["recall_native"], row["recall_translated"]
    recall_bar = None if native is None or native < NATIVE_RECALL else native - BARS[
        "recall_margin"]
    return {
        "recovered": (cell("history_recovered", ".2f"), verdict(
            row["history_recovered"], spans.get("history_recovered"), BARS["recovered"])),
        "first": (cell("first_token", ".2f"), verdict(
            row["first_token"], spans.get("first_token"), BARS["first"])),
        "match": (cell("greedy_match", ".1f"), verdict(
            row["greedy_match"], spans.get("greedy_match"), BARS["match"])),
        "applied": (cell("applied", ".2f"), verdict(
            row.get("applied"), spans.get("applied"), BARS["applied"])),
        "recall": (f"{table_cell(native, '.2f')} / " + cell("recall_translated", ".2f"),
                   "" if recall_bar is None or got is None else verdict(
                       got, spans.get("recall_translated"), recall_bar)),
    }


def write_markdown(results: dict, settings: dict, blas: str, out: Path) -> None:
    lines = ["# At the default setting, against the bars\n",
             f"Every shipped direction through a `Session` (gate on) at its default R "
             "(`session/dial.py`: the cheapest R meeting agreement 0.9 at twice the fitting "
             "length in the frontier recorded beside the translator, on the validation split), "
             f"on the test split: {settings['prompts']} prose windows and "
             f"{settings['needles']} needles per length. Bars: recovered >= "
             f"{BARS['recovered']}, first token >= {BARS['first']}, greedy match >= "
             f"{BARS['match']} of {fr.GENERATED}, applied >= {BARS['applied']}, recall >= "
             f"native - {BARS['recall_margin']} where native >= {NATIVE_RECALL}. Each figure "
             "has its 95% interval in brackets (a bootstrap over windows for the recovered "
             "share and the match, Wilson's for shares); a bar is **missed** (bold) where "
             "even the interval's top falls short of it, *open* (italic) where the interval "
             f"straddles it. Rows at {LONG:,} tokens (4x the zoo's fitting length) inform and "
             "hold no bar. *Near ties*: of the continuation positions whose argmax parts from "
             f"native's, the share where native's own two likeliest tokens lie within "
             f"{fr.TIE_NATS} nats (no bar: it says how much of what the recovered share misses "
             "is a near tie). Regenerate with `python benchmarks/bars.py`; the grid of lengths "
             "and settings is `frontier.md`'s.\n", f"BLAS: {blas}\n",
             "| translator | L | R | recovered | near ties | first | match | applied | recall "
             "native / switched |", "|---|---|---|---|---|---|---|---|---|"]
    tally = {"met": 0, "open": 0, "missed": 0}
    for name, r in results.items():
        for row in r["rows"]:
            marks = checks(row)
            held = row["length"] in LENGTHS
            cells = []
            for bar, (text, how) in marks.items():
                if held and how:
                    tally[how] += 1
                cells.append(f"**{text}**" if held and how == "missed"
                             else f"*{text}*" if held and how == "open" else text)
                if bar == "recovered":
                    cells.append(table_cell(row.get("near_ties"), ".2f"))
            lines.append(f"| {name} | {row['length']:,} | {r['reread']} | "
                         + " | ".join(cells) + " |")
    lines += ["", f"At {' and '.join(map(str, LENGTHS))} tokens: {tally['met']} bars met, "
              f"{tally['open']} open, {tally['missed']} missed.", ""]
    (out / "bars.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--translators", help="a,b (default: every shipped direction)")
    parser.add_argument("--prompts", type=int, default=64, help="held-out windows per length")
    parser.add_argument("--needles", type=int, default=96, help="held-out needles per length")
    parser.add_argument("--results", type=Path, default=OUT, help="where to write bars.*")
    parser.add_argument("--tabulate", action="store_true",
                        help="only rebuild bars.md from bars.json")
    args = parser.parse_args()
    results_file = args.results / "bars.json"
    if args.tabulate:
        saved = json.loads(results_file.read_text())
        write_markdown(saved["translators"], saved["settings"], saved["blas"], args.results)
        return
    names = args.translators.split(",") if args.translators else shipped_directions()
    settings = {"prompts": args.prompts, "needles": args.needles}
    models, measured = {}, {}
    for name in names:
        measured[name] = measure(name, models, args)
        print(f"{name}: {measured[name]['minutes']} min", flush=True)
    results, blas = merge_and_write(results_file, settings, measured)
    write_markdown(results, settings, blas, args.results)


if __name__ == "__main__":
    main()
