"""Exact recall across lineages: each idea of fitting and distilling a translator, measured.

One row per (pair, idea): the idea's stage-1 fit and its stage-2 distillation, then exact needle
recall and answer-digit accuracy through the translated cache at 1x, 2x, 4x and 8x the fitting
length (native recall beside), held-out KL at 1x and 4x, and fit and distill minutes. Every
stage 2 here distils with half of each batch answer-aligned needles (the baseline row is exactly
that), so each other row adds one idea to it:

- attention rehearsal: the target's attention over the translated cache held to its own
  (`--attention-weight`);
- identity tables: rank-32 per-token tables of the ids at t and t-1 in every map
  (`--identity-tables`);
- needle-weighted fit: half the fitting windows are needles, their last 8 tokens' attention
  weighting the fit (`--needle-share`, `--attention-weighted`);
- residual: a 32-unit residual nonlinearity in every map, trained by stage 2 (`--residual`);
- all: every idea together.

Rows are kept as they finish (research/results/exact_recall.json), so a stopped run continues
with the rows it lacks; distillations checkpoint under runs/exact_recall/, where each row's
distilled translator is saved too (`translator/`, for `kvtrans eval needle / multiturn`).

    python research/exact_recall.py [--pairs a:b,...] [--ideas a,b] [--samples N]
                                      [--distill-steps N] [--windows N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS
import mlx.core as mx

from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.evaluation.needles import (NeedleConfig, filler_sentences, needle_report,
                                            needle_rows)
from mlx_kvtrans.models import weights_fingerprint
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.training.distill import DistillConfig, Distiller, start_fingerprint
from mlx_kvtrans.translators.fidelity import FidelityConfig, fidelity
from mlx_kvtrans.training.fit import FitConfig, fit, token_windows
from mlx_kvtrans.translators.translator import translate_cache
from mlx_kvtrans.zoo.corpus import read_split

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "results" / "exact_recall"
FIT_LENGTH = 256
LENGTHS = [FIT_LENGTH * m for m in (1, 2, 4, 8)]
PAIRS = [("kimi-linear", "kimi-vl"), ("qwen3-small", "qwen3-large")]
BASE_FIT = {"point": 1, "nu": 2, "token_identity": "ids"}
BASE_DISTILL = {"needle_share": 0.5}
# idea -> (fit options, fitting-window options, distill options), each added to the baseline
IDEAS = {
    "baseline": ({}, {}, {}),
    "attention rehearsal": ({}, {}, {"attention_weight": 1.0}),
    "identity tables": ({"identity_tables": 32}, {}, {}),
    "needle-weighted fit": ({"attention_weighted": 8}, {"needle_share": 0.5}, {}),
    "residual": ({"residual": 32}, {}, {}),
    "all": ({"identity_tables": 32, "attention_weighted": 8, "residual": 32},
            {"needle_share": 0.5}, {"attention_weight": 1.0}),
}


def corpus_ids(tokenizer, split: str) -> list[int]:
    return tokenizer.encode((Path("runs/corpus") / f"{split}.txt").read_text())


def needles_report(translator, src, tgt, samples: int) -> dict:
    cache_for = (None if translator is None else
                 lambda ids: translate_cache(translator, src.model, tgt.model, ids))
    return {str(n): needle_report(tgt.model, tgt.tokenizer.encode, n, NeedleConfig(samples),
                                  cache_for=cache_for) for n in LENGTHS}


def run_idea(src, tgt, idea: str, args, train_ids, validation_ids, test_ids, needles) -> dict:
    fit_options, window_options, distill_options = IDEAS[idea]
    config = FitConfig(**BASE_FIT, **fit_options, windows=args.windows, length=FIT_LENGTH)
    started = time.perf_counter()
    batches = token_windows(train_ids, FIT_LENGTH, args.windows, batch=8, needles=needles,
                            **window_options)
    translator = fit(src.model, tgt.model, batches, None, config)
    fit_minutes = (time.perf_counter() - started) / 60
    stage1 = needle_report(tgt.model, tgt.tokenizer.encode, FIT_LENGTH,
                           NeedleConfig(args.samples),
                           cache_for=lambda ids: translate_cache(translator, src.model,
                                                                 tgt.model, ids))
    distill = DistillConfig(steps=args.distill_steps, batch=8, max_prefix=FIT_LENGTH,
                            validate_every=max(1, args.distill_steps // 4),
                            validation_windows=16, **BASE_DISTILL, **distill_options)
    workdir = (Path("runs") / "exact_recall" / f"{src.path.name}__{tgt.path.name}"
               / f"{idea.replace(' ', '-')}-{start_fingerprint(translator)[:8]}")
    distiller = Distiller(translator, src.model, tgt.model, train_ids, validation_ids, distill,
                          workdir, needles=needles)
    distiller.resume()
    summary = distiller.run()
    distilled = distiller.distilled()
    distilled.info.update(stage=2, distill=summary)
    artifact.save(distilled, workdir / "translator", src, tgt)  # for `kvtrans eval ...`
    kl = fidelity(distilled, src.model, tgt.model, test_ids,
                  FidelityConfig([LENGTHS[0], LENGTHS[2]], windows=args.kl_windows))
    return {"idea": idea, "fit": config.to_json(), "fit_windows": window_options,
            "distill": summary["config"],
            "fit_minutes": round(fit_minutes, 2), "distill_minutes": summary["minutes"],
            "validation_kl_before": summary["validation_kl_before"],
            "validation_kl_after": summary["validation_kl_after"],
            "kl": {str(r["prefix_length"]): r["kl"] for r in kl},
            "stage1_recall_1x": stage1["recall"],
            "stage1_digit_accuracy_1x": stage1["digit_accuracy"],
            "needles": needles_report(distilled, src, tgt, args.samples)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", default=None, help="only these, as src:tgt,src:tgt")
    parser.add_argument("--ideas", default=None, help="only these, comma-separated")
    parser.add_argument("--samples", type=int, default=20, help="needles per length")
    parser.add_argument("--kl-windows", type=int, default=8, help="held-out windows per length")
    parser.add_argument("--windows", type=int, default=256, help="fitting windows")
    parser.add_argument("--distill-steps", type=int, default=200)
    parser.add_argument("--note", default=None,
                        help="how this run's minutes were measured, kept with the pair")
    args = parser.parse_args()
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")] if args.pairs else PAIRS
    ideas = args.ideas.split(",") if args.ideas else list(IDEAS)
    unknown = [i for i in ideas if i not in IDEAS]
    if unknown:
        parser.error(f"unknown ideas {unknown}; ideas: {', '.join(IDEAS)}")
    out_json = OUT.with_suffix(".json")
    results = (json.loads(out_json.read_text()) if out_json.exists() else
               {"fit_length": FIT_LENGTH, "pairs": {}})
    blas = blas_report()
    results.update({"blas": blas.name, "matmul_float32_gflops": round(blas.gflops, 1)})
    for source, target in pairs:
        src, tgt = kv.load(source), kv.load(target)
        key = f"{source} -> {target}"
        entry = results["pairs"].setdefault(key, {"rows": {}})
        settings = {"samples": args.samples, "windows": args.windows,
                    "distill_steps": args.distill_steps, "kl_windows": args.kl_windows,
                    "weights": [weights_fingerprint(m.path) for m in (src, tgt)]}
        if entry.get("settings") != settings:  # other settings or models: start the pair anew
            entry.update({"settings": settings, "rows": {},
                          "native": needles_report(None, src, tgt, args.samples)})
        train_ids = corpus_ids(src.tokenizer, "train")
        validation_ids = corpus_ids(src.tokenizer, "validation")
        test_ids = corpus_ids(src.tokenizer, "test")
        needles = needle_rows(src.tokenizer.encode,
                              filler_sentences(read_split("runs/corpus", "train"), limit=20_000),
                              FIT_LENGTH + DistillConfig.continuation)
        if args.note:
            entry["note"] = args.note
        for idea in ideas:
            if idea in entry["rows"]:
                continue
            row = run_idea(src, tgt, idea, args, train_ids, validation_ids, test_ids, needles)
            entry["rows"][idea] = row
            print(json.dumps({"pair": key, **row}), flush=True)
            OUT.parent.mkdir(parents=True, exist_ok=True)
            out_json.write_text(json.dumps(results, indent=2) + "\n")
            OUT.with_suffix(".md").write_text(markdown(results))
            mx.clear_cache()
    out_json.write_text(json.dumps(results, indent=2) + "\n")
    OUT.with_suffix(".md").write_text(markdown(results))
    print(f"wrote {out_json}")


def markdown(results) -> str:
    lengths = [str(n) for n in LENGTHS]
    lines = ["# Exact recall across lineages: one row per idea\n",
             "Each idea fitted (stage 1) and distilled (stage 2, half of each batch "
             "answer-aligned needles, as in the baseline) on the zoo; exact six-digit needle "
             "recall through the translated cache on held-out needles at 1x-8x the fitting "
             f"length of {results['fit_length']} tokens (native in brackets), answer-digit "
             "accuracy (share of digits right with the earlier ones given), held-out KL in "
             "nats/token at 1x and 4x. Generated by `python research/exact_recall.py`; "
             "settings per pair below the table.\n",
             "| pair | idea | recall " + " | recall ".join(f"@{n}" for n in lengths)
             + " | digits @" + lengths[0] + " | KL @" + lengths[0] + " | KL @" + lengths[2]
             + " | stage-1 recall @" + lengths[0] + " | fit min | distill min |",
             "|---" * (8 + len(lengths)) + "|"]
    notes = []
    for key, entry in results["pairs"].items():
        native = entry["native"]
        for idea, row in entry["rows"].items():
            recall = [f"{row['needles'][n]['recall']:.2f} ({native[n]['recall']:.2f})"
                      for n in lengths]
            lines.append(
                f"| {key} | {idea} | " + " | ".join(recall)
                + f" | {row['needles'][lengths[0]]['digit_accuracy']:.2f} | "
                f"{row['kl'][lengths[0]]:.4f} | {row['kl'][lengths[2]]:.4f} | "
                f"{row['stage1_recall_1x']:.2f} | {row['fit_minutes']:.1f} | "
                f"{row['distill_minutes']:.1f} |")
        s = entry["settings"]
        notes.append(f"- {key}: {s['samples']} needles per length, {s['windows']} fitting "
                     f"windows, {s['distill_steps']} distillation steps, {s['kl_windows']} KL "
                     f"windows per length" + (f"; {entry['note']}" if entry.get("note") else ""))
    return "\n".join(lines + ["", *notes]) + "\n"


if __name__ == "__main__":
    main()
