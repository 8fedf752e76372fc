"""The zoo's native figures, gathered from the manifests the training command wrote.

Every figure here was measured by `kvtrans zoo train` / `kvtrans zoo ship` when it wrote
weights/ALIAS/manifest.json; this script only tabulates them into research/results/zoo.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_kvtrans.models import weights_dir, zoo_aliases
from mlx_kvtrans.zoo.curricula import recorded_curriculum

OUT = Path(__file__).parent / "results" / "zoo.md"


def main():
    lines = ["# The zoo: native figures\n",
             "Held-out perplexity on the validation split beside the unigram baseline of the train "
             "split; exact six-digit needle recall on held-out needles at 256, 512, 1,024 and "
             "2,048 tokens (the translators' fitting length and 2x-8x it; `rows` is the longest "
             "training row). For the hybrids, what zeroing every recurrent state "
             "costs at 1,024 held-out tokens: its KL as a share of the no-cache floor's, and "
             "needle recall native -> zeroed (the zoo's bar: a share >= 0.30 or a drop >= 0.3). "
             "`bar`: recall >= 0.9 at 256 and 512 (and a hybrid's states bar); `corpus`: the "
             "train split it read, the recorded one (`weights/corpus.json`) or the corpus's "
             "first build, which no longer rebuilds, and the one the models it continues read "
             "where that differs: a first-build seed may have trained on documents of the "
             "recorded held-out splits. "
             "Tabulated from weights/*/manifest.json by `python research/zoo.py`.\n",
             "| alias | model_type | params | steps | rows | tokens | minutes | ppl | unigram ppl "
             "| recall @256 | @512 | @1024 | @2048 | zeroed states: KL share | recall | bar "
             "| corpus |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    recorded = json.loads((weights_dir() / "corpus.json").read_text())["splits"]["train"]["sha256"]
    for alias, path in zoo_aliases().items():
        manifest_file = path / "manifest.json"
        if not manifest_file.exists():
            continue
        m = json.loads(manifest_file.read_text())
        recall = [f"{v:.2f}" for v in m["needle_recall"].values()]
        curriculum = recorded_curriculum(m)
        steps = f"{curriculum['steps']:,}" + (f" (from {curriculum['init_from']})"
                                              if curriculum.get("init_from") else "")
        lines.append(f"| {alias} | {m['model_type']} | {m['parameters'] / 1e6:.2f}M | "
                     f"{steps} | {m['longest_training_prompt']:,} | {m['tokens_seen']:,} | "
                     f"{m['training_minutes']} | "
                     f"{m['held_out_perplexity']} | {m['unigram_perplexity']} | "
                     + " | ".join(recall) + " | " + _states(m.get("state_ablation")) + " | "
                     + ("yes" if meets_bar(m) else "no") + " | "
                     + _corpora(m, recorded) + " |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _corpora(manifest: dict, recorded: str) -> str:
    """The train split a model read, and the one the models it continues read where that
    differs (a seed whose weights no longer ship keeps its manifest for this)."""
    def name(m):
        return "recorded" if m["corpus"] == recorded else "first build"

    own, earlier = name(manifest), set()
    while parent := recorded_curriculum(manifest).get("init_from"):
        manifest = json.loads((weights_dir() / parent / "manifest.json").read_text())
        earlier.add(name(manifest))
    return own + (f" (its seeds: {', '.join(sorted(earlier - {own}))})"
                  if earlier - {own} else "")


def meets_bar(manifest: dict) -> bool:
    recall = manifest["needle_recall"]
    states = manifest.get("state_ablation")
    return (recall["256"] >= 0.9 and recall["512"] >= 0.9
            and (states is None or states["meets_bar"]))


def _states(ablation: dict | None) -> str:
    if not ablation:
        return "- | -"
    return (f"{ablation['kl_share']:.2f} ({ablation['kl_zero_states']:.4f} of "
            f"{ablation['kl_no_cache']:.4f}) | {ablation['recall_native']:.2f} -> "
            f"{ablation['recall_zero_states']:.2f}")


if __name__ == "__main__":
    main()
