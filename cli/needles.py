"""`kvtrans eval needle` and `kvtrans eval perplexity`: what a model reads natively (and needle
recall through a translator), in the zoo's raw-text needles or a model's own chat template."""

from __future__ import annotations

import json
from pathlib import Path

import typer

import mlx_kvtrans
from mlx_kvtrans.errors import KvtransError

from .common import (JSON_HELP, SEEDS, FitTable, eval_app, int_list, load_translator_pair,
                     model_configs, out, position_limit, progress_bar, text_file,
                     translator_models, user_errors)

NEEDLE_FORMAT_HELP = ("needles as raw text (the zoo's format), in the model's chat template "
                      "(a fact among user turns of prose, asked for last), or auto: chat for "
                      "any model outside the zoo")


def check_needle_format(needle_format: str, facts: int = 1) -> None:
    if needle_format not in ("auto", "chat", "text"):
        raise KvtransError(f"--needle-format {needle_format}: choose auto, chat or text")
    if needle_format == "text" and facts != 1:
        raise KvtransError("--facts counts chat needles' facts: use --needle-format chat")


def needle_maker(needle_format: str, facts: int, lm):
    """The `make` of `needles.needle_report` for --needle-format / --facts (None: raw text)."""
    from mlx_kvtrans.models import weights_dir

    check_needle_format(needle_format, facts)
    if needle_format == "auto":
        in_zoo = Path(lm.path).resolve().is_relative_to(weights_dir().resolve())
        needle_format = "text" if in_zoo else "chat"
    if needle_format == "text":
        return None
    from mlx_kvtrans.evaluation.chat_needles import ChatNeedles

    try:
        return ChatNeedles(lm.tokenizer, facts=facts)
    except ValueError as e:
        raise KvtransError(f"--needle-format chat: {e}") from None


@eval_app.command("needle")
@user_errors
def eval_needle(model: str = typer.Option(None, "--model", help="zoo alias, directory or HF id"),
                translator_dir: Path = typer.Option(None, "--translator",
                                                    help="recall of its target continuing from "
                                                    "translated caches, beside native recall "
                                                    "(a directory or a shipped name)"),
                lengths: str = typer.Option(None, help="comma-separated prompt lengths in tokens "
                                            "(default: 1x, 2x, 4x, 8x the training length)"),
                samples: int = typer.Option(50, min=1, help="held-out needles per length"),
                needle_format: str = typer.Option("auto", help=NEEDLE_FORMAT_HELP),
                facts: int = typer.Option(1, min=1, max=16, help="chat needles: numbers "
                                          "stated, one of them asked for"),
                as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """Exact six-digit needle recall of a model on held-out needles, per prompt length."""
    from mlx_kvtrans.evaluation.needles import needle_recall

    if (model is None) == (translator_dir is None):
        raise KvtransError("give --model (native recall) or --translator (translated recall)")
    check_needle_format(needle_format, facts)
    models = translator_models(translator_dir) if translator_dir is not None else (model,)
    # at least a needle and its question
    sizes = int_list("--lengths", lengths, 16, position_limit(model_configs(*models))) \
        if lengths else None
    translated = None
    if translator_dir is not None:
        from mlx_kvtrans.translators.translator import translate_cache

        translator, src, lm = load_translator_pair(translator_dir, None, None)
        model = f"{src.name} -> {lm.name}"
        translated = lambda ids: translate_cache(translator, src.model, lm.model, ids)
    else:
        lm = mlx_kvtrans.load(model)
    if sizes is None:  # the lengths the zoo's manifests record recall at
        from mlx_kvtrans.zoo.train import NEEDLE_LENGTHS

        sizes = list(NEEDLE_LENGTHS)
    make = needle_maker(needle_format, facts, lm)
    with progress_bar("native recall") as progress:
        recall = needle_recall(lm.model, lm.tokenizer.encode, sizes, samples=samples,
                               progress=progress, make=make)
    result = {"model": model, "samples": samples, "format": "chat" if make else "text",
              "facts": facts, "recall": {str(k): v for k, v in recall.items()}}
    if translated is not None:
        result["setting"] = BARE
        result["native_recall"] = result.pop("recall")
        with progress_bar("translated recall") as progress:
            result["translated_recall"] = {str(k): v for k, v in needle_recall(
                lm.model, lm.tokenizer.encode, sizes, samples=samples, cache_for=translated,
                progress=progress, make=make).items()}
    if as_json:
        print(json.dumps(result, indent=2))
        return
    table = FitTable(f"needle recall · {model} · {samples} held-out {result['format']} needles "
                     f"per length" + (f", {facts} facts each" if facts > 1 else "") +
                     (f" · {BARE}" if translated is not None else ""))
    table.add_column("prompt tokens", right=True)
    columns = [k for k in ("recall", "native_recall", "translated_recall") if k in result]
    for key in columns:
        table.add_column(key.replace("_", " ").replace("recall", "exact recall"), right=True)
    for length in sizes:
        table.add_row(str(length), *(f"{result[k][str(length)]:.2f}" for k in columns))
    out.print(table)



BARE = ("the bare translation: nothing re-read, no gate, no sink (`eval frontier` measures a "
        "session's switch at its settings)")


@eval_app.command("perplexity")
@user_errors
def eval_perplexity(model: str = typer.Option(..., "--model", help="zoo alias, directory or "
                                              "HF id"),
                    reference: str = typer.Option(None, help="a model to measure beside it "
                                                  "(its parent, say): the ratio is reported"),
                    text: Path = typer.Option(None, help="held-out text (default: the zoo's "
                                              "test split)"),
                    length: int = typer.Option(256, min=2, help="tokens per window"),
                    windows: int = typer.Option(16, min=1, help="windows of the text"),
                    seed: int = typer.Option(0, **SEEDS, help="window starts"),
                    as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """Perplexity of a model on held-out text (exp of the mean next-token loss over random
    windows), and of a reference model on the same windows."""
    from mlx_kvtrans.evaluation.perplexity import perplexity

    names = (model,) + ((reference,) if reference else ())
    int_list("--length", str(length), 2, position_limit(model_configs(*names)))
    text = text_file("--text", text, "test")
    result = {"text": str(text), "length": length, "windows": windows}
    for key, name in zip(("model", "reference"), names):
        lm = mlx_kvtrans.load(name)
        ids = lm.tokenizer.encode(text.read_text(errors="replace"))
        if len(ids) < length + 2:
            raise KvtransError(f"--text {text}: {len(ids)} tokens, fewer than --length + 2")
        result[key] = {"name": name, "perplexity": perplexity(lm.model, ids, length, windows,
                                                              seed)}
    if reference:
        result["ratio"] = result["model"]["perplexity"] / result["reference"]["perplexity"]
    if as_json:
        print(json.dumps(result, indent=2))
        return
    line = f"{model}: perplexity {result['model']['perplexity']:.2f}"
    if reference:
        line += (f"; {reference}: {result['reference']['perplexity']:.2f} "
                 f"({result['ratio']:.2f}x)")
    out.print(f"{line} ({windows} windows of {length} tokens of {text})")
