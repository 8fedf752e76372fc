"""Attention-weighted fitting (KV-Lingo section 3.2): weight each prefix token's reconstruction
error by how much the continuation's queries attend to it in the target.

During a target forward over [prefix | continuation], the scores that mlx-lm's attention computes
are recomputed for the continuation queries only (an observer of `scaled_dot_product_attention` sees
queries, keys, scale and mask), softmaxed, averaged over heads and queries, and scaled to mean 1
over the prefix. Layers without softmax attention (linear attention) keep uniform weights.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from ..instrument import attention_module_name, observe_function, running_layer
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
    with contextlib.ExitStack() as stack:
        current = stack.enter_context(running_layer(model))

        def observe(queries, keys, values, cache=None, scale=1.0, mask=None, **kw):
            found[current["layer"]] = _continuation_weights(queries, keys, scale, mask,
                                                            continuation)

        # linear-attention layers have no softmax to weight by
        for name in {attention_module_name(layer) for layer in model.layers} - {None}:
            stack.enter_context(observe_function(name, "scaled_dot_product_attention", observe))
        yield found
