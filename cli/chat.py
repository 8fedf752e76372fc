"""`kvtrans chat`: a conversation that moves between two models without re-reading."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable, Iterator

import typer
from rich.markup import escape

import mlx_kvtrans
from mlx_kvtrans.errors import KvtransError

from .common import (FIDELITY_HELP, RECOMPUTE_HELP, REREAD_HELP, SINK_HELP, app, default_translator,
                     dial_options, in_range, out, print_error, refuse_existing, user_errors)

LEAVE = ("/quit", "/exit")


@app.command()
@user_errors
def chat(source: str = typer.Option("kimi-linear", "--from", help="the model that starts"),
         target: str = typer.Option("kimi-vl", "--to", help="the model to switch to"),
         translator: str = typer.Option(None, help="translator FROM -> TO: a directory or a "
                                                   "shipped name (default: the shipped one)"),
         back: str = typer.Option(None, help="translator TO -> FROM: a directory or a shipped "
                                             "name (default: the shipped one)"),
         strategy: str = typer.Option("segment", help="segment, naive or refresh"),
         script: Path = typer.Option(None, help="run user turns and /commands from a file "
                                                "(lines starting with # are comments)"),
         transcript: Path = typer.Option(None, help="where the transcript goes (JSON; its "
                                                    "directory must exist; default: a new file "
                                                    "in ~/.kvtrans/chats)"),
         force: bool = typer.Option(False, "--force", help="Replace the --transcript file if "
                                                           "it already exists."),
         reread: int = typer.Option(None, help=REREAD_HELP),
         fidelity: float = typer.Option(None, help=FIDELITY_HELP),
         sink: int = typer.Option(None, min=0, help=SINK_HELP),
         recompute: int = typer.Option(None, min=0, help=RECOMPUTE_HELP),
         max_tokens: int = typer.Option(200, help="longest reply"),
         translate_ahead: bool = typer.Option(
             True, "--translate-ahead/--no-translate-ahead",
             help="after each reply, translate the conversation for the other model, so a "
                  "/switch has only the last turn left to give"),
         system: str = typer.Option(None, help="system prompt")):
    """Chat with one model and switch to the other mid-conversation without re-reading.

    At a terminal: line editing and history; Ctrl-C stops a reply (what it said is kept) and
    clears a typed line; Ctrl-C or Ctrl-D on an empty line leaves. From --script or piped
    input, Ctrl-C stops the run (exit 130). The transcript is saved after every event."""
    from mlx_kvtrans.chat import Chat, Transcript
    from mlx_kvtrans.session import STRATEGIES, Session

    if strategy not in STRATEGIES:
        raise KvtransError(f"--strategy must be one of {', '.join(STRATEGIES)}")
    in_range("--max-tokens", max_tokens, 1)
    dial = dial_options(reread, fidelity, sink, recompute)
    if source == target:
        raise KvtransError("--from and --to name the same model")
    script_lines = _read_script(script) if script is not None else None
    transcript = _transcript_path(transcript, force)
    for option, given in (("--translator", translator), ("--back", back)):
        if given is not None:  # its files, before any model loads; the pair once they have
            _named_translator(option, given, _read_manifest)
    models = {source: mlx_kvtrans.load(source), target: mlx_kvtrans.load(target)}
    translators, banner = _translators(models, source, target, translator, back)
    log = Transcript(transcript, {name: str(lm.path) for name, lm in models.items()},
                     translators={pair: text for pair, text, _ in banner})
    try:
        log.save()  # before anything is typed: a transcript that cannot be written is bad input
    except OSError as e:
        raise KvtransError(f"--transcript {transcript}: cannot write it ({e.strerror})") from None
    session = Session(models, translators, active=source, strategy=strategy, **dial)
    conversation = Chat(session, log, max_tokens=max_tokens, system=system,
                        translate_ahead=translate_ahead)
    for pair, text, fallback in banner:
        out.print(f"{pair}: {text}", style="yellow" if fallback else None, markup=False,
                  highlight=False, soft_wrap=True)
    out.print(f"[dim]transcript: {escape(str(transcript))} · /help for commands[/]")

    interactive = script is None and sys.stdin.isatty()
    lines = (_echoed(script_lines, comments=True) if script_lines is not None
             else terminal_lines() if interactive else _echoed(_piped_lines()))
    try:
        code = converse(conversation, lines, interactive)
    except KeyboardInterrupt:  # between turns, outside a reply or a command
        code = 130
    finally:
        log.save()
    out.print(f"[dim]{'interrupted; ' if code else ''}transcript saved to "
              f"{escape(str(transcript))}[/]")
    if code:
        raise typer.Exit(code)


def _transcript_path(given: Path | None, force: bool) -> Path:
    """Where the transcript goes: `given`, refused now if it cannot be written there, or a new
    file in ~/.kvtrans/chats."""
    import time

    if given is None:
        given = Path.home() / ".kvtrans" / "chats" / time.strftime("%Y%m%d-%H%M%S.json")
        given.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # ours to create
    if given.is_dir():
        raise KvtransError(f"--transcript {given} is a directory")
    if not given.parent.is_dir():  # as /save: a mistyped directory is not created
        raise KvtransError(f"--transcript {given}: no directory {given.parent}")
    refuse_existing(given, force, "--transcript")
    return given


def converse(conversation, lines: Iterable[str], interactive: bool) -> int:
    """Run the user turns and /commands in `lines`; returns the exit code.

    A bad /command prints one line and the chat goes on; a blank line is no turn. At a terminal
    (`interactive`) Ctrl-C during a reply stops it and returns to the prompt; otherwise the run
    stops there (130), since no one is at a prompt to go on from it."""
    from mlx_kvtrans.chat import counted, interrupts_held

    def show(segment: str) -> None:
        out.print(segment, end="", markup=False, highlight=False, soft_wrap=True)

    for line in lines:
        if not line.strip():
            continue
        if line.split()[0] in LEAVE:
            return 0
        if line.lstrip().startswith("/"):
            # held: a switch or save cut halfway would leave a model's cache unknown
            with interrupts_held() as pressed:
                try:
                    shown = conversation.command(line)
                except KvtransError as e:
                    print_error(str(e))
                else:
                    out.print(shown, markup=False, highlight=False, soft_wrap=True)
            if pressed:
                if not interactive:
                    return 130
                out.print("[dim](Ctrl-C waited for the command to finish)[/]")
            continue
        out.print(f"[bold cyan]{escape(conversation.session.active)}>[/] ", end="")
        reply = conversation.say(line, on_token=show)
        out.print(f"\n[dim]{escape(reply.model)} · first token "
                  f"{reply.first_token_seconds * 1000:.0f} ms · {counted(reply.tokens, 'token')} in "
                  f"{reply.seconds:.2f} s{' · interrupted' if reply.interrupted else ''}[/]")
        if reply.interrupted and not interactive:
            return 130
    return 0


def terminal_lines(input=None, output=None) -> Iterator[str]:
    """Lines typed at a terminal, with line editing and in-memory history (prompt_toolkit).
    Ctrl-C clears a typed line (kept in the history: Up brings it back); Ctrl-C or Ctrl-D on
    an empty line ends the lines. `input`/`output`: prompt_toolkit's, for tests."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.formatted_text import HTML
    from prompt_toolkit.history import InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    keys, cleared = KeyBindings(), []

    @keys.add("c-c")
    def clear_or_leave(event):
        text = event.app.current_buffer.text
        if text.strip():
            cleared.append(text)
            event.app.exit(result="")
        else:
            event.app.exit(exception=EOFError)

    prompt = PromptSession(history=InMemoryHistory(), key_bindings=keys, input=input,
                           output=output)
    while True:
        try:
            line = prompt.prompt(HTML("<b>you&gt;</b> "))
        except (EOFError, KeyboardInterrupt):
            return
        if cleared:
            prompt.history.append_string(cleared.pop())
            continue
        yield line


