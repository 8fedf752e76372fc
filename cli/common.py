"""What every command group shares: the app, its consoles, the bad-input rule, and the parsing
helpers (model lists, corpus defaults, translator pairs)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path

import typer
from rich.console import Console

import mlx_kvtrans  # noqa: F401  (selects a fast BLAS before anything imports mlx.core)
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.translators.distill import DistillConfig
from mlx_kvtrans.translators.fit import FitConfig

FIT, DISTILL = FitConfig(), DistillConfig()  # every default of `fit` and `distill` comes from here

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
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


def _text_files(data: Path | None) -> list[Path]:
    """The .txt files of --data (a file or a directory; default the zoo corpus's train split)."""
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
    return files


def _read_texts(data: Path | None) -> list[str]:
    return [f.read_text(errors="replace") for f in _text_files(data)]


def _token_ids(tokenizer, data: Path | None) -> list[int]:
    """--data's token ids (cached by mlx_kvtrans.tokens), with progress while tokenising."""
    from mlx_kvtrans.tokens import encode_files

    with progress_bar("reading --data") as progress:
        ids = encode_files(tokenizer, _text_files(data), progress)
    if not ids:
        raise KvtransError(f"--data {data}: no text in it")
    return ids


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


def _load_translator_pair(translator_dir: Path, source: str | None, target: str | None):
    """The translator and its models: named in its manifest unless given, and checked."""
    from mlx_kvtrans.translators import artifact

    manifest = artifact.read_manifest(translator_dir)
    src = mlx_kvtrans.load(source or manifest["source"]["name"])
    tgt = mlx_kvtrans.load(target or manifest["target"]["name"])
    return artifact.load(translator_dir, src, tgt), src, tgt


def _default_translator(source: str, target: str) -> Path | None:
    from mlx_kvtrans.translators.artifact import shipped

    return shipped(source, target)



@contextlib.contextmanager
def progress_bar(description: str):
    """A rich progress bar on stderr (stdout stays clean for --json); yields a
    `progress(done, total, what)` callback. Silent when stderr is not a terminal."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    with Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[what]}"), TimeElapsedColumn(), console=err,
                  transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(description, total=None, what="")

        def update(done: int, total: int | None = None, what: str = ""):
            bar.update(task, completed=done, total=total, what=what)

        yield update
