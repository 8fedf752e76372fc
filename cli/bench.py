"""`kvtrans bench`: time to first token after a switch against re-prefill, beside its bound."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from mlx_kvtrans.errors import KvtransError

from .common import (_default_translator, _load_translator_pair, app, int_list, model_configs,
                     out, output_dir, position_limit, progress_bar, translator_models,
                     user_errors)


@app.command()
@user_errors
def bench(source: str = typer.Option(None, "--from", help="default: the translator's source, "
                                      "else kimi-linear"),
          target: str = typer.Option(None, "--to", help="default: the translator's target, "
                                     "else kimi-vl"),
          translator_dir: Path = typer.Option(None, "--translator",
                                              help="a directory or a shipped name (default: "
                                              "the shipped FROM -> TO)"),
          realistic: str = typer.Option(None, help="time random models with real per-layer "
                                        "sizes instead: kimi, qwen3.5 or dsa"),
          token_identity: str = typer.Option("ids", help="--realistic: the fitted "
                                             "translator's token identity, ids or off"),
          lengths: str = typer.Option("1024,2048,4096", help="prompt lengths (comma-separated)"),
          repeats: int = typer.Option(3, min=1),
          dtype: str = typer.Option("float32", help="float32 or bfloat16 (bf16 is ~8x slower on "
                                    "a CPU; Macs run it)"),
          out_dir: Path = typer.Option(None, help="write the JSON and PNG here (default: "
                                       "print only)"),
          as_json: bool = typer.Option(False, "--json")):
    """Time to first token after a switch (warm, cold) versus re-prefill on the target, and the
    bound a warm switch could reach here (see mlx_kvtrans.bench)."""
    import statistics

    import mlx.core as mx

    from mlx_kvtrans.bench import bench_switch, describe_fit, plot_switch, realistic_pair
    from mlx_kvtrans.blas import blas_report
    from mlx_kvtrans.models import cast_parameters
    from mlx_kvtrans.zoo.families import REALISTIC_PAIRS, realistic_config

    if dtype not in ("float32", "bfloat16", "float16"):
        raise KvtransError("--dtype must be float32, bfloat16 or float16")
    int_list("--lengths", lengths, 2)  # the form first: the models' limit needs their configs
    if token_identity not in ("ids", "off"):
        raise KvtransError("--token-identity must be ids or off")
    if out_dir is not None:
        output_dir("--out-dir", out_dir)
    if realistic:
        if realistic not in REALISTIC_PAIRS:
            raise KvtransError(f"--realistic takes {', '.join(REALISTIC_PAIRS)}, not "
                               f"{realistic!r}")
        configs = {n: realistic_config(n, vocab_size=4096) for n in REALISTIC_PAIRS[realistic]}
    else:
        if translator_dir is not None:
            source, target = translator_models(translator_dir, source, target)
        source, target = source or "kimi-linear", target or "kimi-vl"
        path = translator_dir or _default_translator(source, target)
        if path is None:
            raise KvtransError(f"no translator {source} -> {target}: give --translator DIR "
                               "(kvtrans fit makes one) or use --realistic")
        configs = model_configs(source, target)
    sizes = int_list("--lengths", lengths, 2, position_limit(configs))
    fit_record = None
    if realistic:
        with progress_bar(f"realistic {realistic}: closed-form fit") as progress:
            src, tgt, translator, fit_record = realistic_pair(realistic, getattr(mx, dtype),
                                                              token_identity, progress)
        label = f"realistic-{realistic}"
        vocab = 4096
    else:
        translator, src, tgt = _load_translator_pair(path, source, target)
        for lm in (src, tgt):
            cast_parameters(lm.model, getattr(mx, dtype))
        label = f"{Path(src.name).name}__{Path(tgt.name).name}"
        vocab = len(src.tokenizer.get_vocab())
    blas = blas_report(measure=False)  # the peak is measured beside each row, in `dtype`
    with progress_bar(f"bench {label}") as progress:
        rows = bench_switch(translator, src.model, tgt.model, sizes, repeats, vocab,
                            dtype=getattr(mx, dtype), progress=progress)
    peak = statistics.median(r.matmul_peak_gflops for r in rows)
    bandwidth = statistics.median(r.bandwidth_gbs for r in rows)
    result = {"pair": label, "source": src.name, "target": tgt.name, "dtype": dtype,
              "device": str(mx.default_device()), "blas": blas.name,
              "matmul_peak_gflops": round(peak, 1), "memory_bandwidth_gbs": round(bandwidth, 1),
              "repeats": repeats, "rows": [r.to_json() for r in rows]}
    if fit_record is not None:
        result["fit"] = {**fit_record, "features": translator.info["features"],
                         "token_identity": translator.token_identity}
    json_path = plot = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path = out_dir / f"bench-{label}-{dtype}.json"
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        plot = plot_switch(result, out_dir / f"bench-{label}-{dtype}.png")
    if as_json:
        print(json.dumps(result, indent=2))
        return
    chunked = any(r.reprefill_chunked_s is not None for r in rows)
    gated = any(r.gated_switch_s is not None for r in rows)
    table = Table(title=f"TTFT after a switch · {label} · {dtype} · {blas.name} "
                        f"({peak:.0f} GFLOP/s peak, {bandwidth:.0f} GB/s) · median of {repeats}",
                  title_justify="left")
    for col in ("tokens", "re-prefill", *(["re-prefill chunked"] if chunked else []),
                "warm switch", "speed-up", "bound", "warm / bound",
                *(["gated switch", "speed-up"] if gated else []), "cold switch", "speed-up",
                "translate GFLOP/s", "extra peak MB switch / prefill"):
        table.add_column(col, justify="right")
    for r in rows:
        chunked_cell = ([f"{r.reprefill_chunked_s * 1000:.1f} ms"
                         if r.reprefill_chunked_s is not None else "-"] if chunked else [])
        table.add_row(str(r.length), f"{r.reprefill_s * 1000:.1f} ms", *chunked_cell,
                      f"{r.warm_switch_s * 1000:.1f} ms", f"x{r.speedup_warm:.1f}",
                      f"{r.bound_s * 1000:.1f} ms", f"x{r.warm_over_bound:.1f}",
                      *([f"{r.gated_switch_s * 1000:.1f} ms", f"x{r.speedup_gated:.1f}"]
                        if r.gated_switch_s is not None else ["-", "-"]) if gated else [],
                      f"{r.cold_switch_s * 1000:.1f} ms", f"x{r.speedup_cold:.2f}",
                      f"{r.translate_gflops:.1f} "
                      f"({100 * r.translate_gflops / r.matmul_peak_gflops:.0f}%)",
                      f"{r.peak_mb_switch:.0f} / {r.peak_mb_reprefill:.0f}")
    out.print("bound = first decode step on the installed cache + translation FLOPs at the "
              "matmul peak + installed bytes at the memory bandwidth, measured beside each row")
    if gated:
        out.print(f"gated switch = what a session does: all but the last {rows[0].gate_tokens} "
                  "tokens translated, the target reads those itself and the fidelity gate "
                  "compares its NLL on them with the source's, then the first token")
    if fit_record is not None:
        out.print(f"translator fitted in closed form here: {describe_fit(fit_record)}")
    out.print(table)
    if json_path is None:
        out.print("[dim]pass --out-dir DIR to keep the JSON and PNG[/]")
    else:
        out.print(f"wrote {json_path}" + (f" and {plot}" if plot else " (no plot: pip install "
                                                                      "matplotlib)"))
