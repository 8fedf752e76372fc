"""README's results table, rendered from the results files so that it cannot go stale.

One row per shipped translator direction, read from what the benchmarks wrote: `bars.json`
(`python benchmarks/bars.py`: through a session at the default re-read setting, what the
switch keeps of the native continuation and of needles, with 95% intervals) and
`bench-SOURCE__TARGET-float32.json` (`python benchmarks/switch.py`: the warm switch's time to
first token against the target re-reading the history); then one row per translator of the real
family, from `real-family.json` (`python benchmarks/real_family.py`).

    python benchmarks/summary.py           # rewrite README's block between the markers
    python benchmarks/summary.py --check   # exit 1 if README's block is not what the files give

No mlx import: this reads JSON only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE.parent / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
LONG = 1024  # 4x it
SWITCH_LENGTHS = (1024, 2048)
FRONTIER_LENGTHS = (256, 512)
REAL_LENGTHS = (256, 512, 1024)  # the real family's bars' lengths


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _times(value: float) -> str:
    return f"{value:.1f}x" if value < 10 else f"{value:.0f}x"


def _switch(results: Path, source: str, target: str) -> str:
    name = f"bench-{source}__{target}-float32.json"
    path = next((p for p in (results / name, results / "switch" / name) if p.exists()), None)
    if path is None:
        return "-"
    rows = {r["length"]: r for r in _load(path).get("rows", [])}
    cells = [_times(rows[n]["speedup_warm"]) if n in rows and rows[n].get("speedup_warm")
             else "-" for n in SWITCH_LENGTHS]
    return " / ".join(cells)


def _stage(name: str) -> int:
    manifest = _load(HERE.parent / "weights" / "translators" / name / "manifest.json")
    return manifest.get("stage", 1)


def _pair(rows: dict, key: str, spec: str = ".2f", lengths=FRONTIER_LENGTHS) -> str:
    return " / ".join("-" if rows.get(n) is None or rows[n].get(key) is None
                      else format(rows[n][key], spec) for n in lengths)


def _with_interval(rows: dict, key: str, length: int, spec: str = ".2f") -> str:
    row = rows.get(length)
    if row is None or row.get(key) is None:
        return "-"
    span = (row.get("intervals") or {}).get(key)
    text = format(row[key], spec)
    return text + (f" ({format(span[0], spec)}-{format(span[1], spec)})" if span else "")


def _recall(rows: dict, length: int) -> str:
    row = rows.get(length)
    if row is None or row.get("recall_translated") is None:
        return "-"
    return f"{row['recall_translated']:.2f} ({row['recall_native']:.2f})"


def render(results: Path = RESULTS) -> str:
    """The markdown block (markers included) that README holds."""
    bars = _load(results / "bars.json")
    lengths = " / ".join(f"{n // 1024}K" for n in SWITCH_LENGTHS)
    at = " / ".join(str(n) for n in FRONTIER_LENGTHS)
    lines = [BEGIN,
             f"| translator (shipped) | stage | default R | history recovered @{at} "
             "(95% interval) | "
             f"first token @{at} | greedy match @{at} | recall @{FRONTIER_LENGTHS[0]} "
             f"(native) | recall @{LONG} (native) | applied @{at} | switch speed-up "
             f"@{lengths} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in bars.get("translators", {}).items():
        rows = {r["length"]: r for r in entry["rows"]}
        recovered = " / ".join(_with_interval(rows, "history_recovered", n)
                               for n in FRONTIER_LENGTHS)
        lines.append(f"| `{name}` | {_stage(name)} | {entry['reread']} | "
                     f"{recovered} | {_pair(rows, 'first_token')} | "
                     f"{_pair(rows, 'greedy_match', '.1f')} | "
                     f"{_recall(rows, FRONTIER_LENGTHS[0])} | {_recall(rows, LONG)} | "
                     f"{_pair(rows, 'applied')} | "
                     f"{_switch(results, entry['source'], entry['target'])} |")
    lines += ["",
              "Through a `Session` as a user switches, at the translator's default R (the tokens "
              "the target re-reads itself at a switch, docs/fidelity.md), on the test split: "
              "history recovered: the share of what the history is worth to the target's next "
              "32 tokens (teacher-forced agreement with its native greedy continuation, above "
              "the last-16-tokens floor) that the switch keeps; first token and greedy match: "
              "of the 32 tokens generated from the switched cache, the first equal to native's, "
              "and how many are; recall: exact six-digit needles (native in brackets); applied: "
              "the share of switches the fidelity gate let stand; "
              f"{bars.get('settings', {}).get('prompts', '-')} windows and "
              f"{bars.get('settings', {}).get('needles', '-')} needles per length. Switch: time to first token "
              "re-reading the history over that of a warm switch (translate, install, first "
              "decode), float32, on the machine and BLAS each file records (- where a direction "
              "is not timed). Rendered by `python benchmarks/summary.py` from "
              "`benchmarks/results/bars.json` (`python benchmarks/bars.py`, where each figure's "
              "interval is) and "
              "`bench-*-float32.json` (`python benchmarks/switch.py`); "
              "[docs/results.md](docs/results.md) names the command that writes each.",
              *_real_rows(_load(results / "real-family.json")), END]
    return "\n".join(lines)


def _real_rows(family: dict) -> list[str]:
    """The real family's translators (`kvtrans zoo real-translators`), from real-family.json
    (`python benchmarks/real_family.py`): the default setting's row of each direction."""
    directions = family.get("directions") or {}
    if not directions:
        return []
    at = " / ".join(str(n) for n in REAL_LENGTHS)
    lines = ["", f"| real translator (built) | stage | sink tokens | relay | history recovered "
             f"@{at} | first token @{at} | greedy match @{at} | recall @{at} (native) | "
             "applied | switch speed-up @2K |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in directions.items():
        row = next(r for r in entry["settings"] if r["recompute"] == 0)
        rows = {int(n): r for n, r in row["lengths"].items()}
        recall = " / ".join("-" if rows.get(n) is None else
                            f"{rows[n]['recall_translated']:.2f} ({rows[n]['recall_native']:.2f})"
                            for n in REAL_LENGTHS)
        applied = min((r["applied"] or 0) for r in rows.values())
        speedup = (_times(rows[2048].get("speedup_as_used", rows[2048]["speedup"]))
                   if 2048 in rows else "-")
        chosen = row.get("relay")
        relay = f"{chosen[0]}-{chosen[1]} from {chosen[2]}" if chosen else "-"
        lines.append(f"| `{name}` | {row['stage']} | {(row['sink'] or {}).get('tokens', 0)} | "
                     f"{relay} | "
                     f"{_pair(rows, 'history_recovered', lengths=REAL_LENGTHS)} | "
                     f"{_pair(rows, 'first_token', lengths=REAL_LENGTHS)} | "
                     f"{_pair(rows, 'greedy_match', '.1f', REAL_LENGTHS)} | {recall} | "
                     f"{applied:.2f} | {speedup} |")
    lines += ["", "The real family (SmolLM2-135M-Instruct and its conversions, built offline by "
              "`kvtrans zoo real`): each direction through a `Session` at its default setting on "
              "a held-out text of another domain and chat needles in the model's template, "
              f"{family.get('prompts', '-')} windows and {family.get('needles', '-')} needles per "
              "length; relay: the target's layers that read the span again from the source's "
              "hidden state entering the layer named (docs/fidelity.md); the switch's speed-up "
              "counts a switch the gate re-reads as a re-read. "
              "Rendered from `benchmarks/results/real-family.json` "
              "(`python benchmarks/real_family.py`)."]
    return lines


def current_block(readme: str) -> str | None:
    """README's block between the markers (markers included), or None without them."""
    start, stop = readme.find(BEGIN), readme.find(END)
    if start < 0 or stop < start:
        return None
    return readme[start:stop + len(END)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if README's block differs from what the results give")
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    block, fresh = current_block(text), render(args.results)
    if block is None:
        print(f"{args.readme}: no {BEGIN} ... {END} block", file=sys.stderr)
        return 2
    if args.check:
        if block != fresh:
            print(f"{args.readme}: results table is stale; run python benchmarks/summary.py",
                  file=sys.stderr)
            return 1
        return 0
    if block != fresh:
        args.readme.write_text(text.replace(block, fresh))
        print(f"rewrote the results table in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
