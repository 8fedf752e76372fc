"""README's results table, rendered from the results files so that it cannot go stale.

One row per shipped translator direction, read from what the benchmarks wrote:
`translators.json` (`python benchmarks/translators.py`: held-out KL and exact needle recall),
`behaviour.json` (`python benchmarks/behaviour.py`: first-token agreement with native answers)
`bench-SOURCE__TARGET-float32.json` (`python benchmarks/switch.py`: the warm switch's time to
first token against the target re-reading the history) and `frontier.json`
(`python benchmarks/frontier.py`: the default re-read setting and what it keeps).

    python benchmarks/summary.py           # rewrite README's block between the markers
    python benchmarks/summary.py --check   # exit 1 if README's block is not what the files give

The shipped variant of a pair is the one `benchmarks/translators.py` ships: the pair's first
variant, distilled (stage 2) where distillation lowered its held-out KL, as fitted otherwise.
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
LENGTH = 256  # the translators' fitting length: where KL and recall are read
LONG = 1024  # 4x it
SWITCH_LENGTHS = (1024, 2048)
FRONTIER_LENGTHS = (256, 512)


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def shipped_variant(pair: dict) -> dict:
    """The variant `benchmarks/translators.py` ships for `pair`."""
    first = [v for v in pair["variants"] if v["variant"] == pair["variants"][0]["variant"]]
    stage_2 = [v for v in first if v.get("stage") == 2]
    if stage_2:
        before = stage_2[0].get("validation_kl_before", float("-inf"))
        if stage_2[0].get("validation_kl_after", float("inf")) < before:
            return stage_2[0]
    return first[0]


def _fidelity(variant: dict, length: int) -> dict:
    return next((f for f in variant.get("fidelity", []) if f["prefix_length"] == length), {})


def _recall(pair: dict, variant: dict, length: int) -> str:
    translated = variant.get("needle_translated", {}).get(str(length))
    native = pair.get("needle_native", {}).get(str(length))
    if translated is None:
        return "-"
    return f"{translated:.2f}" + (f" ({native:.2f})" if native is not None else "")


def _first_token(behaviour: dict, name: str) -> str:
    rows = behaviour.get("translators", {}).get(name, {}).get("rows", [])
    row = next((r for r in rows if r["metric"] == "first_token_agreement"), None)
    return "-" if row is None else f"{row['translated']:.2f}"


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


def _frontier(frontier: dict, name: str) -> tuple[str, str, str]:
    """(default R, history recovered @256 / @512, applied @256 / @512) at the default R."""
    entry = frontier.get("translators", {}).get(name)
    if not entry or "default" not in entry:
        return "-", "-", "-"
    reread = entry["default"]["reread"]
    rows = {r["length"]: r for r in entry["rows"] if r["setting"]["reread"] == reread}
    pick = [rows.get(n) for n in FRONTIER_LENGTHS]

    def cells(key):
        return " / ".join("-" if r is None or r.get(key) is None else f"{r[key]:.2f}"
                          for r in pick)
    return str(reread), cells("history_recovered"), cells("applied")


def render(results: Path = RESULTS) -> str:
    """The markdown block (markers included) that README holds."""
    translators = _load(results / "translators.json")
    behaviour = _load(results / "behaviour.json")
    frontier = _load(results / "frontier.json")
    lengths = " / ".join(f"{n // 1024}K" for n in SWITCH_LENGTHS)
    at = " / ".join(str(n) for n in FRONTIER_LENGTHS)
    lines = [BEGIN,
             f"| translator (shipped) | stage | KL @{LENGTH} (no cache) | recall @{LENGTH} "
             f"(native) | recall @{LONG} (native) | first-token agreement | switch speed-up "
             f"@{lengths} | default R | history recovered @{at} | applied @{at} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for pair in translators.get("pairs", []):
        source, target = pair["source"], pair["target"]
        variant = shipped_variant(pair)
        stage = variant.get("stage", 1)
        name = f"{source}__{target}" + ("-distilled" if stage == 2 else "")
        fid = _fidelity(variant, LENGTH)
        kl = f"{fid['kl']:.4f} ({fid['kl_no_cache']:.2f})" if fid else "-"
        lines.append(f"| `{name}` | {stage} | {kl} | {_recall(pair, variant, LENGTH)} | "
                     f"{_recall(pair, variant, LONG)} | {_first_token(behaviour, name)} | "
                     f"{_switch(results, source, target)} | "
                     + " | ".join(_frontier(frontier, name)) + " |")
    lines += ["",
              f"KL: nats/token on held-out continuations after {LENGTH} tokens, the target "
              "reading the translated cache against its own (the no-cache floor in brackets). "
              "Recall: exact six-digit needles through the translated cache (native in "
              "brackets). First-token agreement: held-out prompts answered from the translated "
              "cache against native answers. Switch: time to first token re-reading the "
              "history over that of a warm switch (translate, install, first decode), float32, "
              "on the machine and BLAS each file records (- where a direction is not timed). "
              "Default R: the tokens a session's target re-reads itself at a switch by default "
              "(docs/fidelity.md); history recovered: the share of what the history is worth "
              "to the target's next tokens that the switch keeps, above the last-16-tokens "
              "floor; applied: the share of switches the fidelity gate let stand. "
              "Rendered by `python benchmarks/summary.py` from "
              "`benchmarks/results/translators.json`, `behaviour.json`, `frontier.json` and "
              "`bench-*-float32.json`; [docs/results.md](docs/results.md) names the command "
              "that writes each.",
              END]
    return "\n".join(lines)


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
