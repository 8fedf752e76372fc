"""Translation across tokenizers: qwen3.5-a (the zoo's tokenizer) and qwen3.5-xt (the same
geometry trained on another tokenizer of the same corpus), in both directions.

Each direction is fitted in closed form (stage 1, through `workflows.fit_translator`, what
`kvtrans fit` runs) on windows of the train split, each model reading its own tokens of the
window's text, for each variant: a way of pooling a group's source tokens onto its target tokens
(mean, first, last; `mlx_kvtrans.translators.cross_tokenizer`), "+needles", "+tables",
"+layers" and "+width32" for the fits that keep recall elsewhere, and "shipped": the translator
that ships for the direction, as it is. Then, on held-out prose of the test split, at 256 and
512 target tokens: KL of the target's continuation from the translated cache against its
continuation from its own, beside the no-cache floor; teacher-forced agreement with native's
next-token argmax beside the last-16-tokens floor (the history's worth recovered); exact recall
of held-out needles, native and translated; and the switch's time (the source having read the
prompt) beside the target's own prefill. The group statistics of the two tokenizations sit
above. Translators go to runs/cross_tokenizer/; figures to
research/results/cross_tokenizer.{json,md}. `--split validation` measures on the validation
split and other needles, for choosing what ships, into runs/cross_tokenizer/validation.json.

    python research/cross_tokenizer.py [--windows 256] [--variants shipped,mean,mean+needles]
                                         [--prompts 16] [--needles 16] [--split validation]
                                         [--pair qwen3.5-a,qwen3.5-xt] [--one-way]
    python research/cross_tokenizer.py --tabulate
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlx_kvtrans.translators.alignment import align, char_spans
from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.layouts import layout_of
from mlx_kvtrans.evaluation.needles import HELD_OUT_SEED, NeedleConfig, needle_report
from mlx_kvtrans.models import held_out_split
from mlx_kvtrans.translators.sharding import capture_whole
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.translators.cross_tokenizer import (aligned_text, translate_captured,
                                                     translate_text)
from mlx_kvtrans.translators.fidelity import kl_per_token
from mlx_kvtrans.training.fit import FitConfig
from mlx_kvtrans.training.workflows import fit_translator

OUT = Path(__file__).resolve().parent / "results"
PAIR = ("qwen3.5-a", "qwen3.5-xt")
LENGTHS = (256, 512)
CONTINUATION = 32
FLOOR_TOKENS = 16
# per-token features of the two source layers nearest each target layer's depth, linear
# attention's included, and the target's token ids; recurrent states replayed over the target's
# own tokens (`across_tokenizers`)
CONFIG = FitConfig(point=1, nu=2, features="all", token_identity="ids")
# "+needles": half the windows are needles, every prefix token weighted by the attention of
# the answer's positions (as the shipped translators that keep recall were fitted)
NEEDLE_SHARE = 0.5
NEEDLE_FIT = dict(attention_weighted=8)
TABLES = dict(identity_tables=32)  # "+tables": rank-32 tables of the target's ids at t, t-1
# "+layers": every source layer's features, not the 2 nearest a target layer's depth
RUNS = Path("runs/cross_tokenizer")  # the fitted translators
VALIDATION_NEEDLES = HELD_OUT_SEED + 1_000_000  # needles for choosing, apart from the test's


def group_statistics(source_tok, target_tok, text: str) -> dict:
    s_ids, s_spans = char_spans(source_tok, text)
    t_ids, t_spans = char_spans(target_tok, text)
    alignment = align(s_spans, t_spans)
    sizes_s, sizes_t = np.diff(alignment.source_starts), np.diff(alignment.target_starts)
    return {"source_tokens": len(s_ids), "target_tokens": len(t_ids),
            "groups": alignment.groups, "one_to_one": round(alignment.one_to_one(), 4),
            "largest_group": [int(sizes_s.max()), int(sizes_t.max())]}


def prose_windows(target_tok, text: str, length: int, count: int, seed: int):
    """(window text, its target ids) of `count` windows of `length` + CONTINUATION target
    tokens."""
    ids, target_spans = char_spans(target_tok, text)
    rng = random.Random(seed + length)
    out = []
    for _ in range(count):
        s = rng.randrange(0, len(ids) - length - CONTINUATION)
        start, end = target_spans[s][0], target_spans[s + length + CONTINUATION - 1][1]
        window = text[start:end]
        out.append((window, char_spans(target_tok, window)[0]))
    return out


def prose_scores(translator, src, tgt, windows, length: int, how: str) -> dict:
    kls, floors, agree, agree_floor, seconds, prefill = [], [], [], [], [], []
    for window, ids in windows:
        text = aligned_text(src.tokenizer, tgt.tokenizer, window, how, target_tokens=length)
        follow = mx.array([ids[length:length + CONTINUATION]])
        native_cache = make_prompt_cache(tgt.model)
        started = time.perf_counter()
        mx.eval(tgt.model(text.target, cache=native_cache))
        prefill.append(time.perf_counter() - started)
        native = tgt.model(follow, cache=native_cache)
        source = capture_whole(src.model, text.source, translator.source_points())
        mx.eval(source.objects)
        started = time.perf_counter()  # the switch, once the source has read the prompt
        cache = translate_captured(translator, source, tgt.model, text)
        mx.eval([c.state for c in cache])
        seconds.append(time.perf_counter() - started)
        moved = tgt.model(follow, cache=cache)
        bare = tgt.model(follow)
        tail = tgt.model(mx.concatenate([text.target[:, -FLOOR_TOKENS:], follow],
                                        axis=1))[:, FLOOR_TOKENS:]
        kls.append(float(kl_per_token(native, moved).mean()))
        floors.append(float(kl_per_token(native, bare).mean()))
        best = mx.argmax(native, axis=-1)
        agree.append(float((mx.argmax(moved, axis=-1) == best).mean()))
        agree_floor.append(float((mx.argmax(tail, axis=-1) == best).mean()))
    a, f = statistics.mean(agree), statistics.mean(agree_floor)
    return {"kl": statistics.mean(kls), "kl_floor": statistics.mean(floors),
            "agreement": a, "agreement_last16": f,
            "recovered": (a - f) / (1 - f) if f < 1 else 1.0,
            "translate_s": statistics.median(seconds), "prefill_s": statistics.median(prefill)}


def needle_recall(translator, src, tgt, length: int, count: int, how: str,
                  seed: int = HELD_OUT_SEED) -> tuple[float, float]:
    """(native, translated) exact recall of held-out needles of `length` target tokens: the
    translated cache of a needle's prompt is built from its text, which both models read."""
    texts = {}  # a prompt's target ids but its last -> its text

    def encode(text):
        ids = tgt.tokenizer.encode(text, add_special_tokens=False)
        texts[tuple(ids[:-1])] = text
        return ids

    def translated(prefix: list[int]):
        text = aligned_text(src.tokenizer, tgt.tokenizer, texts[tuple(prefix)], how,
                            target_tokens=len(prefix))
        return translate_text(translator, src.model, tgt.model, text)

    draw = NeedleConfig(count, seed=seed)
    native = needle_report(tgt.model, encode, length, draw)["recall"]
    return native, needle_report(tgt.model, encode, length, draw, cache_for=translated)["recall"]


