"""Session decoding versus mlx-lm's own: prefill and per-token decode, side by side.

Per model, in one run: `Session.generate` (mlx-lm's `generate_step` with the recording taps of
the model's shipped outgoing translators installed once per turn) against `mlx_lm.stream_generate`
and bare `generate_step`, on the same model and the same 512-token prompt, 48 generated tokens,
the best of 5 interleaved runs (each figure the least over the runs: on a shared machine
noise only adds time, and a 3 ms decode step here jumps between two speeds from run to run). Zoo models `kimi-linear`, `qwen3.5-a`, `kimi-vl`, and random-
weight models with real checkpoints' per-layer sizes (`--no-realistic` skips them; a model is
skipped when one run takes over 2 minutes). Also recorded: the bytes a session records per token,
against recording every object at (1) and (2) as it did before it recorded only what its
translators read. Writes research/results/session_decode.{json,md}.

    python research/session_decode.py [--runs 5] [--prompt 512] [--tokens 48] [--no-realistic]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, stream_generate

from mlx_kvtrans.backend import blas
from mlx_kvtrans.capture import capture
from mlx_kvtrans.evaluation.needles import FILLER_FILE
from mlx_kvtrans.session import RECORD_POINTS, Session
from mlx_kvtrans.session.line import nbytes
from mlx_kvtrans.translators import artifact

OUT = Path(__file__).resolve().parent / "results"
ZOO = {"kimi-linear": ["kimi-vl"], "qwen3.5-a": ["qwen3.5-b", "dsa"], "kimi-vl": ["kimi-linear"]}
REALISTIC = {"kimi-linear": "kimi-vl", "kimi-vl": "kimi-linear"}  # source -> translator target
MODES = ("generate_step", "stream_generate", "session")
TOO_LONG_S = 120.0


def timed(tokens) -> dict:
    """Times of an iterator of tokens: to the first, per token after it, to the end."""
    start = time.perf_counter()
    stamps = []
    for _ in tokens:
        stamps.append(time.perf_counter())
    end = time.perf_counter()
    n = len(stamps)
    return {"prefill_s": stamps[0] - start, "tokens": n, "total_s": end - start,
            "decode_ms_per_token": 1000 * (stamps[-1] - stamps[0]) / max(n - 1, 1)}


def run(mode: str, lm, models: dict, translators: dict, prompt: list[int], n: int,
        stop: set[int]) -> tuple[dict, Session | None]:
    mx.clear_cache()
    if mode == "generate_step":
        def tokens():
            for token, _ in generate_step(mx.array(prompt), lm.model, max_tokens=n):
                yield token
                if token in stop:
                    return
        return timed(tokens()), None
    if mode == "stream_generate":
        return timed(stream_generate(lm.model, lm.tokenizer, mx.array(prompt), max_tokens=n)), \
            None
    session = Session(models, translators, active=lm.name)
    session.add(prompt)  # appending ids is free; reading them is the turn's prefill
    return timed(session.generate(n, stop=stop)), session


def everything_bytes_per_token(lm, prompt: list[int]) -> float:
    """Bytes a token of recording every object at (1) and (2) (before this change)."""
    cap = capture(lm.model, prompt[:64], points=RECORD_POINTS)
    return sum(nbytes(v) for found in cap.objects for v in found.values()) / 64


def measure(label: str, lm, models: dict, translators: dict, prompt: list[int], n: int,
            runs: int) -> dict | None:
    stop = set(lm.tokenizer.eos_token_ids)
    rows = {mode: [] for mode in MODES}
    session = None
    for r in range(runs):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:  # interleaved
            row, s = run(mode, lm, models, translators, prompt, n, stop)
            rows[mode].append(row)
            session = s or session
            if row["total_s"] > TOO_LONG_S:
                print(f"{label}: one {mode} run took {row['total_s']:.0f} s, skipped")
                return None
    med = {mode: {k: min(x[k] for x in rs) for k in rs[0]}
           for mode, rs in rows.items()}
    line = session.lines[lm.name]
    ref = med["stream_generate"]
    result = {
        "model": label, "receivers": session.receivers(lm.name), "prompt_tokens": len(prompt),
        "generated": {m: int(v["tokens"]) for m, v in med.items()}, "best": med,
        "ratio": {k: med["session"][k] / ref[k]
                  for k in ("prefill_s", "decode_ms_per_token", "total_s")},
        "recorded_objects": len(session.selection(lm.name)),
        "recorded_bytes_per_token": line.bytes_per_token,
        "all_objects_bytes_per_token": everything_bytes_per_token(lm, prompt),
    }
    print(f"{label:>22s}  prefill {ref['prefill_s']:.3f} s -> {med['session']['prefill_s']:.3f} s"
          f" ({result['ratio']['prefill_s']:.3f}x)   decode {ref['decode_ms_per_token']:.2f} ms"
          f" -> {med['session']['decode_ms_per_token']:.2f} ms"
          f" ({result['ratio']['decode_ms_per_token']:.3f}x)   total"
          f" {result['ratio']['total_s']:.3f}x   records {line.bytes_per_token:,.0f} B/token"
          f" (all: {result['all_objects_bytes_per_token']:,.0f})", flush=True)
    return result


def dtype_of(model) -> str:
    return str(tree_flatten(model.parameters())[0][1].dtype).removeprefix("mlx.core.")


def zoo_rows(prompt_len: int, n: int, runs: int) -> list[dict]:
    text = FILLER_FILE.read_text()
    out = []
    for name, targets in ZOO.items():
        lm = kv.load(name)
        models, translators = {name: lm}, {}
        for target in targets:
            path = artifact.shipped(name, target)
            if path is None:
                continue
            models[target] = kv.load(target)
            translators[(name, target)] = kv.load_translator(path, lm, models[target])
        prompt = lm.tokenizer.encode(text)[:prompt_len]
        row = measure(name, lm, models, translators, prompt, n, runs)
        if row:
            out.append({**row, "kind": "zoo", "dtype": dtype_of(lm.model)})
    return out


def realistic_rows(prompt_len: int, n: int, runs: int) -> list[dict]:
    """Random weights at real checkpoints' per-layer sizes (vocabulary 4,096, the zoo's, so the
    zoo model's tokenizer serves stream_generate), with a translator of the right shapes."""
    from mlx_kvtrans.timing import shaped_translator
    from mlx_kvtrans.models import LoadedModel
    from mlx_kvtrans.training.plan import plan
    from mlx_kvtrans.zoo.families import realistic_config
    from mlx_kvtrans.zoo.random_model import build_model

    out = []
    for i, (name, target) in enumerate(REALISTIC.items()):
        tokenizer = kv.load(name).tokenizer
        lms = [LoadedModel(f"realistic-{n_}", Path("."), build_model(
            realistic_config(n_, vocab_size=4096), seed=i + j), tokenizer, {})
            for j, n_ in enumerate((name, target))]
        src, tgt = lms
        specs = plan(kv.layout_of(src.model), kv.layout_of(tgt.model))
        translator = shaped_translator(src.model, tgt.model, specs)
        prompt = mx.random.randint(0, 4096, (prompt_len,), key=mx.random.key(i)).tolist()
        row = measure(src.name, src, {src.name: src, tgt.name: tgt},
                      {(src.name, tgt.name): translator}, prompt, n, runs)
        if row:
            out.append({**row, "kind": "realistic", "dtype": "float32"})
        del lms, src, tgt, translator
        mx.clear_cache()
    return out


