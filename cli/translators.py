"""`kvtrans plan`, `fit`, `calibrate`, `distill`: what a translator costs, stage 1 in closed
form, its fidelity gate, stage 2 by KL distillation. Each parses its options, makes one call
into `mlx_kvtrans.training.workflows` (or `calibrate`) and prints what came back."""

from __future__ import annotations

import contextlib
import json
from dataclasses import fields
from pathlib import Path

import typer
from rich.table import Table

from mlx_kvtrans.training.calibrate import NEEDLE_SHARE, WINDOWS
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.layouts import CapturePoint
from mlx_kvtrans.training.fit import FitConfig
from mlx_kvtrans.translators.gate import COPY_LOSS, COPY_WORTH

from .common import (DISTILL, FIT, FORCE_HELP, SEEDS, DistillConfig, Limit, app, err, finite,
                     in_range, int_list, key_values, model_configs, out, output_dir, position_limit,
                     positive, refuse_existing, text_file, text_files, translator_models,
                     user_errors)

# help shared by `plan` and `fit`
CAPTURE_HELP = ("capture point of the source features and target objects: 1 raw (pre-norm, "
                "un-rotated), 2 post-norm, 3 the engine's cache")
NU_HELP = "source layers each target layer's maps read"
FEATURES_HELP = ("what the maps read: attention (a hybrid's every attention layer), nearest, "
                 "all (conv rows too), same (one geometry: each object from its own) or auto")
WIDTH_HELP = "features all: compress linear-attention rows to this many principal directions"
RECIPE_HELP = "OBJECT=RECIPE, e.g. recurrent_state=bilinear (repeatable)"
IDENTITY_HELP = "which token each position holds: codebook, ids or off"
RANDOM_FEATURES_HELP = ("H > 0: every map's input (or those of --random-layers) gains H random "
                        "features (a nonlinear map)")
RANDOM_LAYERS_HELP = ("with --random-features: only these target layers' maps read them, e.g. "
                      "2,3 (where `eval ablate` finds the translation loses most)")
JSON_HELP = "print the result as JSON"
REPLAY_CONVOLVE = typer.Option(FIT.replay_convolve, help="linear-attention targets: replay "
                               "predicts k, v before the target's short convolution and runs "
                               "it (needs --capture 1)")
OUTPUT_WEIGHT = typer.Option(DISTILL.output_weight, min=0.0, callback=finite,
                             help="weight of the output rehearsal: each layer's attention output "
                             "over the translated cache held to its output over its own (0: off)")
OBJECT_WEIGHT = typer.Option(DISTILL.object_weight, min=0.0, callback=finite,
                             help="weight of the object rehearsal: each per-token object a map "
                             "builds held to the target's own (stage 1's objective; 0: off)")
TEMPERATURE = typer.Option(DISTILL.temperature, callback=positive,
                           help="the KL's temperature: below 1 it weighs the order of the top "
                           "tokens, where a switch's argmax parts from native's")
KEEP = typer.Option(DISTILL.keep, help="the parameters written: last (the last step's) or best "
                    "(of the lowest held-out KL measured, the start's included; with --resume, "
                    "of a finished run too)")
TRAIN_ONLY = typer.Option(DISTILL.train_only, help="train only the parameters whose names hold "
                          "this text, e.g. residual (`fit --residual H`), the rest staying as "
                          "they are; \"\" every one; auto: every one unless the first held-out "
                          "KL is worse than the start's, then the biases alone, from the start")
GATE_WINDOWS_HELP = ("held-out windows of each kind (the source's text, its own reply) and band "
                     "of prefix lengths the fidelity gate is calibrated on")


