"""What a relay of each given block does for a real-family direction (`translators/relay.py`):
the target's layers FIRST..LAST read the translated span again from the source's hidden state
entering source layer J, the rest translated. Per block, on windows of the other-domain text
(Python's reference documentation, which the family never fits on): the KL of the target's next
32 tokens against its own cache, the share of them whose argmax agrees, and the copy loss (the
copy probe's NLL on the case's cache minus on the target's own). The translation alone is the
first row.

Writes research/results/relay-blocks-DIRECTION.{json,md}.

    python research/relay_blocks.py DIRECTION --blocks FIRST-LAST:J,... [--family runs/real-family]
                                    [--length 512] [--windows 4]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import mlx_kvtrans as kv  # before mlx.core: the BLAS check
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_kvtrans.capture import RESIDUAL, capture
from mlx_kvtrans.evaluation.ablate import copy_reading
from mlx_kvtrans.evaluation.chat_needles import other_domain_prose
from mlx_kvtrans.evaluation.frontier import window_starts
from mlx_kvtrans.translators import artifact, relay
from mlx_kvtrans.translators.fidelity import kl_per_token
from mlx_kvtrans.translators.gate import copy_probe, copy_spans
from mlx_kvtrans.translators.translator import measured_sink, translate_cache

CONTINUATION = 32
RESULTS = Path(__file__).parent / "results"


def parse_blocks(text: str) -> list[relay.Relay]:
    out = []
    for item in text.split(","):
        layers, _, j = item.partition(":")
        first, _, last = layers.partition("-")
        out.append(relay.Relay(int(first), int(last or first), int(j)))
    return out


def measure(direction: str, blocks: list[relay.Relay], family: Path, length: int,
            windows: int) -> list[dict]:
    source, target = (kv.load(str(family / m)) for m in direction.split("__"))
    translator = artifact.load(family / "translators" / direction, source, target)
    translator.info.pop("relay", None)  # the translation alone; each block is run below
    sink = measured_sink(translator)
    ids = target.tokenizer.encode(" ".join(other_domain_prose()))
    rows = {None: [], **{b: [] for b in blocks}}
    for start in window_starts(ids, length + CONTINUATION, windows, 0):
        window = ids[start:start + length + CONTINUATION]
        prefix, after = window[:length], mx.array(window[length - 1:-1])[None]
        probe = copy_probe(prefix, copy_spans(sink, length))
        own = make_prompt_cache(target.model)
        target.model(mx.array(prefix)[None], cache=own)
        native = target.model(after, cache=copy.deepcopy(own))
        native_copy = copy_reading(target.model, copy.deepcopy(own), probe)
        translated = translate_cache(translator, source.model, target.model, prefix[:-1])
        inputs = capture(source.model, prefix[:-1], points=(),
                         residuals={b.source_layer for b in blocks}).objects
        for block in rows:
            cache = copy.deepcopy(translated)
            if block is not None:
                relay.run(target.model, cache, inputs[block.source_layer][RESIDUAL][:, sink:],
                          block)
            target.model(mx.array(prefix[-1:])[None], cache=cache)
            logits = target.model(after, cache=copy.deepcopy(cache))
            rows[block].append({
                "kl": float(kl_per_token(native, logits).mean()),
                "argmax": float((mx.argmax(logits, -1) == mx.argmax(native, -1)).mean()),
                "copy": copy_reading(target.model, copy.deepcopy(cache), probe) - native_copy})
    return [{"block": None if b is None else [b.first, b.last, b.source_layer],
             **{k: sum(r[k] for r in found) / len(found) for k in ("kl", "argmax", "copy")}}
            for b, found in rows.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("direction")
    parser.add_argument("--blocks", required=True, help="FIRST-LAST:J, comma-separated")
    parser.add_argument("--family", type=Path, default=Path("runs/real-family"))
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4)
    args = parser.parse_args()
    rows = measure(args.direction, parse_blocks(args.blocks), args.family, args.length,
                   args.windows)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"relay-blocks-{args.direction}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"direction": args.direction, "length": args.length, "windows": args.windows,
         "rows": rows}, indent=1) + "\n")
    lines = [f"# Relay blocks: {args.direction}", "",
             f"{args.windows} windows of {args.length} tokens of the other-domain text; "
             f"`python research/relay_blocks.py {args.direction} --blocks {args.blocks} "
             f"--length {args.length} --windows {args.windows}`.", "",
             "| target layers | from source layer | KL | argmax agreement | copy loss |",
             "|---|---|---|---|---|"]
    for r in rows:
        b = r["block"]
        lines.append(f"| {'translation alone' if b is None else f'{b[0]}-{b[1]}'} | "
                     f"{'-' if b is None else b[2]} | {r['kl']:.4f} | {r['argmax']:.3f} | "
                     f"{r['copy']:+.3f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