def measure_direction(source: str, target: str, args, train_file: Path, test_text: str
                      ) -> dict:
    src, tgt = kv.load(source), kv.load(target)
    source, target = Path(source).name, Path(target).name
    row = {"source": source, "target": target,
           "groups": group_statistics(src.tokenizer, tgt.tokenizer, test_text[:200_000]),
           "variants": {}}
    for variant in args.variants:
        if variant == "shipped":  # the translator that ships for this direction, as it is
            translator = artifact.load(artifact.shipped(source, target), src, tgt)
            how = translator.info["alignment"]["pooling"]
            result = {"fit_s": translator.info["fit"]["seconds"],
                      "fit_tokens": translator.info["fit"]["tokens"],
                      "bytes": sum(v.nbytes for v in translator.params.values()), "lengths": {}}
            row["variants"][variant] = measure_lengths(translator, src, tgt, args, test_text,
                                                       how, variant, result)
            continue
        how, *more = variant.split("+")
        share = next((int(m[7:]) / 100 if m[7:] else NEEDLE_SHARE
                      for m in more if m.startswith("needles")), 0.0)
        needles = share > 0
        started = time.perf_counter()
        width = next((int(m[5:]) for m in more if m.startswith("width")), 0)
        config = replace(CONFIG, pooling=how, windows=args.windows, length=args.length,
                         width=width, **(NEEDLE_FIT if needles else {}),
                         **(TABLES if "tables" in more else {}),
                         **({"nu": len(layout_of(src.model).layers)} if "layers" in more else {}))
        translator = fit_translator(src, tgt, [train_file], replace(config, needle_share=share),
                                    out=RUNS / f"{source}__{target}-{variant}"
                                    f"{'' if args.windows == 256 else f'-{args.windows}'}")
        size = sum(v.nbytes for v in translator.params.values())
        result = {"fit_s": round(time.perf_counter() - started, 1),
                  "fit_tokens": translator.info["fit"]["tokens"], "bytes": size, "lengths": {}}
        row["variants"][variant] = measure_lengths(translator, src, tgt, args, test_text, how,
                                                   variant, result)
    return row


