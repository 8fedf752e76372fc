"""mlx-kvtrans: translate a language model's cache into another model's cache format, on MLX.

Public API (everything takes mlx-lm models and returns mlx-lm caches):

    src, tgt = kvtrans.load("kimi-linear"), kvtrans.load("kimi-vl")  # alias, directory or HF id
    layout = kvtrans.layout_of(tgt.model)       # every cache object of every layer
    cap = kvtrans.capture(src.model, tokens)    # objects at capture points raw, normed, engine
    cache = kvtrans.install(src.model, cap.at(1), point=1)   # -> KVCache / ArraysCache / CacheList
    outputs, state = kvtrans.replay(layout.layers[0].cache, cap.layer(0, 2)["state"])
    kvtrans.write_prompt_cache("p.safetensors", cache, "kimi-linear")  # read_prompt_cache reads

    recipes = kvtrans.plan(kvtrans.layout_of(src.model), layout)      # a recipe per target object
    tr = kvtrans.fit(src.model, tgt.model, batches, recipes, kvtrans.FitConfig())   # stage 1
    tr = kvtrans.distill(tr, src.model, tgt.model, train_ids, held_out_ids)        # stage 2
    kvtrans.save_translator(tr, "out/", src, tgt)
    tr = kvtrans.load_translator("kimi-linear__kimi-vl-distilled", src, tgt)  # or a directory
    cache = kvtrans.translate_cache(tr, src.model, tgt.model, tokens)   # the target continues
    session = kvtrans.Session({"a": src, "b": tgt}, {("a", "b"): tr})   # switch mid-conversation
    session.add_text("The number is 552190.")   # or add(ids); each model reads its own tokens
    status = session.switch("b")                # a SwitchStatus: applied or not, why, timings

Every error a user can act on is a `KvtransError`. The layout vocabulary (`CapturePoint`,
`ObjectKind`, `CacheObject`, `LayerLayout`, `ModelLayout`, `Rotation`, `RecurrentInputs`,
`CAPTURE_POINTS`, `SUPPORTED_FAMILIES`) lives in `mlx_kvtrans.layouts`; the pipeline's other
stages in their folders (`capture`, `translators`, `session`, ...).
"""

from .backend import blas  # noqa: F401  (first: selects a fast BLAS before mlx.core loads)
from .backend import buffer_cache  # noqa: F401  (sizes MLX's CPU buffer cache)
from . import layouts
from ._version import __version__
from .capture import capture
from .errors import KvtransError
from .translators.install import install
from .layouts import layout_of
from .models import load
from .prompt_cache import read_prompt_cache, write_prompt_cache
from .session import Session, SwitchStatus
from .translators.artifact import load as load_translator
from .translators.artifact import save as save_translator
from .training.distill import DistillConfig, distill
from .training.fit import FitConfig, fit
from .training.plan import plan
from .translators.translator import translate_cache


def replay(layer_cache, inputs: layouts.RecurrentInputs, state=None, chunk_size=None,
           use_kernel=True, parallel=False):
    """Run a linear-attention layer's own recurrence over per-token normed `inputs` from `state`.

    `layer_cache`: `layout.layers[i].cache` of a GDN or KDA layer. Returns (outputs, state).
    `parallel=True` uses the chunkwise-parallel pure-MLX form (differentiable on every device).
    """
    if not hasattr(layer_cache, "replay"):
        raise KvtransError(f"layer kind {layer_cache.mixer!r} has no recurrent state to replay")
    return layer_cache.replay(inputs, state, chunk_size=chunk_size, use_kernel=use_kernel,
                              parallel=parallel)


__all__ = ["DistillConfig", "FitConfig", "KvtransError", "Session", "SwitchStatus", "capture",
           "distill", "fit", "install", "layout_of", "load", "load_translator", "plan",
           "read_prompt_cache", "replay", "save_translator", "translate_cache",
           "write_prompt_cache"]
