"""`kvtrans inspect`, `verify`, `doctor`: a checkpoint's cache objects, proof that capture and
install are exact on it, and this machine."""

from __future__ import annotations

import json

import typer

import mlx_kvtrans
from mlx_kvtrans.tools.audit import STORAGE_NOTE

from .common import (JSON_HELP, FitTable, app, format_bytes, format_shape, in_range,
                     model_configs, out, position_limit, user_errors)


def _size(obj) -> str:
    return (f"{format_bytes(obj.bytes_per_token)}/token" if obj.per_token
            else format_bytes(obj.fixed_bytes))


def _layer_runs(layout):
    """Consecutive layers with identical objects, so a 61-layer model prints in a few rows."""
    runs = []
    for layer in layout.layers:
        key = (layer.mixer, tuple(o.to_json().__repr__() for o in layer.objects))
        if runs and runs[-1][0] == key:
            runs[-1][2] = layer.index
        else:
            runs.append([key, layer.index, layer.index, layer])
    return [(first, last, layer) for _, first, last, layer in runs]



@app.command()
@user_errors
def inspect(model: str = typer.Argument(..., help="zoo alias, model directory or HF id"),
            as_json: bool = typer.Option(False, "--json",
                                         help="one JSON entry per layer and object")):
    """Show every cache object of every layer: kind, shape, rotation, capture points, bytes."""
    lm = mlx_kvtrans.load(model)
    layout = mlx_kvtrans.layout_of(lm.model)
    if as_json:
        print(json.dumps({"model": model, "path": str(lm.path), **layout.to_json()}, indent=2))
        return
    # Each run of identical layers heads its objects (layers, mixer), and a dtype the whole
    # model shares goes in the title: 80 columns hold the rest.
    dtypes = {o.dtype for layer in layout.layers for o in layer.objects}
    shared = f"  ·  {dtypes.pop()}" if len(dtypes) == 1 else ""
    table = FitTable(f"{model}  ·  {layout.model_type}  ·  {layout.family}{shared}")
    for col in ("object", "kind", "engine shape", *(() if shared else ("dtype",)), "rotation",
                "points"):
        table.add_column(col)
    table.add_column("size", right=True)
    for first, last, layer in _layer_runs(layout):
        span = f"layer {first}" if first == last else f"layers {first}-{last}"
        table.add_row(span, layer.mixer, style="bold")
        for obj in layer.objects:
            table.add_row(obj.name, obj.kind.value, format_shape(obj.engine_shape),
                          *(() if shared else (obj.dtype,)), obj.rotation.describe(),
                          ",".join(map(str, obj.capture_points)), _size(obj))
    out.print(table)
    out.print(f"[bold]{len(layout.layers)} layers[/]  ·  "
              f"{format_bytes(layout.bytes_per_token)} per token"
              f"  ·  {format_bytes(layout.fixed_bytes)} fixed  ·  capture points: "
              + "; ".join(f"({k}) {v}" for k, v in mlx_kvtrans.layouts.CAPTURE_POINTS.items()))
    out.print(f"{STORAGE_NOTE}; `kvtrans audit {model}` measures how well")


@app.command()
@user_errors
def verify(model: str = typer.Argument(..., help="zoo alias, model directory or HF id"),
           prefix: int = typer.Option(None, min=2,
                                      help="prompt length (default: 64, or beyond index_topk)"),
           as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """Prove capture -> install, raw/normed -> engine conversion and replay exact on this
    checkpoint."""
    from mlx_kvtrans.tools.verify import CONTINUATION, checks_to_json, run_checks

    if prefix is not None:
        in_range("--prefix", prefix, 2, position_limit(model_configs(model), CONTINUATION,
                                                        "the continuation"))
    lm = mlx_kvtrans.load(model)
    checks = run_checks(lm.model, lm.tokenizer, prefix=prefix, model_name=str(lm.path))
    result = checks_to_json(checks)
    if as_json:
        print(json.dumps({"model": model, **result}, indent=2))
    else:
        table = FitTable(f"verify {model}")
        for col in ("check", "max |diff|", "tolerance", "result"):
            table.add_column(col, right=col != "check")
        for c in checks:
            table.add_row(c.name + (f"  [dim]{c.detail}[/]" if c.detail else ""),
                          f"{c.max_abs_diff:.2e}", f"{c.tolerance:.1e}",
                          "[green]pass[/]" if c.passed else "[bold red]FAIL[/]")
        out.print(table)
        out.print("[green]all checks passed[/]" if result["passed"] else
                  "[bold red]some checks failed[/]")
    if not result["passed"]:
        raise typer.Exit(1)


@app.command()
@user_errors
def doctor(as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """MLX version, device, Metal kernels, measured matmul throughput and the BLAS in use."""
    from mlx_kvtrans.tools.doctor import diagnose

    report = diagnose()
    if as_json:
        print(json.dumps(report, indent=2))
        return
    table = FitTable(show_header=False)
    table.add_column()
    table.add_column()
    for key, value in report.items():
        if isinstance(value, dict):  # per row count: "1 / 9 / 16 rows: a / b / c ms"
            value = (f"{' / '.join(value)} rows: {' / '.join(map(str, value.values()))} ms")
        if key != "fix":
            table.add_row(key, str(value))
    out.print(table)
    if report["fix"]:
        out.print(f"[bold yellow]MLX runs on the slow reference BLAS.[/] Fix: {report['fix']}")
