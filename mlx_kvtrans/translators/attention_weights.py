"""Attention-weighted fitting (KV-Lingo section 3.2): weight each prefix token's reconstruction
error by how much the continuation's queries attend to it in the target.

During a target forward over [prefix | continuation], the scores that mlx-lm's attention computes
are recomputed for the continuation queries only (the patched `scaled_dot_product_attention` sees
queries, keys, scale and mask), softmaxed, averaged over heads and queries, and scaled to mean 1
over the prefix. Layers without softmax attention (linear attention) keep uniform weights.
"""

from __future__ import annotations

import contextlib
import sys

import mlx.core as mx

from ..layouts import ModelLayout


def _continuation_weights(queries, keys, scale, mask, continuation: int) -> mx.array:
    """(B, prefix) mean attention of the last `continuation` queries to each prefix key."""
    B, H, L, _ = queries.shape
    if keys.shape[1] != H:  # grouped keys: each serves H / n_kv query heads
        keys = mx.repeat(keys, H // keys.shape[1], axis=1)
    q = queries[:, :, L - continuation:].astype(mx.float32)
    scores = (q * scale) @ keys.astype(mx.float32).swapaxes(-1, -2)  # (B, H, c, L)
    if isinstance(mask, mx.array):
        rows = mask[..., L - continuation:, :]
        scores = mx.where(rows, scores, -mx.inf) if rows.dtype == mx.bool_ else scores + rows
    else:  # "causal" or None in a full forward: query i sees keys <= i
        positions = mx.arange(L)
        visible = positions[None, :] <= (positions[L - continuation:])[:, None]
        scores = mx.where(visible, scores, -mx.inf)
    probs = mx.softmax(scores, axis=-1)[..., : L - continuation]
    weights = probs.mean(axis=(1, 2))  # (B, prefix)
    return weights / mx.maximum(weights.mean(axis=-1, keepdims=True), 1e-12)


@contextlib.contextmanager
def recording_attention(model, layout: ModelLayout, continuation: int):
    """Within the block a forward fills {layer index: (B, prefix) weights}."""
    found: dict[int, mx.array] = {}
    current = {"layer": -1}
    patched, swapped = {}, []
    for layer_module, layer in zip(model.layers, layout.layers):
        base = type(layer_module)

        def call(self, *args, _base=base, _i=layer.index, **kwargs):
            current["layer"] = _i
            return _base.__call__(self, *args, **kwargs)

        layer_module.__class__ = type("Weighted" + base.__name__, (base,), {"__call__": call})
        swapped.append((layer_module, base))
        if "self_attn" not in layer_module:
            continue  # linear attention only: no softmax to weight by
        # the attention's own module: where its `scaled_dot_product_attention` is looked up
        namespace = type(layer_module["self_attn"]).__module__
        owner = sys.modules[namespace]
        if namespace in patched or not hasattr(owner, "scaled_dot_product_attention"):
            continue
        original = owner.scaled_dot_product_attention
        patched[namespace] = original

        def sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, _original=original,
                 **kw):
            found[current["layer"]] = _continuation_weights(queries, keys, scale, mask,
                                                            continuation)
            return _original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

        owner.scaled_dot_product_attention = sdpa
    try:
        yield found
    finally:
        for namespace, original in patched.items():
            sys.modules[namespace].scaled_dot_product_attention = original
        for module, base in swapped:
            module.__class__ = base