def write_markdown(result: dict) -> str:
    lines = ["# Session decoding versus mlx-lm\n",
             "`Session.generate` (mlx-lm's `generate_step`, the recording taps of the model's "
             "shipped outgoing translators installed once per turn) against "
             "`mlx_lm.stream_generate` and bare `generate_step` on the same model and prompt: "
             f"{result['prompt_tokens']}-token prompt, {result['tokens']} generated tokens (fewer "
             f"where the model stops), best of {result['runs']} interleaved runs (the least time of each). Ratios are "
             "session / stream_generate. `records` is what the session records per token; `all` "
             "is recording every object at (1) and (2), as it did before it recorded only what "
             "its translators read. Regenerate with `python research/session_decode.py`.\n",
             f"BLAS: {result['blas']}; dtype: float32; {result['machine']}. generate_step and "
             "stream_generate do the same work: the spread between their columns is this "
             "machine's timing noise.\n",
             "| model | translators to | tokens | prefill s (stream / session) | ratio | decode "
             "ms/token (generate_step / stream / session) | ratio | total ratio | records "
             "B/token | all B/token |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        m = r["best"]
        lines.append(
            f"| {r['model']} | {', '.join(Path(x).name for x in r['receivers'])} | "
            f"{r['generated']['session']} | {m['stream_generate']['prefill_s']:.3f} / "
            f"{m['session']['prefill_s']:.3f} | "
            f"{r['ratio']['prefill_s']:.3f} | {m['generate_step']['decode_ms_per_token']:.2f} / "
            f"{m['stream_generate']['decode_ms_per_token']:.2f} / "
            f"{m['session']['decode_ms_per_token']:.2f} | {r['ratio']['decode_ms_per_token']:.3f} "
            f"| {r['ratio']['total_s']:.3f} | {r['recorded_bytes_per_token']:,.0f} | "
            f"{r['all_objects_bytes_per_token']:,.0f} |")
    for s in result["skipped"]:
        lines.append(f"\nSkipped: {s}")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--no-realistic", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    rows, skipped = zoo_rows(args.prompt, args.tokens, args.runs), []
    if not args.no_realistic:
        try:
            rows += realistic_rows(args.prompt, args.tokens, args.runs)
        except ImportError as err:  # the shaped translator lives in mlx_kvtrans.timing
            skipped.append(f"realistic models ({err})")
    measured = {r["model"] for r in rows}
    skipped += [f"{m} (one run took over {TOO_LONG_S:.0f} s)" for m in
                list(ZOO) + [f"realistic-{m}" for m in REALISTIC]
                if m not in measured and not (args.no_realistic and m.startswith("realistic"))]
    result = {"blas": f"{blas.BLAS_NAME} ({blas.BLAS_PATH})", "dtype": "float32",
              "machine": f"{platform.machine()}, {platform.system()}",
              "prompt_tokens": args.prompt, "tokens": args.tokens, "runs": args.runs,
              "minutes": round((time.perf_counter() - started) / 60, 1), "rows": rows,
              "skipped": skipped}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "session_decode.json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = write_markdown(result)
    (OUT / "session_decode.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
