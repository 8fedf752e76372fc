"""`kvtrans serve`: an OpenAI-compatible server that hands conversations between models
through translated caches.

- `store.py`: conversation caches shared by every model, keyed by token prefix, with
  checkpoints for hybrids and least-recently-used eviction under one byte budget;
- `config.py`: what is served, and loading the models and translators between them;
- `engine.py`: the models and translators, and the one worker thread that runs every
  request's compute (switch through `Session.switch`, the prompt read in parts, decoding);
- `batching.py`: the requests decoding on one model, stepped together; `compute.py`: the
  worker thread; `residency.py`: which models are loaded, under a memory budget;
  `records.py`: a request, the events of its answer and what happened to its history;
- `protocol.py`: OpenAI's request bodies, replies, stream chunks and error objects;
- `app.py`: the FastAPI routes and the uvicorn runner; `metrics.py`: Prometheus text.
"""

from .app import create_app, listen, run, server
from .config import ServeConfig, parse_bytes
from .engine import Engine
from .records import RequestHistory

__all__ = ["Engine", "RequestHistory", "ServeConfig", "create_app", "listen", "parse_bytes", "run",
           "server"]