def measure_lengths(translator, src, tgt, args, test_text: str, how: str, variant: str,
                    result: dict) -> dict:
    """`result` with the translator's prose scores and needle recall at each length."""
    source, target = Path(src.name).name, Path(tgt.name).name
    for length in LENGTHS:
        windows = prose_windows(tgt.tokenizer, test_text, length, args.prompts, 0)
        scores = prose_scores(translator, src, tgt, windows, length, how)
        scores["recall_native"], scores["recall_translated"] = needle_recall(
            translator, src, tgt, length, args.needles, how,
            HELD_OUT_SEED if args.split == "test" else VALIDATION_NEEDLES
        ) if args.needles else (None, None)
        result["lengths"][str(length)] = scores
        print(f"{source} -> {target} ({variant}) {length}: KL {scores['kl']:.4f} (floor "
              f"{scores['kl_floor']:.4f}), recovered {scores['recovered']:.2f}, recall "
              f"{scores['recall_native']} / {scores['recall_translated']}", flush=True)
    return result


def write_markdown(results: dict) -> None:
    source, target = (Path(name).name for name in results["pair"])
    lines = ["# Translation across tokenizers\n",
             f"{source} reads the zoo's tokenizer, {target} another one trained on the same "
             "corpus with fewer entries (fewer of nearly the same merges): some of the same text "
             "splits into more tokens. Each "
             "direction is fitted in closed form (stage 1, no distillation; "
             "`kvtrans fit`'s path) on "
             f"{results['windows']} windows of {results['length']} target tokens of the train "
             "split, each model reading its own tokens, each target token reading its group's "
             "source tokens pooled (**fit**: mean, first or last; +needles: half the windows "
             "needles, the prefix weighted by the attention the answer pays it; +tables: rank-32 "
             "tables of the target's ids at t and t-1 added to every map; +layers: every map "
             "reads every source layer, not the two nearest its depth; +width32: the source's "
             "linear-attention rows compressed to 32 principal directions; **shipped**: the "
             "translator that ships for the direction, as it is, its fit in its manifest; **MB**: "
             "its weights). "
             f"On held-out prose of the test split ({results['prompts']} windows per length): "
             "**KL** of the target's next 32 tokens from the translated cache against its own "
             "cache (nats/token), beside **floor**, the target with no cache; **recovered**: "
             "teacher-forced argmax agreement with native above what the last 16 tokens alone "
             f"give; **recall**: exact recall of {results['needles']} held-out needles, native / "
             "translated; **speed-up**: the target's prefill of the prompt over the "
             "switch once the source has read it: pooling, translating and installing "
             "(medians). Regenerate with `python research/cross_tokenizer.py`.\n",
             f"BLAS: {results['blas']}\n"]
    for row in results["directions"]:
        g = row["groups"]
        lines += [f"## {row['source']} -> {row['target']}\n",
                  f"Held-out text: {g['source_tokens']:,} source and {g['target_tokens']:,} "
                  f"target tokens in {g['groups']:,} groups, {g['one_to_one']:.1%} of them one "
                  f"token on each side (largest: {g['largest_group'][0]} source, "
                  f"{g['largest_group'][1]} target tokens).\n",
                  "| fit | MB | L | KL | floor | KL / floor | recovered | recall | speed-up |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for variant, result in row["variants"].items():
            for length, s in result["lengths"].items():
                recall = ("-" if s["recall_native"] is None else
                          f"{s['recall_native']:.2f} / {s['recall_translated']:.2f}")
                size = f"{result['bytes'] / 2**20:.1f}" if "bytes" in result else "-"
                lines.append(f"| {variant} | {size} | {length} | {s['kl']:.4f} | "
                             f"{s['kl_floor']:.4f} | "
                             f"{s['kl'] / s['kl_floor']:.2f} | {s['recovered']:.2f} | {recall} | "
                             f"{s['prefill_s'] / s['translate_s']:.1f}x |")
        lines.append("")
    (OUT / "cross_tokenizer.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=256, help="fitting windows")
    parser.add_argument("--length", type=int, default=256, help="target tokens a window")
    parser.add_argument("--variants",
                        default="shipped,mean,first,last,mean+needles,mean+needles+width32,"
                        "mean+needles+tables,mean+needles+tables+layers,"
                        "mean+needles+tables+layers+width32",
                        help="pooling of each fit; +needles: needle-weighted, +tables: identity "
                        "tables, +layers: every source layer, +widthN: linear-attention rows "
                        "compressed to N directions, as well")
    parser.add_argument("--split", default="test", choices=("test", "validation"),
                        help="held-out split measured; validation (for choosing what to ship) "
                        "writes runs/cross_tokenizer/validation.json, not the results")
    parser.add_argument("--one-way", action="store_true", help="the pair's first direction only")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--needles", type=int, default=16)
    parser.add_argument("--corpus", default="runs/corpus", help="the train split's directory")
    parser.add_argument("--pair", default=",".join(PAIR), help="source,target")
    parser.add_argument("--tabulate", action="store_true",
                        help="rewrite the .md from the JSON, measuring nothing")
    args = parser.parse_args()
    if args.tabulate:
        return write_markdown(json.loads((OUT / "cross_tokenizer.json").read_text()))
    pair = tuple(args.pair.split(","))
    if not (Path(args.corpus) / "train.txt").is_file():
        raise SystemExit("no train split: build the zoo corpus with `kvtrans zoo corpus`")
    blas = blas_report()
    args.variants = args.variants.split(",")
    train_file = Path(args.corpus) / "train.txt"
    test_text = held_out_split(args.split).read_text()
    directions = [measure_direction(a, b, args, train_file, test_text)
                  for a, b in ((pair,) if args.one_way else (pair, pair[::-1]))]
    results = {"blas": str(blas),
               "pair": list(pair), "windows": args.windows, "length": args.length,
               "prompts": args.prompts, "needles": args.needles, "directions": directions}
    if args.split != "test":
        RUNS.mkdir(parents=True, exist_ok=True)
        (RUNS / f"{args.split}.json").write_text(json.dumps(results, indent=2) + "\n")
        return
    OUT.mkdir(exist_ok=True)
    (OUT / "cross_tokenizer.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results)


if __name__ == "__main__":
    main()
