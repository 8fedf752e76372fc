"""Answer behaviour of every shipped translator: how its target's answers change when it
continues from translated caches instead of reading the prompt itself.

Held-out dialogues, needles and prose windows; per metric the native and translated means, the
translated-minus-native difference with its 95% paired bootstrap interval, flagged where the
interval excludes zero. Writes research/results/behaviour.{json,md}; `--translators` measures
only those and keeps the other translators' rows.

    python research/behaviour.py [--prompts N] [--max-tokens N] [--length N] [--translators a,b]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS

from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.evaluation.behaviour import compare, generate_pairs, held_out_prompts
from mlx_kvtrans.models import held_out_split
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.translators.translator import translate_cache

OUT = Path(__file__).resolve().parent / "results"


def measure(name: str, models: dict, prompts: int, max_tokens: int, length: int) -> dict:
    manifest = artifact.read_manifest(name)
    source, target = manifest["source"]["name"], manifest["target"]["name"]
    for alias in (source, target):
        models.setdefault(alias, kv.load(alias))
    src, tgt = models[source], models[target]
    translator = artifact.load(name, src, tgt).prepare()  # a codebook is not part of the timing
    ids = tgt.tokenizer.encode(held_out_split("test").read_text())
    held_out = held_out_prompts(tgt.tokenizer, prompts, length, ids)
    start = time.perf_counter()
    pairs = generate_pairs(tgt.model, tgt.tokenizer, held_out,
                           lambda prefix: translate_cache(translator, src.model, tgt.model, prefix),
                           max_tokens)
    first_of_kind = {p.prompt.kind: p for p in reversed(pairs)}
    return {"source": source, "target": target, "stage": manifest.get("stage", 1),
            "minutes": round((time.perf_counter() - start) / 60, 2),
            "rows": compare(pairs),
            "examples": {kind: {"native": p.native.text, "translated": p.translated.text}
                         for kind, p in sorted(first_of_kind.items())}}


def _cell(row: dict, key: str, signed: bool = True) -> str:
    if row[key] is None:
        return "-"
    digits = 1 if row["metric"] == "answer_tokens" else 3
    return f"{row[key]:{'+' if signed else ''}.{digits}f}"


def write_markdown(results: dict, settings: dict, blas: str):
    lines = ["# Answer behaviour\n",
             "The target answers held-out prompts greedily twice: reading the prompt itself "
             "(native) and continuing from the shipped translator's cache of it (translated). "
             f"{settings['prompts']} prompts of each kind (chat-template dialogues of "
             f"{settings['dialogue_turns']} turns, needles and prose windows of "
             f"{settings['length']} tokens from the test split); an answer ends at the "
             f"end-of-turn token, a line break or {settings['max_tokens']} tokens. Differences "
             "are translated minus native with 95% paired bootstrap intervals (2,000 resamples "
             "within each prompt kind, seed 0); **flagged** where the interval excludes zero. "
             "First-token agreement is 1 for native by definition. Regenerate with "
             "`python research/behaviour.py` (about 8 minutes on 2 CPU cores).\n",
             f"BLAS: {blas}\n",
             "## Flagged differences\n",
             "| translator | flagged (difference [95% interval]) |", "|---|---|"]
    for name, r in results.items():
        flagged = [f"{row['label']} {_cell(row, 'difference')} "
                   f"[{_cell(row, 'ci_low')}, {_cell(row, 'ci_high')}]"
                   for row in r["rows"] if row["flagged"]]
        lines.append(f"| {name} | {'; '.join(flagged) or 'none'} |")
    lines.append("")
    for name, r in results.items():
        lines += [f"## {name}\n", f"{r['source']} -> {r['target']}, stage {r['stage']}; "
                  f"{r['minutes']} min.\n",
                  "| metric | prompts | native | translated | difference | 95% interval | "
                  "flagged |", "|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            lines.append(f"| {row['label']} | {row['prompts']} | {_cell(row, 'native', False)} | "
                         f"{_cell(row, 'translated', False)} | {_cell(row, 'difference')} | "
                         f"[{_cell(row, 'ci_low')}, {_cell(row, 'ci_high')}] | "
                         f"{'**yes**' if row['flagged'] else ''} |")
        lines.append("\nFirst answer of each kind (native / translated):\n")
        for kind, pair in r["examples"].items():
            lines.append(f"- {kind}: `{pair['native']!r}` / `{pair['translated']!r}`")
        lines.append("")
    (OUT / "behaviour.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main():
    from mlx_kvtrans.evaluation.behaviour import DIALOGUE_TURNS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=40, help="per kind")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--length", type=int, default=256, help="needle and prose tokens")
    parser.add_argument("--translators", help="a,b (default: every shipped translator)")
    args = parser.parse_args()
    names = args.translators.split(",") if args.translators else artifact.shipped_names()
    settings = {"prompts": args.prompts, "max_tokens": args.max_tokens, "length": args.length,
                "dialogue_turns": DIALOGUE_TURNS}
    models, measured = {}, {}
    for name in names:
        measured[name] = measure(name, models, args.prompts, args.max_tokens, args.length)
        print(f"{name}: {measured[name]['minutes']} min, flagged "
              f"{[r['metric'] for r in measured[name]['rows'] if r['flagged']]}", flush=True)
    results_file = OUT / "behaviour.json"  # read as it is now: other runs may have added to it
    previous = json.loads(results_file.read_text()) if results_file.exists() else {}
    results = previous.get("translators", {}) if previous.get("settings") == settings else {}
    shipped = set(artifact.shipped_names())  # rows of translators no longer shipped go
    results = {k: v for k, v in results.items() if k in shipped}
    results.update(measured)
    blas = str(blas_report())
    OUT.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps({"blas": blas, "settings": settings,
                                        "translators": dict(sorted(results.items()))},
                                       indent=2) + "\n")
    write_markdown(dict(sorted(results.items())), settings, blas)


if __name__ == "__main__":
    main()
