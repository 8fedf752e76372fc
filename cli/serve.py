"""`kvtrans serve`: an OpenAI-compatible server whose conversations move between models through
translated caches."""

from __future__ import annotations

import typer
from rich.markup import escape

from .common import (FIDELITY_HELP, RECOMPUTE_HELP, REREAD_HELP, SINK_HELP, app, dial_options,
                     err, format_bytes, out, user_errors)


@app.command()
@user_errors
def serve(model: list[str] = typer.Option(
              None, "--model", metavar="MODEL",
              help="a model to serve (repeat; default kimi-linear and kimi-vl)"),
          translator: list[str] = typer.Option(
              None, "--translator", metavar="DIR",
              help="a translator directory (repeat; shipped ones fill the other pairs)"),
          host: str = typer.Option("127.0.0.1", help="address to listen on"),
          port: int = typer.Option(8080, help="port to listen on"),
          cache_bytes: str = typer.Option(
              "4GiB", metavar="BYTES",
              help="conversation cache budget, all models together (e.g. 512M, 4GiB)"),
          translate: bool = typer.Option(
              True, "--translate/--no-translate",
              help="hand conversations over by translation (off: the target re-reads)"),
          translate_ahead: bool = typer.Option(
              True, "--translate-ahead/--no-translate-ahead",
              help="between turns, translate each conversation for the models it may move to "
                   "(all others, or the one an x-kvtrans-next-model header names)"),
          memory_budget: str = typer.Option(
              None, metavar="BYTES",
              help="the served models' weights together (e.g. 64GiB; default: the machine's "
                   "memory less --cache-bytes): past it the least recently used model unloads"),
          idle_unload: float = typer.Option(
              None, metavar="SECONDS", help="unload a model unused this long (default: never)"),
          load_deadline: float = typer.Option(
              30.0, metavar="SECONDS",
              help="a request waits this long for its model to load, then gets a 503 with "
                   "Retry-After (the load goes on)"),
          reread: int = typer.Option(None, help=REREAD_HELP),
          fidelity: float = typer.Option(None, help=FIDELITY_HELP),
          sink: int = typer.Option(None, min=0, help=SINK_HELP),
          recompute: int = typer.Option(None, min=0, help=RECOMPUTE_HELP),
          shard: str = typer.Option(
              None, metavar="tensor|pipeline",
              help="under mlx.launch: shard every model across its processes this way (process "
                   "0 answers HTTP; every model stays resident)"),
          grace: float = typer.Option(
              30.0, metavar="SECONDS", help="sharded: told to stop, the request in flight gets "
              "this long to finish (a process that died can leave the others waiting)"),
          max_tokens: int = typer.Option(512, help="reply length when a request gives none"),
          temp: float = typer.Option(0.0, min=0, max=2, help="sampling temperature when a "
                                     "request gives none (0: greedy, as mlx-lm's server)"),
          max_body_bytes: str = typer.Option("8M", metavar="BYTES",
                                             help="largest request body accepted")):
    """Serve models behind OpenAI's API; a conversation moves between them without re-reading."""
    from mlx_kvtrans.serve import Engine, ServeConfig, listen, parse_bytes, run

    config = ServeConfig(models=list(model or ServeConfig().models),
                         translators=list(translator or []), host=host, port=port,
                         cache_bytes=parse_bytes(cache_bytes), translate=translate,
                         translate_ahead=translate_ahead,
                         memory_budget=None if memory_budget is None else parse_bytes(memory_budget),
                         idle_unload=idle_unload, load_deadline=load_deadline,
                         default_max_tokens=max_tokens, temperature=temp,
                         max_body_bytes=parse_bytes(max_body_bytes),
                         shard=shard, grace=grace,
                         **dial_options(reread, fidelity, sink, recompute))
    config.check()
    if shard:
        import mlx.core as mx

        if mx.distributed.init().rank() != 0:  # runs process 0's compute in step, no HTTP
            follow(Engine.from_config(config))
            return
    sock = listen(host, port)
    engine = Engine.from_config(config)
    for note in engine.notes:
        err.print(f"[yellow]{escape(note)}[/]", highlight=False)
    pairs = ", ".join(f"{a} -> {b}" for a, b in engine.translators) if translate else "off"
    bound = sock.getsockname()
    out.print(f"serving {', '.join(engine.models)} at http://{bound[0]}:{bound[1]}/v1 · "
              f"translators: {pairs or 'none'} · cache {format_bytes(config.cache_bytes)}",
              highlight=False, soft_wrap=True)
    run(engine, sock)


def follow(engine) -> None:
    """A sharded process other than 0, until process 0 ends the server: Ctrl-C reaches every
    process mlx.launch started and process 0's decides; SIGTERM (mlx.launch's, when another
    process failed) ends it after a grace for process 0's own end (twice process 0's)."""
    import os
    import signal
    import threading

    def grace(*_):  # a daemon: a process that ended in the grace must not wait it out
        timer = threading.Timer(2 * engine.config.grace, os._exit, (143,))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, grace)
    broken = engine.follow()
    if broken is not None:  # a process of the group is gone: say so, end at once
        err.print(f"[red]the sharded server's group broke: {escape(broken)}[/]", highlight=False)
        raise typer.Exit(1)
