"""Write a random-weight model directory that `mlx_lm.load` reads offline.

The model is built by mlx-lm's own class for the family and saved with mlx-lm's own writers, so it
is a checkpoint like any other: only its weights are random.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import _get_classes, save_config, save_model

from .families import tiny_config
from .tokenizer import byte_tokenizer, save_tokenizer, special_token_ids


def unbuilt_model(config: dict):
    """An mlx-lm model of `config` whose weights are never evaluated: nothing is allocated
    (for shapes and counts; it must not be run)."""
    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def build_model(config: dict, seed: int = 0, dtype=mx.float32):
    """An mlx-lm model of `config` with seeded random weights."""
    mx.random.seed(seed)
    model = unbuilt_model(config)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def write_random_model(family: str, directory: str | Path, seed: int = 0,
                       config: dict | None = None) -> Path:
    """Create `directory` with config, weights and tokenizer of a random `family` model."""
    directory = Path(directory)
    tok = byte_tokenizer()
    config = config or tiny_config(family, tok.get_vocab_size(), special_token_ids(tok))
    model = build_model(config, seed=seed)
    directory.mkdir(parents=True, exist_ok=True)
    save_model(directory, model)
    save_config(dict(config), directory / "config.json")
    save_tokenizer(tok, directory)
    return directory
