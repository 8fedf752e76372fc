"""Multi-turn accuracy of the shipped pairs: held-out dialogues that alternate models every turn.

For each pair, the same dialogues run under segment-wise, naive and refresh switching (shipped
translators both ways, distilled ones first) and under re-reading (no translators), so the
per-turn answer accuracies sit side by side. Writes research/results/multiturn.{json,md};
`--pairs` measures only those and keeps the other pairs' rows.

    python research/multiturn.py [--dialogues N] [--turns N] [--pairs a:b,c:d]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS

from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.evaluation.multiturn import evaluate
from mlx_kvtrans.translators import artifact

OUT = Path(__file__).resolve().parent / "results"
PAIRS = [("kimi-linear", "kimi-vl"), ("qwen3.5-a", "qwen3.5-b"), ("qwen3-small", "qwen3-large")]


def measure(source: str, target: str, dialogues: int, turns: int) -> dict | None:
    forward, back = artifact.shipped(source, target), artifact.shipped(target, source)
    if forward is None:
        print(f"{source} -> {target}: no shipped translator, skipped")
        return None
    src, tgt = kv.load(source), kv.load(target)
    translators = {(source, target): artifact.load(forward, src, tgt)}
    if back is not None:
        translators[(target, source)] = artifact.load(back, tgt, src)
    start = time.perf_counter()
    table = evaluate({source: src, target: tgt}, translators, dialogues, turns)
    return {"models": [source, target], "forward": forward.name,
            "back": back.name if back else "re-reading", "dialogues": dialogues, "turns": turns,
            "minutes": round((time.perf_counter() - start) / 60, 1), "accuracy": table}


def write_markdown(results: dict, blas: str):
    lines = ["# Multi-turn accuracy\n",
             "Held-out dialogues (seeds never used in training) that state numbers in early user "
             "turns and ask for them later; the models alternate at every turn, starting with the "
             "first. A question turn is right when the reply contains the asked number. Same "
             "dialogues for every strategy; `re-reading` re-reads the whole history on each switch "
             "(the reference); `segment, no gate` is what the translators alone give, and `gate "
             "fired` the share of translated switches the fidelity gate sent back to re-reading. "
             "Regenerate with `python research/multiturn.py`.\n",
             f"BLAS: {blas}\n"]
    for key, r in results.items():
        table = r["accuracy"]
        turn_keys = sorted({k for row in table.values() for k in row if k.isdigit()}, key=int)
        asked = next(iter(table.values())).get("questions", "?")
        lines += [f"## {key}\n",
                  f"Translators: {r['forward']} and back {r['back']}; {r['dialogues']} dialogues "
                  f"of {r['turns']} turns, {asked} questions asked; {r['minutes']} min.\n",
                  "| strategy | " + " | ".join(f"turn {int(k) + 1}" for k in turn_keys)
                  + " | all | gate fired |",
                  "|---" * (len(turn_keys) + 3) + "|"]
        for strategy, row in table.items():
            cells = [f"{row[k]:.2f}" if k in row else "-" for k in turn_keys]
            fired = "-" if row.get("gate_fired") is None else f"{row['gate_fired']:.2f}"
            lines.append(f"| {strategy} | " + " | ".join(cells)
                         + f" | {row['all']:.2f} | {fired} |")
        lines.append("")
    (OUT / "multiturn.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dialogues", type=int, default=20)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--pairs", help="a:b,c:d (default: all shipped pairs)")
    args = parser.parse_args()
    pairs = ([tuple(p.split(":")) for p in args.pairs.split(",")] if args.pairs else PAIRS)
    measured = {}
    for source, target in pairs:
        r = measure(source, target, args.dialogues, args.turns)
        if r is not None:
            measured[f"{source} <-> {target}"] = r
    results_file = OUT / "multiturn.json"  # read as it is now: other runs may have added to it
    results = json.loads(results_file.read_text())["pairs"] if results_file.exists() else {}
    results.update(measured)
    blas = str(blas_report())
    OUT.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps({"blas": blas, "pairs": results}, indent=2) + "\n")
    write_markdown(results, blas)


if __name__ == "__main__":
    main()
