"""mlx-kvtrans: translate a language model's cache into another model's cache format, on MLX.

Public API (everything takes mlx-lm models and returns mlx-lm caches):

    src, tgt = kvtrans.load("kimi-linear"), kvtrans.load("kimi-vl")  # alias, directory or HF id
    layout = kvtrans.layout_of(tgt.model)       # every cache object of every layer
    cap = kvtrans.capture(src.model, tokens)    # objects at capture points (1), (2), (3)
    cache = kvtrans.install(src.model, cap.at(1), point=1)   # -> KVCache / ArraysCache / CacheList
    outputs, state = kvtrans.replay(layout.layers[0].cache, cap.layer(0, 2)["state"])

    recipes = kvtrans.plan(kvtrans.layout_of(src.model), layout)      # a recipe per target object
    tr = kvtrans.fit(src.model, tgt.model, batches, recipes, kvtrans.FitConfig())   # stage 1
    tr = kvtrans.distill(tr, src.model, tgt.model, train_ids, held_out_ids)        # stage 2
    tr = kvtrans.load_translator("kimi-linear__kimi-vl-distilled", src, tgt)  # or a directory
    cache = kvtrans.translate_cache(tr, src.model, tgt.model, tokens)   # the target continues
    session = kvtrans.Session({"a": src, "b": tgt}, {("a", "b"): tr})   # switch mid-conversation
"""

from . import blas  # noqa: F401  (first: selects a fast BLAS before mlx.core loads)
from .capture import Capture, capture
from .errors import KvtransError, ModelNotFoundError, UnsupportedModelError
from .install import install, to_engine
from .layouts import (CAPTURE_POINTS, SUPPORTED_FAMILIES, CacheObject, CapturePoint, LayerLayout,
                      ModelLayout, ObjectKind, RecurrentInputs, Rotation, layout_of)
from .models import LoadedModel, load, resolve
from .prompt_cache import read_prompt_cache, write_prompt_cache
from .session import Session, SwitchStatus
from .translators.artifact import load as load_translator
from .translators.artifact import save as save_translator
from .translators.distill import DistillConfig, distill
from .translators.fit import FitConfig, fit
from .translators.plan import plan
from .translators.translator import Translator, translate_cache

__version__ = "0.2.0"


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


__all__ = ["CAPTURE_POINTS", "Capture", "CacheObject", "CapturePoint", "DistillConfig",
           "FitConfig", "KvtransError", "LayerLayout", "LoadedModel", "ModelLayout",
           "ModelNotFoundError", "ObjectKind", "RecurrentInputs", "Rotation",
           "SUPPORTED_FAMILIES", "Session", "SwitchStatus", "Translator", "UnsupportedModelError",
           "capture", "distill", "fit", "install", "layout_of", "load", "load_translator", "plan",
           "read_prompt_cache", "replay", "resolve", "save_translator", "to_engine",
           "translate_cache", "write_prompt_cache"]
