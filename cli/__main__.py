"""`python -m mlx_kvtrans.cli`: the `kvtrans` command (what `mlx.launch` starts on each process)."""

from .main import app

app()