def _read_script(script: Path) -> list[str]:
    try:
        return script.read_text().splitlines()
    except FileNotFoundError:
        raise KvtransError(f"--script {script}: no such file") from None
    except IsADirectoryError:
        raise KvtransError(f"--script {script} is a directory") from None
    except UnicodeDecodeError:
        raise KvtransError(f"--script {script} is not UTF-8 text") from None
    except OSError as e:
        raise KvtransError(f"--script {script}: cannot read it ({e.strerror})") from None


def _piped_lines() -> Iterator[str]:
    for line in sys.stdin:
        yield line.rstrip("\r\n")


def _echoed(lines: Iterable[str], comments: bool = False) -> Iterator[str]:
    """Lines not typed at the prompt, shown as if they had been. With `comments`, a line
    starting with "#" is shown as a note and is no turn (a script's commentary)."""
    for line in lines:
        if comments and line.lstrip().startswith("#"):
            out.print(line.lstrip(), style="dim", markup=False, highlight=False, soft_wrap=True)
            continue
        if line.strip():
            out.print(f"[bold]you>[/] {escape(line)}", highlight=False, soft_wrap=True)
        yield line


def _translators(models: dict, source: str, target: str, translator: str | None,
                 back: str | None) -> tuple[dict, list[tuple[str, str, bool]]]:
    """The translator each way, and per direction what switching that way uses: (pair, text,
    whether it falls back to re-reading). A translator named on the command line must load;
    a shipped one that is missing or unusable is a visible fallback."""
    found, banner = {}, []
    for (a, b), option, given in (((source, target), "--translator", translator),
                                  ((target, source), "--back", back)):
        pair = f"{a} -> {b}"
        if given is not None:
            path, tr = _named_translator(option, given, _load_translator, models[a], models[b])
        else:
            shipped = default_translator(models[a], models[b])
            if shipped is None:
                banner.append((pair, "no translator shipped, so /switch that way re-reads the "
                                     "conversation (re-reading)", True))
                continue
            try:
                path, tr = _load_translator(shipped, models[a], models[b])
            except KvtransError as e:
                banner.append((pair, f"shipped translator {_shown(shipped)} not used ({e}), so "
                                     "/switch that way re-reads the conversation (re-reading)",
                               True))
                continue
        found[(a, b)] = tr
        stage = 2 if tr.info.get("stage") == 2 else 1
        fitted_on = f"; {tr.info['fitted_on']}" if tr.info.get("fitted_on") else ""
        banner.append((pair, f"translator {_shown(path)} (stage {stage}){fitted_on}", False))
    return found, banner


def _named_translator(option: str, given: str, read, *models):
    """`read(given, *models)`, its errors told as the option's, naming the translator once."""
    try:
        return read(given, *models)
    except KvtransError as e:
        message = str(e)
        for named in (f"translator {given}", str(given)):  # the library names it already
            if message.startswith(named):
                raise KvtransError(f"{option} {given}{message[len(named):]}") from None
        raise KvtransError(f"{option} {given}: {message}") from None


def _read_manifest(name) -> dict:
    from mlx_kvtrans.translators import artifact

    try:
        return artifact.read_manifest(name)
    except (KeyError, TypeError, ValueError) as e:  # hashes agree, the contents do not parse
        raise KvtransError(f"not a readable translator ({type(e).__name__}: {e})") from None


def _load_translator(name, source, target):
    from mlx_kvtrans.translators import artifact

    path = artifact.resolve(name)
    try:
        # a session keeps the conversation as text for models that tokenize differently
        return path, artifact.load(path, source, target)
    except (KeyError, TypeError, ValueError) as e:  # hashes agree, the contents do not parse
        raise KvtransError(f"not a readable translator ({type(e).__name__}: {e})") from None


def _shown(path: Path) -> str:
    """A path as short as it can be shown: relative to the working directory when under it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)
