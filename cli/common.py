"""What every command group shares: the app, its consoles, the bad-input rule, and the parsing
helpers (model lists, corpus defaults, translator pairs)."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

import mlx_kvtrans  # noqa: F401  (selects a fast BLAS before anything imports mlx.core)
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.training.distill import DistillConfig
from mlx_kvtrans.training.fit import FitConfig

FIT, DISTILL = FitConfig(), DistillConfig()  # every default of `fit` and `distill` comes from here

# Piped output (CI logs, files) is as wide as COLUMNS says, else 160 columns rather than rich's
# 80; at a terminal rich measures it (COLUMNS first).
out = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit()
              else 160)
err = Console(stderr=True)

# Typer runs on its own copy of click (typer._click) in recent versions and on click itself in
# older ones: its exception classes are found from the one it exports.
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def print_error(message: str) -> None:
    """One red line on stderr, whatever the message holds (newlines, [brackets])."""
    err.print(f"[bold red]error:[/] {escape(' '.join(str(message).split()))}", highlight=False,
              soft_wrap=True)


class _OneLineUsageError(_ClickException):
    exit_code = 2

    def show(self, file=None) -> None:
        print_error(self.message)


@contextlib.contextmanager
def _usage_errors_on_one_line():
    try:
        yield
    except _UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `kvtrans` alone: the help is the answer
            raise
        hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
        raise _OneLineUsageError(e.format_message() + hint) from None


class _Commands(TyperGroup):
    """Click's own bad-input errors (a value out of range, a missing argument, an unknown
    option or command) become the one line on stderr every other bad input gets, exit 2,
    instead of a usage block."""

    def make_context(self, *args, **kwargs):
        with _usage_errors_on_one_line():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _usage_errors_on_one_line():
            return super().invoke(ctx)

    def format_commands(self, ctx, formatter) -> None:
        """Each command with its whole first paragraph of help, wrapped, never cut with '...'."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                text = command.short_help or (command.help or "").split("\n\n")[0]
                rows.append((name, " ".join(text.split())))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


app = typer.Typer(cls=_Commands, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Translate KV caches between language models on MLX.")
zoo_app = typer.Typer(cls=_Commands, no_args_is_help=True,
                      help="The shipped zoo of small models.")
app.add_typer(zoo_app, name="zoo")
eval_app = typer.Typer(cls=_Commands, no_args_is_help=True,
                       help="Measure models and translators.")
app.add_typer(eval_app, name="eval")


def user_errors(command):
    """Bad input is one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise  # a command's own exit code
        except KvtransError as e:
            print_error(str(e))
            raise typer.Exit(2)
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130)
        except BrokenPipeError:  # output piped into `head` and closed: not an error
            raise typer.Exit(0)
        except Exception as e:  # an internal failure: still one line unless debugging
            if os.environ.get("KVTRANS_DEBUG"):
                raise
            err.print(f"[bold red]internal error:[/] {escape(f'{type(e).__name__}: {e}')} "
                      "(set KVTRANS_DEBUG=1 for the traceback)", highlight=False, soft_wrap=True)
            raise typer.Exit(1)

    return run



REREAD_HELP = ("tokens of a switched span the target re-reads itself over the translation "
               "(the fidelity dial; default: each translator's measured default)")
FIDELITY_HELP = ("held-out agreement each switch must meet: the cheapest re-read setting its "
                 "translator's frontier measured that meets it, else re-reading")


SINK_HELP = ("the conversation's first tokens, which a model given it from its start reads "
             "itself (the attention sink; default: what each translator's fit measured of its "
             "target, 4 for a pretrained model, 0 for the zoo's)")


RECOMPUTE_HELP = ("the target's first layers that read a translated span themselves "
                  "(DroidSpeak: the target's own caches there, at that share of a re-read; "
                  "default: as the dial's setting has it, 0 without a measured frontier)")


def dial_options(reread: int | None, fidelity: float | None, sink: int | None = None,
                 recompute: int | None = None) -> dict:
    """--reread / --fidelity (one of them at most), --sink and --recompute as Session
    options."""
    from mlx_kvtrans.session import dial

    if dial.problem(reread, fidelity):
        raise KvtransError(dial.problem(reread, fidelity, "--"))
    return {"reread": reread, "fidelity": fidelity, "sink": sink, "recompute": recompute}


def refuse_existing(path: str | Path | None, force: bool, option: str = "--out") -> None:
    """No command replaces what exists unless told: exit 2 with one line, nothing touched."""
    if path is not None and Path(path).exists() and not force:
        raise KvtransError(f"{option} {path}: already exists (pass --force to replace it)")


FORCE_HELP = "Replace the output if it already exists."
JSON_HELP = "Print the result as JSON (for scripts) instead of a table."


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


def format_shape(shape) -> str:
    return "(" + ",".join(str(s) for s in shape) + ")"


class FitTable(Table):
    """A table for 80 columns: rules only under the header, and a cell too wide wraps (folding
    a long word) instead of being cut with '...'. Machines read `--json`, not this."""

    def __init__(self, title: str | None = None, **options):
        options = {"title_justify": "left", "box": box.SIMPLE_HEAD, "show_edge": False,
                   "padding": (0, 1, 0, 0), "pad_edge": False, **options}
        super().__init__(title=title, **options)

    def add_column(self, header="", *, right: bool = False, **options) -> None:
        options = {"overflow": "fold", "justify": "right" if right else "left", **options}
        super().add_column(header, **options)


# -- option checks, cheap enough to run before any model loads ---------------------------------
@dataclass(frozen=True)
class Limit:
    """The most an option may take, and why (for the message)."""
    value: int
    why: str


def in_range(option: str, value: int, minimum: int, maximum: Limit | None = None) -> int:
    if value < minimum:
        raise KvtransError(f"{option} {value}: must be at least {minimum}")
    if maximum is not None and value > maximum.value:
        raise KvtransError(f"{option} {value}: must be at most {maximum.value:,} ({maximum.why})")
    return value


def int_list(option: str, text: str, minimum: int, maximum: Limit | None = None) -> list[int]:
    """`--lengths 256,1024`: comma-separated integers, each in [minimum, maximum]."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise KvtransError(f"{option} takes integers separated by commas, not {text!r}") from None
    for value in values:
        in_range(option, value, minimum, maximum)
    return values


def max_positions(config: dict) -> int | None:
    """The positions a model supports, from its config.json (a VLM's text_config first)."""
    for section in (config.get("text_config") or {}, config):
        for key in ("max_position_embeddings", "model_max_length"):
            if isinstance(section.get(key), int) and section[key] > 0:
                return section[key]
    return None


# Past this MLX's int32 shapes overflow; it stands for a config that states no limit.
_MLX_POSITIONS = 2**31 - 1


def position_limit(models: dict[str, dict], reserve: int = 0, reserved_for: str = "") -> Limit:
    """The longest prompt every model of `models` (name -> config.json) supports when
    `reserve` more positions follow it."""
    stated = {name: n for name, config in models.items() if (n := max_positions(config))}
    if not stated:
        return Limit(_MLX_POSITIONS - reserve, "the most positions MLX indexes")
    name = min(stated, key=stated.get)
    why = f"{name} supports {stated[name]:,} positions"
    return Limit(stated[name] - reserve, why + (f", {reserve} of them for {reserved_for}"
                                               if reserve else ""))


def model_configs(*names: str) -> dict[str, dict]:
    """name -> config.json of models named as `mlx_kvtrans.load` takes them, read without
    loading weights (so options can be checked against them first)."""
    from mlx_kvtrans.models import read_config, resolve

    return {name: read_config(resolve(name)) for name in names}


SEEDS = dict(min=0, max=2**64 - 1)  # the range of a seed option: what mx.random.seed takes


def finite(value: float | None) -> float | None:
    """Option callback: click's float ranges let nan and inf through."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def positive(value: float | None) -> float | None:
    """Option callback: a finite number above 0 (minutes, say)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value} is not a number above 0")
    return value


