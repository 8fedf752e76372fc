"""What quantization costs a translator: the zoo's kimi-linear -> kimi-vl converted by mlx-lm
(`mlx_lm.convert`, affine, 4- and 8-bit, group 32), switched through a `Session` at R = 8 on the
held-out test split and needles, with

- the shipped translator (fitted and distilled on the unquantized weights);
- a stage-1 fit on the unquantized pair (the shipped translator's stage 1 options);
- the same fit on the quantized pair itself;

beside the quantized target's native figures. Writes benchmarks/results/quantized.{json,md};
the converted models and fits stay in runs/quantized (reused when run again).

    python benchmarks/quantized.py [--bits 4 8] [--prompts 16] [--needles 30]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS

from mlx_kvtrans.evaluation import frontier as fr
from mlx_kvtrans.models import held_out_split, weights_dir
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.training.fit import FitConfig
from mlx_kvtrans.training.workflows import fit_translator

OUT = Path(__file__).resolve().parent / "results"
RUNS = Path("runs/quantized")
SOURCE, TARGET = "kimi-linear", "kimi-vl"
LENGTHS = [256, 512]
REREAD = 8
# the shipped kimi-linear -> kimi-vl's stage 1 (research/translators.py, EVERY_IDEA)
STAGE1 = FitConfig(point=1, nu=2, token_identity="ids", attention_weighted=8,
                   identity_tables=32, residual=32)


def converted(name: str, bits: int, mode: str = "affine") -> Path:
    from mlx_lm.convert import convert

    out = RUNS / (f"{name}-{bits}bit" if mode == "affine" else f"{name}-{mode}")
    if not (out / "config.json").is_file():
        convert(hf_path=str(weights_dir() / name), mlx_path=str(out), quantize=True,
                q_bits=bits, q_group_size=32 if mode == "affine" else None, q_mode=mode)
    return out


def seed_from_history(name: str) -> Path:
    """A zoo seed whose weights ship only in the repository's history (`zoo.train.SEEDS_COMMIT`),
    put together under runs/ from its shipped config and tokenizer and those weights."""
    import shutil
    import subprocess

    from mlx_kvtrans.zoo.train import SEEDS_COMMIT

    shipped, out = weights_dir() / "seeds" / name, RUNS / name
    if not (out / "model.safetensors").is_file():
        out.mkdir(parents=True, exist_ok=True)
        for f in shipped.iterdir():
            shutil.copy(f, out / f.name)
        weights = subprocess.run(["git", "show", f"{SEEDS_COMMIT}:weights/seeds/{name}/"
                                  "model.safetensors"], capture_output=True, check=True).stdout
        (out / "model.safetensors").write_bytes(weights)
    return out


def lineage_rows() -> list[dict]:
    """Which tensor's recorded row each conversion of kimi-vl, another seed, a fine-tune of the
    same config and one changed matrix do not hold (`models.lineage_difference`)."""
    import mlx.core as mx

    from mlx_kvtrans.models import lineage, lineage_difference

    def row(label: str, base: str, other) -> dict:
        model = kv.load(other).model if isinstance(other, str) else other
        differs = lineage_difference(lineage(kv.load(base).model), model)
        return {"model": label, "first_difference": differs or None,
                "same_lineage": not differs}

    rows = [row(f"kimi-vl, {bits}-bit affine", TARGET, str(converted(TARGET, bits)))
            for bits in (2, 3, 4, 8)]
    rows.append(row("kimi-vl, mxfp4", TARGET, str(converted(TARGET, 4, "mxfp4"))))
    rows.append(row("kimi-vl, another seed", TARGET, str(seed_from_history("kimi-vl-1"))))
    rows.append(row("qwen3.5-b, a fine-tune of qwen3.5-a", "qwen3.5-a", "qwen3.5-b"))
    tuned = kv.load(TARGET).model  # a merged fine-tune of one matrix, as a LoRA's would be
    proj = tuned.language_model.model.layers[3].self_attn.q_b_proj
    proj.weight = proj.weight + 0.01 * mx.random.normal(proj.weight.shape, key=mx.random.key(0))
    rows.append(row("kimi-vl, layer 3 q_b_proj + noise 0.01", TARGET, tuned))
    return rows


def stage1(source: str, target: str, out: Path) -> Path:
    if not (out / "weights.safetensors").is_file():
        fit_translator(source, target, [held_out_split("train")],
                       replace(STAGE1, needle_share=0.5),
                       validation=held_out_split("validation"), out=out, gate_windows=8)
    return out


def _two(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def measure(label: str, directory: Path, src, tgt, args) -> dict:
    translator = artifact.load(directory, src, tgt)
    ids = tgt.tokenizer.encode(held_out_split("test").read_text())
    frontier = fr.measure_translator(directory, src, tgt, translator, ids,
                                     fr.FrontierConfig(LENGTHS, [REREAD], args.prompts,
                                                       args.needles, repeats=1))
    rows = [r.to_json() for r in frontier.rows]
    for r in rows:
        print(f"{label} at {r['length']}: recovered {_two(r['history_recovered'])}, first "
              f"{r['first_token']:.2f}, KL {r['kl']:.4f}, recall {r['recall_native']:.2f} / "
              f"{r['recall_translated']:.2f}", flush=True)
    return {"translator": label, "fitted_on": translator.info.get("fitted_on", ""), "rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--needles", type=int, default=30)
    args = parser.parse_args()
    RUNS.mkdir(parents=True, exist_ok=True)
    lineage = lineage_rows()
    unquantized_fit = stage1(SOURCE, TARGET, RUNS / "stage1-unquantized")
    results = []
    for bits in args.bits:
        src_dir, tgt_dir = converted(SOURCE, bits), converted(TARGET, bits)
        quantized_fit = stage1(str(src_dir), str(tgt_dir), RUNS / f"stage1-{bits}bit")
        src, tgt = kv.load(str(src_dir)), kv.load(str(tgt_dir))
        for label, directory in (("shipped (unquantized fit, distilled)",
                                  artifact.shipped(SOURCE, TARGET)),
                                 ("stage 1 on the unquantized pair", unquantized_fit),
                                 (f"stage 1 on the {bits}-bit pair", quantized_fit)):
            results.append({"bits": bits, **measure(f"{bits}-bit, {label}", directory, src,
                                                    tgt, args)})
    settings = {"lengths": LENGTHS, "reread": REREAD, "prompts": args.prompts,
                "needles": args.needles, "text": "weights/corpus/test.txt"}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "quantized.json").write_text(json.dumps({"settings": settings, "results": results,
                                                    "lineage": lineage}, indent=1) + "\n")
    lines = ["# Translators on quantized models\n",
             f"The zoo's {SOURCE} -> {TARGET}, both converted by `mlx_lm.convert` (affine, group "
             f"32), switched through a `Session` at R = {REREAD} on the held-out test split: "
             f"{args.prompts} prose windows and {args.needles} needles per length. Recovered: the "
             "history's worth kept (teacher-forced agreement with the quantized target's own "
             "greedy continuation, above the last-16-tokens floor); recall: native (the "
             "quantized target reading the prompt itself) / switched. Regenerate with "
             "`python benchmarks/quantized.py`.\n",
             "| bits | translator | L | recovered | first | match | KL | recall | applied |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for row in r["rows"]:
            lines.append(f"| {r['bits']} | {r['translator'].split(', ', 1)[1]} | "
                         f"{row['length']} | {_two(row['history_recovered'])} | "
                         f"{row['first_token']:.2f} | {row['greedy_match']:.1f} | "
                         f"{row['kl']:.4f} | {row['recall_native']:.2f} / "
                         f"{row['recall_translated']:.2f} | {row['applied']:.2f} |")
    lines += ["\n## Lineage\n",
              "What tells a checkpoint's conversions from other weights of the same config "
              "(`models.lineage_difference`): a fixed row of every tensor, recorded at the fit, "
              "rounded to the model's float dtype or quantized as it is quantized reproduces "
              "the model's own row exactly; the first tensor that does not is named.\n",
              "| model | first tensor that differs | same lineage |", "|---|---|---|"]
    lines += [f"| {r['model']} | {r['first_difference'] or '-'} | "
              f"{'yes' if r['same_lineage'] else 'no'} |" for r in lineage]
    (OUT / "quantized.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
