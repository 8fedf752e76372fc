"""A recording prefill (`capture`: what a session's read and a fit's prefill run) with the output
head on the last token only, beside the head on every token, at real checkpoints' per-layer
sizes and their real vocabularies.

A prefill needs the logits of its last token alone; mlx-lm's own prefill never evaluates the
others. A capture that took the whole forward's logits paid the head on every token: on a
163,840-token vocabulary that is a large share of a token's arithmetic. Per model (random
weights, `realistic_config` at the full checkpoint's vocabulary, the few layers the realistic
rows of `switch.md` use), the same capture both ways, alternated, the least of the runs; beside
it, the head's share of a token's multiply-adds in that model and in the full checkpoint
(`training.cost.active_parameters` of `full_config`, built lazily and never run).
Writes research/results/recording_prefill.{json,md}.

    python research/recording_prefill.py [--tokens 1024] [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import mlx_kvtrans  # noqa: F401  first: fast BLAS
import mlx.core as mx

from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.capture import capture
from mlx_kvtrans.capture.instrument import fastest_recurrence
from mlx_kvtrans.models import LoadedModel
from mlx_kvtrans.training.cost import active_parameters
from mlx_kvtrans.zoo.families import FULL, full_config, realistic_config
from mlx_kvtrans.zoo.random_model import build_model, unbuilt_model

OUT = Path(__file__).resolve().parent / "results"
MODELS = ("kimi-vl", "kimi-linear")
prefill = sys.modules[capture.__module__]  # where `capture` looks up `head_on_last_token`


def head_share(config: dict) -> float:
    """The output head's share of one token's multiply-adds in the model `config` describes
    (built, never evaluated: nothing is allocated)."""
    model = unbuilt_model(config)
    text = config.get("text_config", config)
    head = text["vocab_size"] * text["hidden_size"]
    active = active_parameters(LoadedModel("m", Path("."), model, None, config))
    # the input embedding is read, not multiplied; a tied head is counted once
    multiplied = active - (0 if text.get("tie_word_embeddings", False) else head)
    return head / multiplied


def timed(model, ids, every_token: bool) -> float:
    with contextlib.ExitStack() as stack:
        if every_token:  # the head on every token: the final norm's rows all reach it
            stack.enter_context(_head_everywhere())
        stack.enter_context(fastest_recurrence())
        started = time.perf_counter()
        cap = capture(model, ids, points=(1,))
        mx.eval(cap.last_logits)
        return time.perf_counter() - started


@contextlib.contextmanager
def _head_everywhere():
    saved = prefill.head_on_last_token
    prefill.head_on_last_token = lambda model: contextlib.nullcontext()
    try:
        yield
    finally:
        prefill.head_on_last_token = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for name in MODELS:
        config = realistic_config(name, vocab_size=FULL[name]["vocab"])
        model = build_model(config, seed=0)
        ids = mx.random.randint(0, FULL[name]["vocab"], (1, args.tokens), key=mx.random.key(0))
        timed(model, ids, False)  # first run: allocation
        last, every = [], []
        for _ in range(args.runs):
            last.append(timed(model, ids, False))
            every.append(timed(model, ids, True))
        text = config.get("text_config", config)
        row = {"model": name, "layers": text["num_hidden_layers"], "vocab": text["vocab_size"],
               "tokens": args.tokens, "last_token_s": round(min(last), 3),
               "every_token_s": round(min(every), 3),
               "speedup": round(min(every) / min(last), 2),
               "head_share": round(head_share(config), 3),
               "head_share_full": round(head_share(full_config(name)), 3)}
        rows.append(row)
        print(row, flush=True)
        del model
        mx.clear_cache()
    report = blas_report()
    results = {"rows": rows, "blas": str(report),
               "runs": args.runs}
    OUT.mkdir(exist_ok=True)
    (OUT / "recording_prefill.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = ["# Recording prefill: the output head on the last token only\n",
             "A capture (a session's read, a fit's prefill) of random ids at real checkpoints' "
             "per-layer sizes with their real vocabularies (float32, the layers of the "
             "realistic rows), the output head on the last token only (as the library runs it) "
             f"beside the head on every token; the least of {args.runs} alternated runs. "
             "**Head share**: the head's share of a token's multiply-adds in this model and in "
             "the full checkpoint (its real depth and experts), which bounds what the full "
             "checkpoint's prefill saves. Regenerate with "
             "`python research/recording_prefill.py`.\n",
             f"BLAS: {results['blas']}.\n",
             "| model | layers | vocabulary | tokens | head on the last token s | head on "
             "every token s | speed-up | head share | head share, full checkpoint |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['layers']} | {r['vocab']:,} | {r['tokens']:,} | "
                     f"{r['last_token_s']} | {r['every_token_s']} | {r['speedup']}x | "
                     f"{r['head_share']:.2f} | {r['head_share_full']:.2f} |")
    (OUT / "recording_prefill.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