def output_dir(option: str, path: Path) -> Path:
    """A directory a command will write: refused now if it cannot be, not after the work."""
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise KvtransError(f"{option} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK):
        raise KvtransError(f"{option} {path}: {existing} is not writable")
    return path


# -- text: the zoo corpus's splits by default -----------------------------------------------------
def text_files(option: str, given: Path | None, split: str) -> list[Path]:
    """The .txt and .jsonl (chat log) files of a text option (a file or a directory of them);
    by default the zoo corpus's `split` (test and validation ship with the package, train is
    built locally)."""
    from mlx_kvtrans.models import held_out_split

    path = given or held_out_split(split)  # it finds a local runs/corpus/train.txt too
    if path is None:
        raise KvtransError(f"no {split} text: give {option} FILE, or build the zoo corpus with "
                           "`kvtrans zoo corpus`")
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.suffix in (".txt", ".jsonl"))
        if not files:
            raise KvtransError(f"{option} {path}: no .txt or .jsonl files in this directory")
    elif path.is_file():
        files = [path]
    else:
        raise KvtransError(f"{option} {path}: no such file or directory")
    if not any(f.stat().st_size for f in files):
        raise KvtransError(f"{option} {path}: empty")
    return files


def text_file(option: str, given: Path | None, split: str) -> Path:
    if given is not None and given.is_dir():
        raise KvtransError(f"{option} {given} is a directory: give a text file")
    if given is not None and given.suffix == ".jsonl":
        raise KvtransError(f"{option} {given}: held-out text is a text file (chat logs are "
                           "fitting data, for --data)")
    return text_files(option, given, split)[0]


def token_ids(tokenizer, option: str, files: list[Path]) -> list[int]:
    """The files' token ids (cached by mlx_kvtrans.tokens), with progress while tokenising."""
    from mlx_kvtrans.tokens import encode_files

    with progress_bar(f"reading {option}") as progress:
        ids = encode_files(tokenizer, files, progress)
    if not ids:
        raise KvtransError(f"{option}: no text in {', '.join(map(str, files))}")
    return ids


def key_values(option: str, items: list[str] | None, example: str) -> dict[str, str]:
    """`--recipe a=b --recipe c=d` -> {"a": "b", "c": "d"}."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not (sep and key and value):
            raise KvtransError(f"{option} {item!r}: expected KEY=VALUE, e.g. {example}")
        out[key] = value
    return out


def translator_models(translator: Path, source: str | None = None,
                      target: str | None = None) -> tuple[str, str]:
    """The models a translator (a directory or a shipped name) was fitted for, unless given:
    its files are verified, nothing heavy loads."""
    from mlx_kvtrans.translators import artifact

    manifest = artifact.read_manifest(translator)
    return source or manifest["source"]["name"], target or manifest["target"]["name"]


def load_translator_pair(translator: Path, source: str | None, target: str | None):
    """The translator and its models: named in its manifest unless given, and checked."""
    from mlx_kvtrans.translators import artifact

    source, target = translator_models(translator, source, target)
    src, tgt = mlx_kvtrans.load(source), mlx_kvtrans.load(target)
    return artifact.load(translator, src, tgt), src, tgt


def default_translator(source, target) -> Path | None:
    """The shipped translator for two models: names, or loaded models (which also finds the one
    fitted on the checkpoints they quantize)."""
    from mlx_kvtrans.translators.artifact import shipped, shipped_for

    if isinstance(source, str):
        return shipped(source, target)
    return shipped_for(source, target)



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