def fit_config(capture_point: int, nu: int, features: str, width: int, recipe: list[str],
                token_identity: str, **more) -> FitConfig:
    """The FitConfig `plan` and `fit` build from their options, each name checked."""
    from mlx_kvtrans.translators.alignment import POOLINGS
    from mlx_kvtrans.training.plan import FEATURES
    from mlx_kvtrans.translators.token_identity import MODES

    if token_identity not in MODES:
        raise KvtransError(f"--token-identity must be {', '.join(MODES)}, not {token_identity!r}")
    if features not in FEATURES:
        raise KvtransError(f"--features must be {', '.join(FEATURES)}, not {features!r}")
    if more.get("pooling", FitConfig.pooling) not in POOLINGS:
        raise KvtransError(f"--pooling must be {', '.join(POOLINGS)}, not {more['pooling']!r}")
    return FitConfig(point=capture_point, nu=nu, features=features, width=width,
                     recipes=key_values("--recipe", recipe, "recurrent_state=bilinear"),
                     token_identity=token_identity, **more)


@contextlib.contextmanager
def _stages():
    """A bar per stage of a workflow (reading, fitting, calibrating, distilling) on stderr, so
    that stdout stays clean for --json; yields the workflow's `progress` callback."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[what]}"), TimeElapsedColumn(), TextColumn("eta"),
                  TimeRemainingColumn(), console=err,
                  disable=not err.is_terminal) as bars:
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int | None = None, what: str = "") -> None:
            if stage not in tasks:
                tasks[stage] = bars.add_task(stage, total=total, what="")
            bars.update(tasks[stage], completed=done, total=total, what=what)

        yield update


def _gate_line(calibration: dict) -> str:
    bands = ", ".join(f"{b['threshold']['read']:+.2f} / {b['threshold']['generated']:+.2f} at "
                      f"{b['prefix'][0]}-{b['prefix'][1]} tokens" for b in calibration["bands"])
    line = (f"fidelity gate (last {calibration['tail']} tokens) fires over {bands} (nats/token, "
            f"on text the source read / on its own reply)")
    copies = [b for b in calibration["bands"] if "copy" in b]
    if copies:
        bands = " / ".join(f"{b['prefix'][0]}-{b['prefix'][1]}" for b in copies)
        line += ("; copy probe: translations copy the history "
                 + " / ".join(f"{b['copy']['loss']:+.2f}" for b in copies)
                 + f" nats/token worse than the target's own cache at {bands} tokens (over "
                 f"{COPY_LOSS:.2f} every switch re-reads); one switch re-reads over "
                 + " / ".join("-" if b["copy"].get("threshold") is None else
                              f"{b['copy']['threshold']:+.2f}" for b in copies))
        worth = [b["copy"]["worth"] for b in copies if "worth" in b["copy"]]
        if worth:
            line += (f" (-: the target's history lowers its NLL of the repeats by under "
                     f"{COPY_WORTH:.2f}; by " + " / ".join(f"{w:+.2f}" for w in worth) + ")")
    return line


@app.command()
@user_errors
def fit(source: str = typer.Option(..., "--from", help="source model"),
        target: str = typer.Option(..., "--to", help="target model"),
        out_dir: Path = typer.Option(..., "--out", help="translator directory to write"),
        force: bool = typer.Option(False, "--force", help=FORCE_HELP),
        data: Path = typer.Option(None, help="text or .jsonl chat log (OpenAI messages), or a "
                                  "directory of them (default: the zoo corpus)"),
        validation: Path = typer.Option(None, help="held-out text the fidelity gate is "
                                        "calibrated on (default: the zoo corpus's validation "
                                        "split)"),
        gate_windows: int = typer.Option(WINDOWS, min=1, help=GATE_WINDOWS_HELP),
        capture_point: int = typer.Option(int(FIT.point), "--capture", min=1, max=3,
                                          help=CAPTURE_HELP),
        nu: int = typer.Option(FIT.nu, "--nu", min=1, help=NU_HELP),
        features: str = typer.Option(FIT.features, help=FEATURES_HELP),
        width: int = typer.Option(FIT.width, min=0, help=WIDTH_HELP),
        recipe: list[str] = typer.Option(None, help=RECIPE_HELP),
        token_identity: str = typer.Option(FIT.token_identity, help=IDENTITY_HELP),
        point: list[str] = typer.Option(None, help="OBJECT=P: capture point of one object kind "
                                        "or name, e.g. rope_key=3"),
        split_kv: bool = typer.Option(FIT.split_kv, help="keys from source keys, values from "
                                      "values"),
        headwise: bool = typer.Option(FIT.headwise, help="with --split-kv: target head h reads "
                                      "source head h only"),
        assign: str = typer.Option(FIT.assign, help="layer assignment: relative (depth) or best "
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
        random_features: int = typer.Option(FIT.random_features, min=0,
                                            help=RANDOM_FEATURES_HELP),
        random_layers: str = typer.Option(None, help=RANDOM_LAYERS_HELP),
        replay_convolve: bool = REPLAY_CONVOLVE,
        needle_share: float = typer.Option(FIT.needle_share, min=0.0, max=1.0, callback=finite,
                                           help="about this share of the fitting windows are "
                                           "synthetic needles, question and answer last (with "
                                           "--attention-weighted, their queries weight the fit)"),
        windows: int = typer.Option(FIT.windows, min=1, help="fitting windows"),
        length: int = typer.Option(FIT.length, min=2, help="tokens per window"),
        mix_lengths: str = typer.Option(None, help="e.g. 256,512,1024,2048: windows of these "
                                        "lengths, windows x length tokens split evenly"),
        ridge: float = typer.Option(FIT.ridge, min=0.0, callback=finite,
                                    help="ridge strength, relative to the data scale"),
        pooling: str = typer.Option(FIT.pooling, help="models that tokenize differently: what "
                                    "each target token reads of its group's source tokens "
                                    "(mean, first or last)"),
        workdir: Path = typer.Option(None, help="checkpoints (default: runs/fit/NAME of --out)"),
        resume: bool = typer.Option(False, help="continue the fit checkpointed in --workdir"),
        as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """Fit a translator from SOURCE's cache to TARGET's in closed form (stage 1), and calibrate
    its fidelity gate on held-out text. Ctrl-C keeps the running sums for --resume. Under
    `mlx.launch` the fitting batches are dealt among the processes."""
    from mlx_kvtrans.training.workflows import ASSIGNMENTS, fit_translator

    refuse_existing(output_dir("--out", out_dir), force)  # first: nothing is touched
    if assign not in ASSIGNMENTS:
        raise KvtransError(f"--assign must be {' or '.join(ASSIGNMENTS)}, not {assign!r}")
    config = fit_config(capture_point, nu, features, width, recipe, token_identity,
                         points=_points(point), split_kv=split_kv,
                         headwise=headwise, ridge=ridge, attention_weighted=attention_weighted,
                         identity_tables=identity_tables, residual=residual,
                         random_features=random_features, windows=windows, length=length, mix=tuple(
                             int_list("--mix-lengths", mix_lengths, 2) if mix_lengths else ()),
                         pooling=pooling, replay_convolve=replay_convolve, assign=assign,
                         needle_share=needle_share,
                         random_layers=random_layer_list(random_layers, random_features, target))
    _check_window_lengths(config, source, target)
    files = text_files("--data", data, "train")
    held_out = text_file("--validation", validation, "validation")
    workdir = output_dir("--workdir", workdir or Path("runs") / "fit" / out_dir.resolve().name)
    translator = _resumable(workdir, resume, fit_translator, source, target, files, config,
                            validation=held_out, out=out_dir, gate_windows=gate_windows)
    _print_fit(translator, f"{source} -> {target} (stage 1, "
               f"{CapturePoint(capture_point).name.lower()}, nu={nu})", out_dir, as_json)


def _points(point: list[str] | None) -> dict[str, int]:
    """--point rope_key=3 ...: object kind or name -> capture point."""
    points = key_values("--point", point, "rope_key=3")
    if any(p not in ("1", "2", "3") for p in points.values()):
        raise KvtransError(f"--point takes OBJECT=1|2|3, not {' '.join(point)}")
    return {k: int(v) for k, v in points.items()}


def random_layer_list(text: str | None, random_features: int,
                        target: str) -> tuple[int, ...]:
    """--random-layers 2,3: target layers, each one the target has; only with --random-features."""
    if text is None:
        return ()
    if not random_features:
        raise KvtransError("--random-layers needs --random-features H > 0")
    try:
        config = model_configs(target)[target]
    except KvtransError:  # a bare config.json (`plan`): the plan checks the layers itself
        config = {}
    layers = (config.get("text_config") or config).get("num_hidden_layers")
    limit = Limit(layers - 1, f"{target} has {layers} layers") if layers else None
    return tuple(sorted(set(int_list("--random-layers", text, 0, limit))))


def _check_window_lengths(config, source: str, target: str) -> None:
    """--length and --mix-lengths within both models' positions; --attention-weighted C leaves
    the shortest window a token before its last C."""
    for n in (config.length, *config.mix):
        in_range("--length" if n == config.length else "--mix-lengths", n, 2,
                 position_limit(model_configs(source, target)))
    shortest = min((config.length, *config.mix))
    in_range("--attention-weighted", config.attention_weighted, 0, Limit(
        shortest - 1, f"a window of {shortest} tokens keeps a token before its last C"))


def _resumable(workdir: Path, resume: bool, run, *args, **kwargs):
    """`run` (`fit_translator`) checkpointing in `workdir`; Ctrl-C says how to continue."""
    from mlx_kvtrans.training.fit_checkpoint import check_directory, holds_checkpoint, state_file
    from mlx_kvtrans.backend.processes import launched_group

    group = launched_group()
    check_directory(workdir, resume, state_file(*((group.rank(), group.size()) if group
                                                  else (0, 1))))
    try:
        with _stages() as progress:
            return run(*args, progress=progress, workdir=workdir, resume=resume, **kwargs)
    except KeyboardInterrupt:
        err.print(f"stopped: the fit's running sums are in {workdir}; the same command with "
                  "--resume continues it" if holds_checkpoint(workdir) else "interrupted")
        raise typer.Exit(130)


def _print_fit(translator, title: str, out_dir: Path, as_json: bool) -> None:
    if translator.info["fit"].get("rank", 0):  # under mlx.launch the first process reports
        return
    if as_json:
        return print(json.dumps({"out": str(out_dir), **translator.info}, indent=2))
    table = Table(title=title, title_justify="left")
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
    if "alignment" in translator.info:
        out.print(f"across tokenizers: each target token reads its group's source tokens "
                  f"pooled ({translator.info['alignment']['pooling']}); no fidelity gate yet")
    else:
        out.print(_gate_line(translator.info["gate"]))


@app.command()
@user_errors
def calibrate(translator_dir: Path = typer.Option(..., "--translator", help="a translator "
                                                  "directory or a shipped name"),
              validation: Path = typer.Option(None, help="held-out text (default: the zoo "
                                              "corpus's validation split)"),
              windows: int = typer.Option(WINDOWS, min=1, help=GATE_WINDOWS_HELP),
              needle_share: float = typer.Option(NEEDLE_SHARE, min=0.0, max=1.0,
                                                 callback=finite,
                                                 help="about this share of the windows whose "
                                                 "tail the source read are needles, question "
                                                 "last, in the target's chat template (a gate "
                                                 "calibrated on prose alone re-reads needle "
                                                 "switches it need not)"),
              force: bool = typer.Option(False, "--force", help="replace the calibration the "
                                         "translator already holds"),
              as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """Choose a translator's relay and calibrate its fidelity gate under it on held-out text,
    and write both into its manifest (its weights are not touched). Under mlx.launch the
    processes share the gate's windows."""
    import mlx.core as mx

    from mlx_kvtrans.training.calibrate import CalibrationConfig, calibrate_directory
    from mlx_kvtrans.translators import artifact
    from mlx_kvtrans.translators.relay import describe as relay_line

    path = artifact.resolve(translator_dir)
    if "gate" in artifact.read_manifest(path) and not force:
        raise KvtransError(f"--translator {translator_dir}: already holds a gate calibration "
                           "(pass --force to replace it)")
    held_out = text_file("--validation", validation, "validation")
    record = calibrate_directory(path, held_out, CalibrationConfig(windows=windows,
                                                                   needle_share=needle_share))
    if mx.distributed.init().rank() != 0:  # under mlx.launch the first process reports
        return
    if as_json:
        print(json.dumps({**record, "relay": artifact.read_manifest(path).get("relay")},
                         indent=2))
        return
    out.print(relay_line(artifact.read_manifest(path).get("relay")))
    out.print(f"{_gate_line(record)} · wrote {path / 'manifest.json'}")


