"""Cache layouts: what every layer of a loaded mlx-lm model caches, derived from its modules.

One module per cache-object family: `gqa` (token keys/values), `mla` (latents, rope keys),
`indexer` (sparse-attention indexer keys), `linear_attention` (conv histories, recurrent states)
with `gated_delta` (its recurrence in chunkwise-parallel form). `objects` names the capture points
and object kinds. The layout vocabulary (`CapturePoint`, `ObjectKind`, `CacheObject`, `Rotation`,
`LayerLayout`, `ModelLayout`, `RecurrentInputs`, `CAPTURE_POINTS`, `SUPPORTED_FAMILIES`) is
reached here, as `mlx_kvtrans.layouts.X`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from ..errors import UnsupportedModelError
from .base import CacheListLayer, LayerCache
from .gqa import GQAKeysValues
from .indexer import IndexerKeys
from .linear_attention import GatedDeltaNet, KimiDeltaAttention, RecurrentInputs
from .mla import MLALatent
from .objects import CAPTURE_POINTS, CacheObject, CapturePoint, ObjectKind, Rotation

# mlx-lm model_type -> the cache objects of the family, as users know it.
SUPPORTED_FAMILIES = {
    "qwen3": "GQA",
    "llama": "GQA",
    "qwen2": "GQA",
    "deepseek_v3": "MLA",
    "kimi_vl": "MLA",
    "kimi_linear": "MLA + KDA",
    "qwen3_next": "GQA + GDN",
    "qwen3_5": "GQA + GDN",
    "deepseek_v32": "MLA + indexer",
    "glm_moe_dsa": "MLA + indexer",
}


@dataclass
class LayerLayout:
    index: int
    cache: LayerCache

    @property
    def mixer(self) -> str:
        return self.cache.mixer

    @property
    def objects(self) -> tuple[CacheObject, ...]:
        return self.cache.objects

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "mixer": self.mixer, "cache_class": self.cache.cache_class,
                "objects": [o.to_json() for o in self.objects]}


@dataclass
class ModelLayout:
    model_type: str
    family: str
    layers: list[LayerLayout]

    @property
    def bytes_per_token(self) -> int:
        return sum(o.bytes_per_token for layer in self.layers for o in layer.objects)

    @property
    def fixed_bytes(self) -> int:
        return sum(o.fixed_bytes for layer in self.layers for o in layer.objects)

    def kinds(self) -> set[ObjectKind]:
        return {o.kind for layer in self.layers for o in layer.objects}

    def to_json(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "family": self.family,
                "capture_points": {str(k): v for k, v in CAPTURE_POINTS.items()},
                "layers": [layer.to_json() for layer in self.layers],
                "totals": {"bytes_per_token": self.bytes_per_token,
                           "fixed_bytes": self.fixed_bytes}}


def model_type_of(model: nn.Module) -> str:
    model_type = getattr(model, "model_type", None)
    if model_type is None and hasattr(model, "args"):
        model_type = getattr(model.args, "model_type", None)
    return model_type or type(model).__module__.rsplit(".", 1)[-1]


def check_supported(model_type: str) -> None:
    if model_type not in SUPPORTED_FAMILIES:
        families = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_FAMILIES.items())
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported families: {families}")


def mixer_of(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's token mixer: its linear or softmax attention module."""
    return layer["linear_attn"] if "linear_attn" in layer else layer.get("self_attn")


def layer_cache(layer: nn.Module) -> LayerCache:
    """The cache of one decoder layer, recognised by the modules it is built from."""
    mixer = mixer_of(layer)
    if mixer is None:
        raise UnsupportedModelError(f"layer {type(layer).__name__} has no attention module")
    if "kv_a_proj_with_mqa" in mixer:
        mla = MLALatent(mixer)
        return CacheListLayer([mla, IndexerKeys(mixer.indexer)]) if "indexer" in mixer else mla
    if "q_conv" in mixer and "f_a_proj" in mixer:
        return KimiDeltaAttention(mixer)
    if "conv1d" in mixer and hasattr(mixer, "A_log"):
        return GatedDeltaNet(mixer)
    if "k_proj" in mixer and "v_proj" in mixer and "rope" in mixer:
        return GQAKeysValues(mixer)
    raise UnsupportedModelError(f"unrecognised attention module {type(mixer).__name__}")


def cache_class_name(cache) -> str:
    name = type(cache).__name__
    if name == "ArraysCache":
        return f"ArraysCache({len(cache.cache)})"
    if name == "CacheList":
        return "CacheList(" + ", ".join(cache_class_name(c) for c in cache.caches) + ")"
    return name


def layout_of(model: nn.Module) -> ModelLayout:
    """The cache layout of a loaded mlx-lm model, from its config and module tree."""
    from mlx_lm.models.cache import make_prompt_cache

    model_type = model_type_of(model)
    check_supported(model_type)
    engine = make_prompt_cache(model)
    layers = []
    for i, (layer, cache) in enumerate(zip(model.layers, engine)):
        lc = layer_cache(layer)
        if lc.cache_class != cache_class_name(cache):
            raise UnsupportedModelError(
                f"layer {i} caches a {cache_class_name(cache)}, expected {lc.cache_class} "
                "(sliding-window or quantized caches are not supported)")
        layers.append(LayerLayout(i, lc))
    return ModelLayout(model_type, SUPPORTED_FAMILIES[model_type], layers)


__all__ = ["CAPTURE_POINTS", "CacheObject", "CapturePoint", "LayerCache", "LayerLayout", "ModelLayout",
           "ObjectKind", "RecurrentInputs", "Rotation", "SUPPORTED_FAMILIES", "layout_of"]
