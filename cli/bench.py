"""`kvtrans bench`: time to first token after a switch against re-reading, beside its bound."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Column, Table

from mlx_kvtrans.errors import KvtransError

from .common import (app, default_translator, int_list, load_translator_pair, model_configs,
                     out, output_dir, position_limit, progress_bar, translator_models,
                     user_errors)


@app.command()
@user_errors
def bench(source: str = typer.Option(None, "--from", help="default: the translator's source, "
                                      "else kimi-linear"),
          target: str = typer.Option(None, "--to", help="default: the translator's target, "
                                     "else kimi-vl"),
          translator_dir: Path = typer.Option(None, "--translator", help="a directory or a "
                                              "shipped name (default: the shipped FROM -> TO)"),
          realistic: str = typer.Option(None, help="time random models with real per-layer "
                                        "sizes instead: kimi, qwen3.5 or dsa"),
          token_identity: str = typer.Option("ids", help="--realistic: the fitted "
                                             "translator's token identity, ids or off"),
          lengths: str = typer.Option("1024,2048,4096", help="prompt lengths (comma-separated)"),
          repeats: int = typer.Option(3, min=1, help="timed runs per measurement, at least "
                                      "(the median; up to 25 within a second for runs of "
                                      "milliseconds)"),
          dtype: str = typer.Option("float32", help="float32 or bfloat16 (bf16 is far slower on a "
                                    "CPU; Macs run it)"),
          out_dir: Path = typer.Option(None, help="write the JSON and PNG here"),
          as_json: bool = typer.Option(False, "--json", help="print the result as JSON")):
    """Time to first token after a switch (warm, cold, gated) versus re-reading on the target,
    and the bound a warm switch could reach here (see mlx_kvtrans.timing)."""
    from mlx_kvtrans.timing import BenchConfig, report_table, switch_report, write_report
    from mlx_kvtrans.translators import artifact
    from mlx_kvtrans.zoo.realistic import realistic_configs, realistic_pair

    if dtype not in ("float32", "bfloat16", "float16"):
        raise KvtransError("--dtype must be float32, bfloat16 or float16")
    int_list("--lengths", lengths, 2)  # the form first: the models' limit needs their configs
    if token_identity not in ("ids", "off"):
        raise KvtransError("--token-identity must be ids or off")
    if out_dir is not None:
        output_dir("--out-dir", out_dir)
    if realistic:
        configs = realistic_configs(realistic)
    else:
        if translator_dir is not None:
            source, target = translator_models(translator_dir, source, target)
        source, target = source or "kimi-linear", target or "kimi-vl"
        path = translator_dir or default_translator(source, target)
        if path is None:
            raise KvtransError(f"no translator {source} -> {target}: give --translator DIR "
                               "(kvtrans fit makes one) or use --realistic")
        configs = model_configs(source, target)
    sizes = int_list("--lengths", lengths, 2, position_limit(configs))
    if realistic:
        with progress_bar(f"realistic {realistic}: closed-form fit") as progress:
            translator, src, tgt, fit = realistic_pair(realistic, dtype, token_identity, progress)
    else:
        (translator, src, tgt), fit = load_translator_pair(path, source, target), None
    with progress_bar("bench") as progress:
        fresh = None if realistic else (lambda: artifact.load(path, src, tgt))
        config = BenchConfig(sizes, repeats, dtype=dtype,
                             label=realistic and f"realistic-{realistic}")
        result = switch_report(translator, src, tgt, config, fit_record=fit, progress=progress,
                               fresh=fresh)
    written = write_report(result, out_dir) if out_dir is not None else None
    if as_json:
        print(json.dumps(result, indent=2))
        return
    title, columns, rows, notes = report_table(result)
    table = Table(*(Column(c, justify="right") for c in columns), title=title, title_justify="left")
    for row in rows:
        table.add_row(*row)
    out.print("\n".join(notes), table, sep="\n")
    out.print("[dim]pass --out-dir DIR to keep the JSON and PNG[/]" if written is None else
              f"wrote {written[0]}" + (f" and {written[1]}" if written[1] else
                                       " (no plot: pip install matplotlib)"))
