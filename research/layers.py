"""Where a translation loses the history, by depth: what rebuilding the target's first layers
would keep.

For every shipped translator between models of one tokenizer, at 256 and 512 tokens (where the
fidelity bars are read): the target continues from a cache whose first k layers are its own and
whose layers from k up are translated (`kvtrans eval ablate`'s "translated from layer k up"),
k = 0 (everything translated) to N - 1. A switch that rebuilt its first k layers would read
every token through them: k / N of a full re-read, the cost beside each row. These are the only
layers a target can rebuild without reading through all of them (DroidSpeak recomputes the
layers that err most; a layer above needs every layer below it read first). No re-read: the
whole prompt is translated, as in the ablation.

Recovered is the frontier's measure (teacher-forced agreement with the native greedy
continuation above the last-16-tokens floor); on the validation split, 8 windows and 8 needles
per length. Writes research/results/layers.{json,md}.

    python research/layers.py [--windows 8] [--needles 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS

from mlx_kvtrans.evaluation.ablate import AblateConfig, ablate
from mlx_kvtrans.models import held_out_split
from mlx_kvtrans.translators import artifact

OUT = Path(__file__).resolve().parent / "results"
LENGTHS = (256, 512)


def shipped_one_tokenizer() -> list[Path]:
    return [artifact.resolve(name) for name in artifact.shipped_names()
            if "alignment" not in artifact.read_manifest(artifact.resolve(name))]


def measure(directory: Path, args, models: dict) -> dict:
    manifest = artifact.read_manifest(directory)
    names = manifest["source"]["name"], manifest["target"]["name"]
    for name in names:
        models.setdefault(name, kv.load(name))
    src, tgt = (models[n] for n in names)
    translator = artifact.load(directory, src, tgt)
    layers = len(kv.layout_of(tgt.model).layers)
    labels = ["translated all"] + [f"translated from layer {k} up" for k in range(1, layers)]
    ids = tgt.tokenizer.encode(held_out_split("validation").read_text())
    rows = {r["label"]: r["lengths"] for r in ablate(
        tgt.model, tgt.tokenizer.encode, ids,
        AblateConfig(list(LENGTHS), windows=args.windows, needles=args.needles,
                     only={"native", *labels}),
        translator=translator, source=src.model)}
    return {"translator": directory.name, "source": names[0], "target": names[1],
            "layers": layers,
            "rows": [{"own_layers": k, "cost": k / layers, **{
                str(n): rows[label][str(n)] for n in LENGTHS}} for k, label in enumerate(labels)],
            "native": {str(n): rows["native"][str(n)] for n in LENGTHS}}


def write_markdown(results: list[dict], settings: dict, out: Path) -> None:
    lines = ["# Where a translation loses the history, by depth\n",
             "The target continues from a cache whose first k layers are its own and the rest "
             "translated (the whole prompt, no re-read): the ceiling of a switch that rebuilt "
             "its first k layers, at k / N of a full re-read (**cost**). **Recovered**: the "
             "history's worth kept (the frontier's measure); **KL**: nats per continuation "
             "token; **recall**: exact needle recall (native recall in the k = N row). On the "
             f"validation split, {settings['windows']} windows and {settings['needles']} "
             "needles per length. Regenerate with `python research/layers.py`.\n"]
    for r in results:
        lines += [f"## {r['translator']}\n", f"{r['source']} -> {r['target']}, "
                  f"{r['layers']} target layers.\n",
                  "| own layers k | cost | " + " | ".join(
                      f"recovered @{n} | KL @{n} | recall @{n}" for n in LENGTHS) + " |",
                  "|---|---|" + "---|---|---|" * len(LENGTHS)]
        rows = r["rows"] + [{"own_layers": r["layers"], "cost": 1.0, **r["native"]}]
        for row in rows:
            cells = [f"{row[str(n)]['recovered']:.2f} | {row[str(n)]['kl']:.4f} | "
                     f"{row[str(n)]['recall']:.2f}" for n in LENGTHS]
            lines.append(f"| {row['own_layers']} | {row['cost']:.2f} | " + " | ".join(cells)
                         + " |")
        lines.append("")
    out.joinpath("layers.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--needles", type=int, default=8)
    parser.add_argument("--results", type=Path, default=OUT)
    args = parser.parse_args()
    settings = {"windows": args.windows, "needles": args.needles}
    models, results = {}, []
    for directory in shipped_one_tokenizer():
        print(f"{directory.name} ...", flush=True)
        results.append(measure(directory, args, models))
    args.results.mkdir(parents=True, exist_ok=True)
    args.results.joinpath("layers.json").write_text(
        json.dumps({"settings": settings, "results": results}, indent=1))
    write_markdown(results, settings, args.results)


if __name__ == "__main__":
    main()
