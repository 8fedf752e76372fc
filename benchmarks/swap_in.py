"""Swap-in analysis: which target layers' translated objects lose the needle.

The target continues from its own cache with some layers replaced by the translated ones (each
layer alone, and all but each layer), and exact needle recall on held-out needles is measured
at the fitting length, with the answer-digit loss beside it. Writes
benchmarks/results/swap_in.{json,md}.

    python benchmarks/swap_in.py [--translator DIR] [--length 256] [--samples 30]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS
import mlx.core as mx

from mlx_kvtrans.translators import artifact
from mlx_kvtrans.translators.token_identity import codebook_of
from mlx_kvtrans.translators.translator import translate_cache
from mlx_kvtrans.zoo.evaluate import needle_scores

OUT = Path(__file__).resolve().parent / "results"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--translator", type=Path,
                        default=artifact.shipped("kimi-linear", "kimi-vl"))
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    manifest = artifact.read_manifest(args.translator)
    src, tgt = kv.load(manifest["source"]["name"]), kv.load(manifest["target"]["name"])
    translator = artifact.load(args.translator, src, tgt)
    codebook = codebook_of(src) if translator.token_identity == "codebook" else None
    layers = range(len(kv.layout_of(tgt.model).layers))

    def mixed(translated: set[int]):
        def cache_for(ids):
            native = kv.capture(tgt.model, mx.array(ids)[None], points=(3,)).engine
            moved = translate_cache(translator, src.model, tgt.model, ids, codebook)
            return [moved[i] if i in translated else native[i] for i in layers]
        return cache_for

    cases = [("native", set()), ("all translated", set(layers))]
    cases += [(f"only layer {i} translated", {i}) for i in layers]
    cases += [(f"all but layer {i} translated", set(layers) - {i}) for i in layers]
    rows = []
    for name, translated in cases:
        recall, nll = needle_scores(tgt.model, tgt.tokenizer.encode, args.length, args.samples,
                                    cache_for=mixed(translated))
        rows.append({"case": name, "translated_layers": sorted(translated), "recall": recall,
                     "digit_nll": round(nll, 3)})
        print(f"{name:32s} recall {recall:.2f}  answer-digit loss {nll:.2f}", flush=True)
    result = {"translator": args.translator.name, "length": args.length,
              "samples": args.samples, "rows": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "swap_in.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Swap-in analysis\n",
             f"Translator {args.translator.name}: the target continues from its own cache with "
             f"the named layers translated; exact recall on {args.samples} held-out needles of "
             f"{args.length} tokens, answer-digit loss in nats (chance 2.30). Regenerate with "
             "`python benchmarks/swap_in.py`.\n",
             "| case | recall | answer-digit loss |", "|---|---|---|"]
    lines += [f"| {r['case']} | {r['recall']:.2f} | {r['digit_nll']:.2f} |" for r in rows]
    (OUT / "swap_in.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
