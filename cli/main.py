"""The `kvtrans` command: one module per command group, each a thin layer over the library code
it drives (argument parsing and printing only)."""

from __future__ import annotations

import sys

# imported in the order `kvtrans --help` lists the commands
from . import models, audit, translators, plan, chat, serve, bench, needles, evaluate, zoo  # noqa: F401, I001
from .common import app


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
