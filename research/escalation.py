"""A fired gate that reads more before it re-reads (`Session(escalate=True)`), against the
default that re-reads the span at once.

Where the gate fires, an escalating switch rewinds, translates all but the last 4r tokens and
lets the gate judge again; only a second firing re-reads the span. Each translator named is
measured both ways through a `Session` at its default R, paired on the same windows, at 256
and 512 tokens, on the validation split with a needle draw other than the held-out one (seed
1), as ideas are (`ideas.py`): the share of switches applied, the history's worth recovered,
greedy match and needle recall. Writes results/escalation.md and .json.

    python research/escalation.py [--translators A,B] [--prompts 64] [--needles 96] [--tabulate]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_kvtrans  # noqa: F401  first: fast BLAS

from frontier import loaded
from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.evaluation import frontier as fr
from mlx_kvtrans.models import held_out_split
from mlx_kvtrans.session import dial

OUT = Path(__file__).resolve().parent / "results"
# the shipped directions whose gate fires on more than a tenth of switches (`bars.md`)
TRANSLATORS = ["qwen3.5-a__qwen3.5-b-distilled", "qwen3.5-a__qwen3.5-xt-distilled"]
LENGTHS = [256, 512]
FIGURES = ["applied", "history_recovered", "first_token", "greedy_match", "recall_translated",
           "recall_native"]


def measure(name: str, models: dict, prompts: int, needles: int) -> dict:
    translator, src, tgt = loaded(name, models)
    reread, how = dial.default_reread(translator)
    ids = tgt.tokenizer.encode(held_out_split("validation").read_text())
    plan = {n: [fr.Setting(max(reread, fr.GATE_TOKENS))] for n in LENGTHS}
    out = {"reread": reread, "how": how}
    for escalate in (False, True):
        switch = fr.SessionSwitch(translator.prepare(), src, tgt, escalate=escalate)
        rows = fr.measure(switch, tgt.tokenizer.encode, ids, plan,
                          fr.FrontierConfig(prompts=prompts, needles=needles, repeats=1, seed=1))
        out["escalating" if escalate else "default"] = [
            {"length": r.length, **{k: getattr(r, k) for k in FIGURES}} for r in rows]
        print(name, "escalating" if escalate else "default",
              json.dumps(out["escalating" if escalate else "default"]), flush=True)
    return out


def write_markdown(saved: dict, out: Path) -> None:
    lines = ["# A fired gate that reads more before it re-reads\n",
             "Each translator through a `Session` at its default R, the default switch (a fired "
             "gate re-reads the span) beside `Session(escalate=True)` (a fired gate first "
             "tries 4r tokens read natively, judged again), on the same windows of the "
             "validation split and a needle draw other than the held-out one: "
             f"{saved['prompts']} windows and {saved['needles']} needles per length. Recovered, "
             "first token and greedy match are read on the prose windows, recall on the "
             "needles; applied counts the switches of both. Regenerate with "
             f"`python research/escalation.py`.\n\nBLAS: {saved['blas']}\n",
             "| translator | L | switch | applied | recovered | first token | greedy match "
             "| recall (native) |", "|---|---|---|---|---|---|---|---|"]
    for name, result in saved["translators"].items():
        for kind in ("default", "escalating"):
            for r in result[kind]:
                lines.append(f"| {name} | {r['length']} | {kind} | {r['applied']:.2f} | "
                             f"{r['history_recovered']:.2f} | {r['first_token']:.2f} | "
                             f"{r['greedy_match']:.1f} | {r['recall_translated']:.2f} "
                             f"({r['recall_native']:.2f}) |")
    (out / "escalation.md").write_text("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--translators", default=",".join(TRANSLATORS))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--needles", type=int, default=96)
    parser.add_argument("--results", type=Path, default=OUT)
    parser.add_argument("--tabulate", action="store_true", help="only rebuild escalation.md")
    args = parser.parse_args()
    if args.tabulate:
        return write_markdown(json.loads((args.results / "escalation.json").read_text()),
                              args.results)
    started, models = time.perf_counter(), {}
    results = {name: measure(name, models, args.prompts, args.needles)
               for name in args.translators.split(",")}
    saved = {"blas": str(blas_report()), "prompts": args.prompts, "needles": args.needles,
             "minutes": round((time.perf_counter() - started) / 60, 2),
             "translators": results}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "escalation.json").write_text(json.dumps(saved, indent=1))
    write_markdown(saved, args.results)


if __name__ == "__main__":
    main()
