"""`kvtrans plan`, `fit`, `distill`: what a translator costs, stage 1 in closed form, stage 2 by
KL distillation."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

import mlx_kvtrans
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.gate import WINDOWS
from mlx_kvtrans.translators.fit import FitConfig

from .common import (DISTILL, FIT, SEEDS, DistillConfig, Limit, _load_translator_pair,
                     _same_tokenizer, app, finite, in_range, key_values, model_configs, out,
                     output_dir, position_limit, positive, read_texts, text_file, text_files,
                     token_ids, translator_models, user_errors)


def _fit_config(capture_point: int, nu: int, features: str, width: int, recipe: list[str],
                token_identity: str, **more) -> FitConfig:
    """The FitConfig `plan` and `fit` build from their options, each name checked."""
    from mlx_kvtrans.translators.plan import FEATURES
    from mlx_kvtrans.translators.token_identity import MODES

    if token_identity not in MODES:
        raise KvtransError(f"--token-identity must be {', '.join(MODES)}, not {token_identity!r}")
    if features not in FEATURES:
        raise KvtransError(f"--features must be {', '.join(FEATURES)}, not {features!r}")
    return FitConfig(point=capture_point, nu=nu, features=features, width=width,
                     recipes=key_values("--recipe", recipe, "recurrent_state=bilinear"),
                     token_identity=token_identity, **more)


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

    config = _fit_config(capture_point, nu, features, width, recipe, token_identity)
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
        validation: Path = typer.Option(None, help="held-out text the fidelity gate is "
                                        "calibrated on (default: the zoo corpus's validation "
                                        "split)"),
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
        identity_tables: int = typer.Option(FIT.identity_tables, min=0,
                                            help="R > 0: every map adds rank-R per-token "
                                            "tables of the ids at t and t-1 (needs "
                                            "--token-identity)"),
        residual: int = typer.Option(FIT.residual, min=0, help="H > 0: every map adds a "
                                     "residual nonlinearity of H units, zero until distilled"),
        needle_share: float = typer.Option(0.0, min=0.0, max=1.0, callback=finite,
                                           help="about this share of the fitting windows are "
                                           "synthetic needles, question and answer last (with "
                                           "--attention-weighted, their queries weight the fit)"),
        windows: int = typer.Option(FIT.windows, min=1, help="fitting windows"),
        length: int = typer.Option(FIT.length, min=2, help="tokens per window"),
        ridge: float = typer.Option(FIT.ridge, min=0.0, callback=finite,
                                    help="ridge strength, relative to the data scale"),
        as_json: bool = typer.Option(False, "--json")):
    """Fit a translator from SOURCE's cache to TARGET's in closed form (stage 1)."""
    from mlx_kvtrans.translators import artifact
    from mlx_kvtrans.translators.fit import fit as fit_translator
    from mlx_kvtrans.translators.fit import token_windows
    from mlx_kvtrans.translators.token_identity import codebook_of

    if assign not in ("relative", "best"):
        raise KvtransError(f"--assign must be relative or best, not {assign!r}")
    points = key_values("--point", point, "rope_key=3")
    if any(p not in ("1", "2", "3") for p in points.values()):
        raise KvtransError(f"--point takes OBJECT=1|2|3, not {' '.join(point)}")
    config = _fit_config(capture_point, nu, features, width, recipe, token_identity,
                         points={k: int(v) for k, v in points.items()}, split_kv=split_kv,
                         headwise=headwise, ridge=ridge, attention_weighted=attention_weighted,
                         identity_tables=identity_tables, residual=residual,
                         windows=windows, length=length)
    output_dir("--out", out_dir)
    in_range("--length", length, 2, position_limit(model_configs(source, target)))
    in_range("--attention-weighted", attention_weighted, 0,
             Limit(length - 1, f"a window of --length {length} keeps a token before its last C"))
    src, tgt = mlx_kvtrans.load(source), mlx_kvtrans.load(target)
    if not _same_tokenizer(src, tgt):
        raise KvtransError(f"{source} and {target} do not share a tokenizer; translation "
                           "between tokenizers is not supported yet")
    recipes, cost = _plan_and_cost(src, tgt, config)
    _refuse_unless_it_fits(src, tgt, config, cost)  # a fit too big is refused before --data
    files = text_files("--data", data, "train")
    held_out = text_file("--validation", validation, "validation")
    codebook = None
    if token_identity == "codebook":
        try:
            codebook = codebook_of(src)
        except ValueError as e:
            raise KvtransError(str(e))
    ids = token_ids(src.tokenizer, "--data", files)
    needles = None
    if needle_share:
        from mlx_kvtrans.evaluation.needles import needle_rows
        from mlx_kvtrans.zoo.corpus import sentences

        needles = needle_rows(src.tokenizer.encode, sentences(read_texts(files), limit=20_000),
                              length, count=max(1, round(windows * needle_share)))
    try:
        batches = list(token_windows(ids, length, windows, batch=4, needles=needles,
                                     needle_share=needle_share))
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
            progress=lambda i, n: progress.update(task, completed=i, tokens=f"{n:,}"),
            held_out=src.tokenizer.encode(held_out.read_text(errors="replace")))
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
    out.print(_gate_line(translator.info["gate"]))


def _gate_line(calibration: dict) -> str:
    bands = ", ".join(f"{b['threshold']['read']:+.2f} / {b['threshold']['generated']:+.2f} at "
                      f"{b['prefix'][0]}-{b['prefix'][1]} tokens" for b in calibration["bands"])
    return (f"fidelity gate (last {calibration['tail']} tokens) fires over {bands} (nats/token, "
            f"on text the source read / on its own reply)")


@app.command()
@user_errors
def calibrate(translator_dir: Path = typer.Option(..., "--translator", help="a translator "
                                                  "directory or a shipped name"),
              validation: Path = typer.Option(None, help="held-out text (default: the zoo "
                                              "corpus's validation split)"),
              windows: int = typer.Option(WINDOWS, min=1, help="held-out windows of each "
                                          "kind (the source's text, its own reply) and band "
                                          "of prefix lengths"),
              as_json: bool = typer.Option(False, "--json")):
    """Calibrate a translator's fidelity gate on held-out text and write it into its manifest
    (its weights are not touched)."""
    from mlx_kvtrans.gate import calibrate_directory
    from mlx_kvtrans.translators import artifact

    path = artifact.resolve(translator_dir)
    held_out = text_file("--validation", validation, "validation")
    record = calibrate_directory(path, held_out, windows=windows)
    if as_json:
        print(json.dumps(record, indent=2))
        return
    out.print(f"{_gate_line(record)} · wrote {path / 'manifest.json'}")


@app.command()
@user_errors
def distill(translator_dir: Path = typer.Option(..., "--translator", help="stage-1 translator: "
                                                "a directory or a shipped name"),
            out_dir: Path = typer.Option(None, "--out", help="distilled translator to write "
                                         "(default: DIR-distilled)"),
            data: Path = typer.Option(None, help="text file or directory (default: the zoo "
                                      "corpus's train split)"),
            validation: Path = typer.Option(None, help="held-out text (default: the zoo corpus's "
                                            "validation split)"),
            steps: int = typer.Option(DISTILL.steps, min=1),
            batch: int = typer.Option(DISTILL.batch, min=1,
                                      help="windows per step, over all processes"),
            lr: float = typer.Option(DISTILL.lr, min=0.0, callback=finite,
                                     help="Adam learning rate after warm-up"),
            warmup: int = typer.Option(DISTILL.warmup, min=0),
            min_prefix: int = typer.Option(DISTILL.min_prefix, min=2),
            max_prefix: int = typer.Option(DISTILL.max_prefix, min=2),
            continuation: int = typer.Option(DISTILL.continuation, min=1,
                                             help="positions the KL is taken over"),
            indexer_weight: float = typer.Option(DISTILL.indexer_weight, min=0.0, callback=finite,
                                                 help="weight of the indexer-key rehearsal"),
            attention_weight: float = typer.Option(
                DISTILL.attention_weight, min=0.0, callback=finite,
                help="weight of the attention rehearsal: the target's attention over the "
                "translated cache held to its attention over its own (0: off)"),
            needle_share: float = typer.Option(DISTILL.needle_share, min=0.0, max=1.0,
                                               callback=finite, help="share of each batch that "
                                               "is synthetic needles, question and answer last"),
            validate_every: int = typer.Option(DISTILL.validate_every, min=1),
            validation_windows: int = typer.Option(DISTILL.validation_windows, min=1),
            seed: int = typer.Option(DISTILL.seed, **SEEDS),
            workdir: Path = typer.Option(None, help="checkpoints (default: runs/distill/NAME)"),
            resume: bool = typer.Option(False, help="continue from the checkpoint in --workdir"),
            max_minutes: float = typer.Option(None, callback=positive,
                                              help="stop (resumable) after this long"),
            as_json: bool = typer.Option(False, "--json")):
    """Distil a translator end to end: KL of the target reading the translated cache against
    it reading its own (stage 2). Under `mlx.launch` the batch is shared among processes."""
    import hashlib

    import mlx.core as mx

    from mlx_kvtrans.translators import artifact
    from mlx_kvtrans.translators.distill import Distiller

    if min_prefix > max_prefix:
        raise KvtransError("--min-prefix must not exceed --max-prefix")
    in_range("--max-prefix", max_prefix, min_prefix,
             position_limit(model_configs(*translator_models(translator_dir)), continuation,
                            "--continuation"))
    files = text_files("--data", data, "train")
    validation = text_file("--validation", validation, "validation")
    name = translator_dir.resolve().name
    workdir = output_dir("--workdir", workdir or Path("runs") / "distill" / name)
    if (workdir / "state.json").exists() and not resume:
        raise KvtransError(f"{workdir} holds a checkpoint: pass --resume to continue it, or "
                           "another --workdir")
    out_dir = output_dir("--out", out_dir or translator_dir.with_name(translator_dir.name
                                                                      + "-distilled"))
    translator, src, tgt = _load_translator_pair(translator_dir, None, None)
    if translator.info.get("stage") == 2:
        out.print(f"{translator_dir} is already distilled; distilling it further")
    texts = read_texts(files)
    train_ids = token_ids(src.tokenizer, "--data", files)
    validation_ids = src.tokenizer.encode(validation.read_text(errors="replace"))
    config = DistillConfig(steps=steps, lr=lr, warmup=warmup, batch=batch, min_prefix=min_prefix,
                           max_prefix=max_prefix, continuation=continuation,
                           indexer_weight=indexer_weight, attention_weight=attention_weight,
                           needle_share=needle_share,
                           validate_every=validate_every,
                           validation_windows=validation_windows, seed=seed)
    needles = None
    if needle_share:
        from mlx_kvtrans.evaluation.needles import needle_rows
        from mlx_kvtrans.zoo.corpus import sentences

        needles = needle_rows(src.tokenizer.encode, sentences(texts, limit=20_000),
                              max_prefix + continuation)
    group = mx.distributed.init()
    distiller = Distiller(translator, src.model, tgt.model, train_ids, validation_ids, config,
                          workdir, group if group.size() > 1 else None, needles)
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
    distilled.info["gate"] = distiller.calibrated_gate(distilled)
    artifact.save(distilled, out_dir, src, tgt)
    if as_json:
        print(json.dumps({"out": str(out_dir), **{k: v for k, v in summary.items()
                                                  if k != "curve"}}, indent=2))
        return
    out.print(f"held-out KL {summary['validation_kl_before']:.4f} -> "
              f"{summary['validation_kl_after']:.4f} nats/token after {summary['steps']} steps "
              f"({summary['minutes']:.1f} min, peak memory "
              f"{summary['peak_memory_bytes'] / 2**20:.0f} MiB) · wrote {out_dir}")
    out.print(_gate_line(distilled.info["gate"]))
