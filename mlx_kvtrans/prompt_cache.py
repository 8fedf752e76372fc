"""mlx-lm prompt-cache files: read them as engine objects, write installed caches as them.

A file written here carries the model's metadata as `mlx_lm.cache_prompt` writes it (`model`,
`tokenizer_config`), so `mlx_lm.generate --prompt-cache-file F` continues from it directly. A
cache identifies the tokens it holds, so the file is written 0600, like the conversation text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .errors import KvtransError
from .files import private_path
from .translators.install import resolve_layout
from .layouts import ModelLayout
from .layouts import cache_class_name


def write_prompt_cache(path: str | Path, caches: list[Any], model_name: str,
                       tokenizer_config: dict | None = None, extra: dict[str, str] | None = None
                       ) -> Path:
    """Save mlx-lm caches (from `install`, or a prefill) as a prompt-cache file, readable by its
    owner only. Returns the file's path: mlx adds ".safetensors" to a name without it."""
    from mlx_lm.models.cache import save_prompt_cache

    metadata = {"model": str(model_name), "tokenizer_config": json.dumps(tokenizer_config or {})}
    metadata.update(extra or {})
    path = Path(path)
    if path.suffix != ".safetensors":
        path = path.with_name(path.name + ".safetensors")
    with private_path(path, suffix=".safetensors") as tmp:
        save_prompt_cache(str(tmp), caches, metadata)
    return path


def read_prompt_cache(path: str | Path, model_or_layout: nn.Module | ModelLayout
                      ) -> tuple[list[dict[str, mx.array]], dict[str, str]]:
    """Per-layer engine objects and the metadata of a prompt-cache file made for this model."""
    from mlx_lm.models.cache import load_prompt_cache

    layout = resolve_layout(model_or_layout)
    try:
        caches, metadata = load_prompt_cache(str(path), return_metadata=True)
    except Exception as err:
        raise KvtransError(f"{path} is not an mlx-lm prompt-cache file ({err})") from None
    if len(caches) != len(layout.layers):
        raise KvtransError(f"{path} holds {len(caches)} layer caches; the model has "
                           f"{len(layout.layers)}")
    for layer, cache in zip(layout.layers, caches):
        if cache_class_name(cache) != layer.cache.cache_class:
            raise KvtransError(f"{path}: layer {layer.index} holds a {cache_class_name(cache)}, the "
                               f"model caches a {layer.cache.cache_class} there")
    return [layer.cache.read_engine(c) for layer, c in zip(layout.layers, caches)], metadata
