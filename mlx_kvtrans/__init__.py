"""mlx-kvtrans: translate a language model's cache into another model's cache format, on MLX.

Public API (everything takes mlx-lm models and returns mlx-lm caches):

    lm = kvtrans.load("kimi-linear")          # zoo alias, local directory or Hugging Face id
    layout = kvtrans.layout_of(lm.model)      # every cache object of every layer
    cap = kvtrans.capture(lm.model, tokens)   # objects at capture points (1), (2), (3)
    cache = kvtrans.install(lm.model, cap.at(1), point=1)   # -> KVCache / ArraysCache / CacheList
    outputs, state = kvtrans.replay(layout.layers[0].cache, cap.layer(0, 2)["state"])
"""

from . import blas  # noqa: F401  (first: selects a fast BLAS before mlx.core loads)
from .capture import Capture, capture
from .errors import KvtransError, ModelNotFoundError, UnsupportedModelError
from .install import install, to_engine
from .layouts import (CAPTURE_POINTS, SUPPORTED_FAMILIES, CacheObject, LayerLayout, ModelLayout,
                      ObjectKind, RecurrentInputs, Rotation, layout_of)
from .models import LoadedModel, load, resolve
from .prompt_cache import read_prompt_cache, write_prompt_cache

__version__ = "0.1.0"


def replay(layer_cache, inputs: RecurrentInputs, state=None, chunk_size=None, use_kernel=True,
           parallel=False):
    """Run a linear-attention layer's own recurrence over per-token (2) `inputs` from `state`.

    `layer_cache`: `layout.layers[i].cache` of a GDN or KDA layer. Returns (outputs, state).
    `parallel=True` uses the chunkwise-parallel pure-MLX form (differentiable on every device).
    """
    if not hasattr(layer_cache, "replay"):
        raise KvtransError(f"layer kind {layer_cache.mixer!r} has no recurrent state to replay")
    return layer_cache.replay(inputs, state, chunk_size=chunk_size, use_kernel=use_kernel,
                              parallel=parallel)


__all__ = ["CAPTURE_POINTS", "Capture", "CacheObject", "KvtransError", "LayerLayout",
           "LoadedModel", "ModelLayout", "ModelNotFoundError", "ObjectKind", "RecurrentInputs",
           "Rotation", "SUPPORTED_FAMILIES", "UnsupportedModelError", "capture", "install",
           "layout_of", "load", "read_prompt_cache", "replay", "resolve", "to_engine",
           "write_prompt_cache"]
