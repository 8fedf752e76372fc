"""`kvtrans chat`: a conversation that moves between two models without re-reading."""

from __future__ import annotations

from pathlib import Path

import typer

import mlx_kvtrans
from mlx_kvtrans.errors import KvtransError

from .common import _default_translator, app, out, user_errors


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
