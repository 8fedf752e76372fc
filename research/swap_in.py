"""Swap-in analysis: which target layers and objects, translated, lose the needle.

The target continues from its own cache with some objects replaced by the translated ones (all
of them, each layer alone, each object alone: `kvtrans eval ablate --translator`'s cases), and
exact needle recall on held-out needles is measured at the fitting length, with the answer-digit
loss beside it.

Then a linear ceiling for the layer that loses the most: that layer's per-token objects fitted
in closed form from the target's OWN layer below it plus the token's embedding (and the two
tokens before it), on corpus windows and training needles, swapped in alone. If even this map
loses the needle, no token-wise linear map from a source can keep it at that layer.
Writes research/results/swap_in.{json,md}.

    python research/swap_in.py [--translator DIR] [--length 256] [--samples 30]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS
import mlx.core as mx

from mlx_kvtrans.evaluation.ablate import Ablation, Case, cases
from mlx_kvtrans.evaluation.needles import needle_rows, needle_scores
from mlx_kvtrans.layouts import ObjectKind
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.models import input_embedding
from mlx_kvtrans.translators.features import layer_features
from mlx_kvtrans.training.fit import token_windows
from mlx_kvtrans.translators.recipes import per_token_rows
from mlx_kvtrans.translators.stats import Moments, solve
from mlx_kvtrans.zoo.data import needle_filler

OUT = Path(__file__).resolve().parent / "results"
CORPUS = Path("runs/corpus")


def swap_rows(translator, src, tgt, length, samples):
    """`kvtrans eval ablate`'s translated cases (everything, each layer, each object), read by
    needle recall and answer-digit loss."""
    ablation = Ablation(tgt.model, translator, src.model)
    rows = []
    for case in [Case("native")] + [c for c in cases(ablation.layout, True)
                                    if c.name == "translated" and c.above is None]:
        recall, nll = needle_scores(tgt.model, tgt.tokenizer.encode, length, samples,
                                    cache_for=lambda ids, c=case: ablation.cache(c, mx.array(ids)))
        layer = ablation.layout.layers[case.layer] if case.layer is not None else None
        whole_layer = layer and all(case.covers(layer, o.name) for o in layer.objects)
        layer_alone = case.layer if whole_layer else None
        rows.append({"case": case.label, "layer_alone": layer_alone,
                     "recall": recall, "digit_nll": round(nll, 3)})
        print(f"{case.label:40s} recall {recall:.2f}  answer-digit loss {nll:.2f}", flush=True)
    return rows


def linear_ceiling(tgt, layer: int, length: int, samples: int, windows: int = 256):
    """Recall with `layer`'s per-token objects predicted linearly from the target's own layer
    below (at (1)) and the embeddings of tokens t, t-1, t-2, fitted on corpus + needles."""
    layout = kv.layout_of(tgt.model)
    embed = input_embedding(tgt.model)
    objects = [o.name for o in layout.layers[layer].objects
               if o.per_token and o.kind != ObjectKind.CONV_HISTORY]

    def inputs(tokens, captured):
        e = embed(tokens).astype(mx.float32)
        shifted = [mx.concatenate([mx.zeros_like(e[:, :k]), e[:, :-k]], axis=1) for k in (1, 2)]
        return mx.concatenate([layer_features(captured, layer - 1, 1), e, *shifted], axis=-1)

    ids = tgt.tokenizer.encode((CORPUS / "train.txt").read_text()[:3_000_000])
    needles = needle_rows(tgt.tokenizer.encode, needle_filler(CORPUS), length, count=windows)
    batches = list(token_windows(ids, length, windows, batch=8))
    batches += [mx.array([r[-length:] for r in needles[i:i + 8]]) for i in range(0, windows, 8)]
    moments = {}
    for tokens in batches:
        captured = kv.capture(tgt.model, tokens, points=(1,))
        x = inputs(tokens, captured)
        for name in objects:
            y = per_token_rows(captured.objects[layer][(name, 1)])
            moments.setdefault(name, Moments(x.shape[-1], y.shape[-1])).add(x, y)
    fits = {name: solve(m, ridge=1e-3) for name, m in moments.items()}

    def cache_for(prompt):
        tokens = mx.array(prompt)[None]
        captured = kv.capture(tgt.model, tokens, points=(1,))
        layers = [dict(d) for d in captured.at(1)]
        x = inputs(tokens, captured)
        for name, fit in fits.items():
            shape = layers[layer][name].shape
            layers[layer][name] = (x @ mx.array(fit.weight).T + mx.array(fit.bias)).reshape(shape)
        return kv.install(layout, layers, 1)

    recall, nll = needle_scores(tgt.model, tgt.tokenizer.encode, length, samples,
                                cache_for=cache_for)
    r2 = {name: round(fit.mean_r2, 3) for name, fit in fits.items()}
    print(f"linear ceiling at layer {layer}: R^2 {r2} recall {recall:.2f} "
          f"answer-digit loss {nll:.2f}", flush=True)
    return {"layer": layer, "r2": r2, "recall": recall, "digit_nll": round(nll, 3)}


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
    rows = swap_rows(translator, src, tgt, args.length, args.samples)
    alone = [r for r in rows if r["layer_alone"] is not None]
    worst = max(alone, key=lambda r: r["digit_nll"])["layer_alone"]
    ceiling = linear_ceiling(tgt, worst, args.length, args.samples) if worst > 0 else None
    result = {"translator": args.translator.name, "length": args.length,
              "samples": args.samples, "rows": rows, "linear_ceiling": ceiling}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "swap_in.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Swap-in analysis\n",
             f"Translator {args.translator.name}: the target continues from its own cache with "
             f"the named layers or objects translated; exact recall on {args.samples} held-out "
             f"needles of {args.length} tokens, answer-digit loss in nats (chance 2.30). "
             "Regenerate with `python research/swap_in.py`.\n",
             "| case | recall | answer-digit loss |", "|---|---|---|"]
    lines += [f"| {r['case']} | {r['recall']:.2f} | {r['digit_nll']:.2f} |" for r in rows]
    if ceiling:
        lines += ["", f"## Linear ceiling at layer {worst}\n",
                  f"Layer {worst}'s per-token objects predicted in closed form from the "
                  f"target's own layer {worst - 1} objects at (1) and the embeddings of tokens t, "
                  "t-1 and t-2 (fitted on 256 corpus windows and 256 training needles), swapped "
                  "in alone: the best any token-wise linear map could do from features this "
                  "close to the target.\n",
                  "| R^2 per object | recall | answer-digit loss |", "|---|---|---|",
                  f"| {', '.join(f'{k} {v:.3f}' for k, v in ceiling['r2'].items())} | "
                  f"{ceiling['recall']:.2f} | {ceiling['digit_nll']:.2f} |"]
    (OUT / "swap_in.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
