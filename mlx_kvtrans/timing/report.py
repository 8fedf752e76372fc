"""A `kvtrans bench` result: one run of `bench_switch` with its setting, written as JSON and a
PNG, and shown as a table.

`switch_report` is the library call behind the command: it times a loaded pair (or a
realistic one, with its fit record) and returns the result the command prints and writes.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from ..backend.blas import blas_report
from ..models import LoadedModel, cast_parameters
from ..models import input_embedding
from ..translators.translator import Translator
from .switch import QUICK_RUNS, QUICK_S, BenchConfig, bench_switch


def switch_report(translator: Translator, source: LoadedModel, target: LoadedModel,
                  config: BenchConfig, fit_record: dict | None = None, progress=None,
                  fresh=None) -> dict:
    """Time `source` -> `target` cast to `config.dtype` (default float32) at each prompt
    length: the result a `kvtrans bench` run writes (`config.label`: the pair's name in it,
    default the models' names; `config.vocab`: the token ids prompts draw from, default the
    source tokenizer's (its embedding's rows without one); `fit_record`: a realistic
    pair's fit, kept with its translator's features; `fresh()`: the translator as a user's
    first switch loads it, for the cold switch)."""
    dtype = config.dtype or "float32"
    for lm in (source, target):
        cast_parameters(lm.model, getattr(mx, dtype))
    label = config.label or f"{Path(source.name).name}__{Path(target.name).name}"
    vocab = config.vocab or (len(source.tokenizer.get_vocab()) if source.tokenizer is not None
                             else input_embedding(source.model).weight.shape[0])
    blas = blas_report(measure=False)  # the peak is measured beside each row, in `dtype`
    rows = bench_switch(translator, source.model, target.model,
                        replace(config, vocab=vocab, dtype=dtype),
                        progress=progress, fresh=fresh,
                        text_ids=held_out_ids(target if translator.across_tokenizers else
                                              source, max(config.lengths)))
    result = {"pair": label, "source": source.name, "target": target.name, "dtype": dtype,
              "device": str(mx.default_device()), "blas": blas.name,
              "matmul_peak_gflops": round(statistics.median(r.matmul_peak_gflops for r in rows), 1),
              "memory_bandwidth_gbs": round(statistics.median(r.bandwidth_gbs for r in rows), 1),
              "repeats": config.repeats, "quick": {"seconds": QUICK_S, "runs": QUICK_RUNS},
              "rows": [r.to_json() for r in rows]}
    if fit_record is not None:
        result["fit"] = {**fit_record, "features": translator.info["features"],
                         "token_identity": translator.token_identity}
    return result


def held_out_ids(model: LoadedModel, length: int) -> list[int] | None:
    """The first `length` tokens of the zoo corpus's held-out test split in `model`'s tokenizer
    (None without a tokenizer or the split)."""
    from ..models import held_out_split
    from ..tokens import encode_file

    path = held_out_split("test")
    if model.tokenizer is None or path is None:
        return None
    ids = encode_file(model.tokenizer, path)
    return ids[:length] if len(ids) >= length else None


def write_report(result: dict, out_dir: Path) -> tuple[Path, Path | None]:
    """The result's JSON and PNG (None when matplotlib is absent) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{result['pair']}-{result['dtype']}"
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    return json_path, plot_switch(result, out_dir / f"{stem}.png")


def runs_of(result: dict) -> str:
    """How many runs each timing of a result took the median of."""
    quick = result.get("quick")
    if not quick:  # written before short timings were repeated more
        return f"{result['repeats']} runs"
    return (f"{result['repeats']} runs or more (up to {quick['runs']} within "
            f"{quick['seconds']:g} s)")