@app.command()
@user_errors
def distill(translator_dir: Path = typer.Option(..., "--translator", help="stage-1 translator: "
                                                "a directory or a shipped name"),
            out_dir: Path = typer.Option(None, "--out", help="distilled translator to write "
                                         "(default: DIR-distilled)"),
            force: bool = typer.Option(False, "--force", help=FORCE_HELP),
            data: Path = typer.Option(None, help="text or .jsonl chat log (OpenAI messages), "
                                      "or a directory of them (default: the zoo corpus)"),
            validation: Path = typer.Option(None, help="held-out text (default: the zoo corpus's "
                                            "validation split)"),
            gate_windows: int = typer.Option(WINDOWS, min=1, help=GATE_WINDOWS_HELP),
            steps: int = typer.Option(DISTILL.steps, min=1, help="optimiser steps"),
            batch: int = typer.Option(DISTILL.batch, min=1,
                                      help="windows per step, over all processes"),
            lr: float = typer.Option(DISTILL.lr, min=0.0, callback=finite,
                                     help="Adam learning rate after warm-up"),
            warmup: int = typer.Option(DISTILL.warmup, min=0,
                                       help="steps the learning rate rises over"),
            min_prefix: int = typer.Option(DISTILL.min_prefix, min=2,
                                           help="shortest prefix a step translates"),
            max_prefix: int = typer.Option(DISTILL.max_prefix, min=2,
                                           help="longest prefix a step translates (and the "
                                           "held-out windows' prefix)"),
            continuation: int = typer.Option(DISTILL.continuation, min=1,
                                             help="positions the KL is taken over"),
            indexer_weight: float = typer.Option(DISTILL.indexer_weight, min=0.0, callback=finite,
                                                 help="weight of the indexer-key rehearsal"),
            attention_weight: float = typer.Option(
                DISTILL.attention_weight, min=0.0, callback=finite,
                help="weight of the attention rehearsal: the target's attention over the "
                "translated cache held to its attention over its own (0: off)"),
            output_weight: float = OUTPUT_WEIGHT, object_weight: float = OBJECT_WEIGHT,
            temperature: float = TEMPERATURE, train_only: str = TRAIN_ONLY, keep: str = KEEP,
            needle_share: float = typer.Option(DISTILL.needle_share, min=0.0, max=1.0,
                                               callback=finite, help="share of each batch that "
                                               "is synthetic needles, question and answer last"),
            needle_form: str = typer.Option(DISTILL.needle_form, help="the needles as plain "
                                            "text, or chat: in the target's chat template"),
            greedy: bool = typer.Option(DISTILL.greedy, help="continue each window with the "
                                        "target's own greedy tokens (sequence level)"),
            reread: int = typer.Option(DISTILL.reread, min=0, help="the target reads the "
                                       "prefix's last R tokens itself, as a session at R does"),
            sink: int = typer.Option(DISTILL.sink, min=0, help="the target reads the prefix's "
                                     "first S tokens itself (default: the fit's measured sink)"),
            validate_every: int = typer.Option(DISTILL.validate_every, min=1,
                                               help="steps between held-out KL measurements"),
            validation_windows: int = typer.Option(DISTILL.validation_windows, min=1,
                                                   help="held-out windows the KL is taken on"),
            seed: int = typer.Option(DISTILL.seed, **SEEDS, help="seed of every step's batch"),
            workdir: Path = typer.Option(None, help="checkpoints (default: runs/distill/NAME)"),
            resume: bool = typer.Option(False, help="continue from the checkpoint in --workdir"),
            max_minutes: float = typer.Option(None, callback=positive,
                                              help="stop (resumable) after this long"),
            as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """Distil a translator end to end: KL of the target reading the translated cache against
    it reading its own (stage 2). Under `mlx.launch` the batch is shared among processes."""
    from mlx_kvtrans.training.workflows import check_workdir, distill_paths, distill_translator

    options = locals()  # every stage-2 setting is the option of its name
    config = DistillConfig(**{f.name: options[f.name] for f in fields(DistillConfig)})
    in_range("--max-prefix", max_prefix, min_prefix,
             position_limit(model_configs(*translator_models(translator_dir)), continuation,
                            "--continuation"))
    _check_train_only(translator_dir, train_only)
    files = text_files("--data", data, "train")
    held_out = text_file("--validation", validation, "validation")
    default_out, default_workdir = distill_paths(translator_dir)
    workdir = output_dir("--workdir", workdir or default_workdir)
    check_workdir(workdir, resume)  # a checkpoint there is named before --out is refused
    out_dir = out_dir or default_out
    refuse_existing(output_dir("--out", out_dir), force)
    with _stages() as progress:
        run = distill_translator(translator_dir, files, held_out, config, out=out_dir,
                                 workdir=workdir, resume=resume,
                                 gate_windows=gate_windows, progress=progress, note=err.print)
    if not run.finished:
        out.print(f"stopped at step {run.summary['steps']} of {steps}; checkpoint in "
                  f"{workdir} (continue with --resume)")
        return
    if run.translator is not None:  # the first process writes and prints
        _print_distill(run, out_dir, as_json)


def _check_train_only(translator_dir: Path, train_only: str) -> None:
    """Refused before any work: --train-only that names none of the translator's parameters."""
    if train_only:
        from safetensors import safe_open

        from mlx_kvtrans.translators import artifact
        from mlx_kvtrans.training.distill import frozen

        path = artifact.resolve(translator_dir) / "weights.safetensors"
        with safe_open(str(path), framework="numpy") as weights:  # the names alone
            frozen(list(weights.keys()), train_only)


def _print_distill(run, out_dir: Path, as_json: bool) -> None:
    summary = run.summary
    if as_json:
        print(json.dumps({"out": str(out_dir), **{k: v for k, v in summary.items()
                                                  if k != "curve"}}, indent=2))
        return
    if summary.get("probe"):
        probe = summary["probe"][-1]
        out.print(f"every parameter raised the held-out KL to {probe['validation_kl']:.4f} by "
                  f"step {probe['step']}: trained the biases alone, from the start")
    out.print(f"held-out KL {summary['validation_kl_before']:.4f} -> "
              f"{summary['validation_kl_after']:.4f} nats/token after {summary['steps']} steps "
              f"({summary['minutes']:.1f} min, peak memory "
              f"{summary['peak_memory_bytes'] / 2**20:.0f} MiB) · wrote {out_dir}")
    best = summary["best"]
    if summary["config"]["keep"] == "best":
        out.print(f"wrote the parameters of step {best['step']} (held-out KL "
                  f"{best['validation_kl']:.4f}), the lowest measured" if best["step"] else
                  "no step lowered the held-out KL: wrote the parameters it started from")
    elif best["step"] != summary["steps"]:
        out.print(f"held-out KL was lowest at step {best['step']} ({best['validation_kl']:.4f}): "
                  "--resume --keep best --force writes those parameters instead")
    out.print(_gate_line(run.translator.info["gate"]))
