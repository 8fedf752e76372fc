"""`kvtrans plan`: what fitting and using a translator would cost, from two configs."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from .common import FIT, app, finite, out, text_files, user_errors
from .translators import (CAPTURE_HELP, FEATURES_HELP, IDENTITY_HELP, JSON_HELP, NU_HELP,
                          RANDOM_FEATURES_HELP, RANDOM_LAYERS_HELP, RECIPE_HELP, WIDTH_HELP,
                          fit_config, random_layer_list)


@app.command("plan")
@user_errors
def plan_command(source: str = typer.Option(..., "--from", help="source: zoo alias, directory, "
                                            "HF id or config.json"),
                 target: str = typer.Option(..., "--to", help="target: same forms"),
                 capture_point: int = typer.Option(int(FIT.point), "--capture", min=1, max=3,
                                                   help=CAPTURE_HELP),
                 nu: int = typer.Option(FIT.nu, "--nu", min=1, help=NU_HELP),
                 features: str = typer.Option(FIT.features, help=FEATURES_HELP),
                 width: int = typer.Option(FIT.width, min=0, help=WIDTH_HELP),
                 recipe: list[str] = typer.Option(None, help=RECIPE_HELP),
                 token_identity: str = typer.Option(FIT.token_identity, help=IDENTITY_HELP),
                 random_features: int = typer.Option(FIT.random_features, min=0,
                                                     help=RANDOM_FEATURES_HELP),
                 random_layers: str = typer.Option(None, help=RANDOM_LAYERS_HELP),
                 tokens: int = typer.Option(FIT.windows * FIT.length, min=1,
                                            help="fitting tokens to project the time for"),
                 machine_name: str = typer.Option(None, "--machine", help="plan for this Mac "
                                                  "(m3-ultra) instead of this machine"),
                 memory: str = typer.Option(None, help="the machine's memory, e.g. 512GiB"),
                 matmul_tflops: float = typer.Option(None, min=0.001, callback=finite,
                                                     help="its matmul rate, TFLOP/s"),
                 bandwidth: float = typer.Option(None, min=0.001, callback=finite,
                                                 help="its memory bandwidth, GB/s"),
                 data: Path = typer.Option(None, help="the text `kvtrans fit --data` will read "
                                           "(a file or a directory): read as the fit reads it, "
                                           "so the fit finds it tokenized, and refused if it "
                                           "holds less than one window"),
                 as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """What fitting and using a translator would cost, from the two configs alone: per shared
    feature set its moment matrices, per map its parameters, the projected fit time and memory
    on this machine (or the one named), and per switch the translation FLOPs and bytes."""
    from mlx_kvtrans.training.fit_time import fit_time, refuse_a_fit_too_long
    from mlx_kvtrans.training.machines import machine_for
    from mlx_kvtrans.models import load_config_only
    from mlx_kvtrans.training.cost import fits
    from mlx_kvtrans.training.workflows import for_pair, plan_and_cost, refuse_unless_it_fits

    config = fit_config(capture_point, nu, features, width, recipe, token_identity,
                         random_features=random_features,
                         random_layers=random_layer_list(random_layers, random_features, target))
    machine = machine_for(machine_name, memory, matmul_tflops, bandwidth)
    src, tgt = load_config_only(source), load_config_only(target)
    config = for_pair(src, tgt, config)
    _, cost = plan_and_cost(src, tgt, config, machine)
    data_tokens = None
    if data is not None:
        from mlx_kvtrans.training.workflows import fitting_text_tokens

        data_tokens = fitting_text_tokens(src, text_files("--data", data, "train"), config)
    timed = fit_time(src, tgt, cost, config, tokens, timed=machine.measured)
    refuse_a_fit_too_long(timed, tokens)
    if as_json:
        print(json.dumps({"source": source, "target": target, "config": config.to_json(),
                          "machine": vars(machine), "fit_tokens": tokens,
                          "data_tokens": data_tokens,
                          "fit_seconds": timed.seconds, "fit_time": timed.to_json(),
                          "fits": fits(cost), **cost.to_json()}, indent=2, default=str))
    else:
        _print_plan(f"{source} -> {target} · features {features}"
                    + (f", width {width}" if width else "")
                    + f" · token identity {token_identity}"
                    + (f" · --data {data_tokens:,} tokens" if data_tokens else ""),
                    cost, tokens, timed, machine)
    refuse_unless_it_fits(src, tgt, config, cost, machine)  # exit 2, naming a design that fits


def _print_plan(title: str, cost, tokens: int, timed, machine) -> None:
    from mlx_kvtrans.training.cost import fits, format_duration, gib

    table = Table(title=title, title_justify="left")
    for col in ("source layers read", "features", "outputs", "maps", "moments"):
        table.add_column(col, justify="right")
    for f in cost.feature_sets:
        table.add_row(",".join(map(str, f.sources)), f"{f.inputs:,}", f"{f.outputs:,}",
                      str(f.maps), gib(f.moments_bytes))
    out.print(table)
    by_recipe: dict[str, list] = {}
    for m in cost.maps:
        by_recipe.setdefault(m.recipe, []).append(m)
    for name, maps in by_recipe.items():
        out.print(f"{name}: {len(maps)} objects, {sum(m.parameters for m in maps):,} parameters")
    how = "timed here" if timed.measured else f"projected at {cost.gflops / 1000:,.1f} TFLOP/s"
    out.print(f"on {machine.name} ({machine.source})", highlight=False)
    out.print(f"fit ({tokens:,} tokens and the gate's calibration, {how}): about "
              f"{format_duration(timed.seconds)}, peak about {gib(cost.fit_peak_bytes)} "
              f"(moments {gib(cost.moments_bytes)}, weights {gib(cost.weights_bytes)}) of "
              f"{gib(cost.machine_bytes)}: {'it fits' if fits(cost) else 'it does not fit'}")
    for n, row in cost.lengths.items():
        out.print(f"switch at {n:,} tokens: {row['flops'] / 1e9:.1f} GFLOP, "
                  f"{row['bytes'] / 2**20:.0f} MiB installed; translation + install at "
                  f"the machine's peak: {row['seconds_at_peak'] * 1000:.0f} ms (the target's "
                  "first decode step adds to it)")