def report_table(result: dict) -> tuple[str, list[str], list[list[str]], list[str]]:
    """(title, columns, rows, notes) of a result, as `kvtrans bench` prints it."""
    rows = result["rows"]
    chunked = any(r["reread_chunked_s"] is not None for r in rows)
    gated = any(r["gated_switch_s"] is not None for r in rows)
    title = (f"TTFT after a switch · {result['pair']} · {result['dtype']} · {result['blas']} "
             f"({result['matmul_peak_gflops']:.0f} GFLOP/s peak, "
             f"{result['memory_bandwidth_gbs']:.0f} GB/s) · median of {runs_of(result)}")
    columns = ["tokens", "re-reading", *(["re-reading chunked"] if chunked else []),
               "warm switch", "speed-up", "bound", "warm / bound",
               *(["gated switch", "speed-up"] if gated else []), "cold switch", "speed-up",
               "translate GFLOP/s", "extra peak MB switch / prefill"]

    def ms(seconds):
        return f"{seconds * 1000:.1f} ms" if seconds is not None else "-"

    cells = []
    for r in rows:
        gated_cells = [ms(r["gated_switch_s"]), f"x{r['speedup_gated']:.1f}"
                       if r["speedup_gated"] is not None else "-"]
        cells.append([str(r["length"]), ms(r["reread_s"]),
                      *([ms(r["reread_chunked_s"])] if chunked else []),
                      ms(r["warm_switch_s"]), f"x{r['speedup_warm']:.1f}", ms(r["bound_s"]),
                      f"x{r['warm_over_bound']:.1f}", *(gated_cells if gated else []),
                      ms(r["cold_switch_s"]), f"x{r['speedup_cold']:.2f}",
                      f"{r['translate_gflops']:.1f} "
                      f"({100 * r['translate_gflops'] / r['matmul_peak_gflops']:.0f}%)",
                      f"{r['peak_mb_switch']:.0f} / {r['peak_mb_reread']:.0f}"])
    notes = ["bound = first decode step on the installed cache + translation FLOPs at the "
             "matmul peak + installed bytes at the memory bandwidth, measured beside each row",
             "cold switch = a user's first: the translator loaded, then its first translation "
             "(the source has read the prompt)"]
    if gated:
        read = [r.get("gated_read") or r["gate_tokens"] for r in rows]
        what = str(read[0]) if len(set(read)) == 1 else " / ".join(map(str, read))
        notes.append("gated switch = what a session does (the same switch): all but the "
                     f"last {what} tokens translated (the gate's tail, or the fidelity dial's "
                     "default R where it is longer), the target reads those itself and the "
                     "fidelity gate compares its NLL on the last of them with the source's, "
                     "then the first token")
        notes += [f"{r['length']} tokens: the gated switch did not translate ({outcome}); its "
                  f"time is a full re-read's" for r in rows
                  if (outcome := r.get("gated_outcome")) and not outcome.startswith("applied")]
    notes.append(f"prompts: {rows[0].get('prompt', 'random ids')}")
    if "fit" in result:
        notes.append(f"translator fitted in closed form here: {describe_fit(result['fit'])}")
    return title, columns, cells, notes


def describe_fit(f: dict) -> str:
    """One line for a `realistic_fit` record: measured here, and projected to the full models."""
    projected = f.get("projected_peak_memory_bytes")
    line = (f"{f['fit_tokens']:,} tokens in {f['fit_seconds']:.1f} s, peak "
            f"{f['fit_peak_memory_bytes'] / 2**30:.1f} GiB"
            + (f" (projected {projected / 2**30:.1f} GiB)" if projected else "")
            + f", moments {f['fit_moments_bytes'] / 2**20:.0f} MiB")
    if "full" in f:
        g = f["full"]
        line += (f"; projected to the full checkpoints ({' -> '.join(g['models'])}, "
                 f"{g['layers'][0]} -> {g['layers'][1]} layers): moments "
                 f"{g['moments_bytes'] / 2**30:.2f} GiB, peak without weights "
                 f"{g['fit_peak_bytes_without_weights'] / 2**30:.1f} GiB, "
                 f"{g['fit_seconds_per_million_tokens'] / 3600:.1f} h per million fitting "
                 f"tokens on this machine + {g['solve_seconds']:.0f} s solve, "
                 f"{g['translation_flops_per_token'] / 1e6:.0f} MFLOP per translated token "
                 "(the full configs' FFNs are dense)")
    return line


def plot_switch(result: dict, path: Path) -> Path | None:
    """A PNG of a `kvtrans bench` result (None when matplotlib is absent)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["rows"]
    x = [r["length"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("reread_s", "re-reading"),
                       ("reread_chunked_s", "re-reading (chunked recurrence)"),
                       ("cold_switch_s", "cold switch"),
                       ("warm_switch_s", "warm switch (translate)"),
                       ("gated_switch_s", "gated switch (translate, read the last r, gate)")):
        if all(r.get(key) is not None for r in rows):
            ax.plot(x, [r[key] * 1000 for r in rows], marker="o", label=label)
    if all("bound_s" in r for r in rows):
        ax.plot(x, [r["bound_s"] * 1000 for r in rows], linestyle="--", color="gray",
                label="bound (step + FLOPs at peak + bytes at bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"{result['pair']} · {result['dtype']} · {result['blas']}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
