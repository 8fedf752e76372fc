"""What a translator reads from the source: per-token features of each source layer.

A source layer's features at a capture point are its per-token objects there, flattened and
concatenated per token: GQA keys and values; MLA latent and rope key (and indexer key); the raw
conv rows of a linear-attention layer at raw, or its recurrence inputs (q, k, v, a, b) at normed.
"""

from __future__ import annotations

import mlx.core as mx

from ..capture import Capture
from ..layouts import CapturePoint, ObjectKind
from ..layouts.linear_attention import RecurrentInputs


def _per_token(value, B: int, T: int) -> mx.array:
    if isinstance(value, RecurrentInputs):
        return mx.concatenate([x.reshape(B, T, -1) for x in value.arrays()], axis=-1)
    if value.ndim == 4:  # engine: (B, heads, T, dim)
        return value.transpose(0, 2, 1, 3).reshape(B, T, -1)
    return value


def feature_point(obj, point: int) -> int | None:
    """`point` if `obj` has per-token features there, else None: a conv history is per token at
    raw only, a recurrent state (its recurrence inputs) at normed only; at engine both are fixed-size
    summaries."""
    if obj.kind == ObjectKind.CONV_HISTORY:
        return point if point == CapturePoint.RAW else None
    if obj.kind == ObjectKind.RECURRENT_STATE:
        return point if point == CapturePoint.NORMED else None
    return point if point in obj.capture_points else None


def layer_features(capture: Capture, layer: int, point: int, kinds: tuple[str, ...] = ()
                   ) -> mx.array:
    """(B, T, D) features of source `layer` at capture `point` (only objects of `kinds`, if
    given)."""
    B, T = capture.tokens.shape
    found = capture.objects[layer]
    parts = []
    for obj in capture.layout.layers[layer].objects:
        key = (obj.name, point)
        if key not in found or (kinds and obj.kind.value not in kinds):
            continue
        if feature_point(obj, point) is None:
            continue
        parts.append(_per_token(found[key], B, T).astype(mx.float32))
    if not parts:
        raise ValueError(f"source layer {layer} has no per-token objects at ({point})")
    return mx.concatenate(parts, axis=-1)


def projection_name(layer: int) -> str:
    """The parameter holding source `layer`'s feature compression (D, width)."""
    return f"features.layer{layer}.projection"
