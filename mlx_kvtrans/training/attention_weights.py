"""Attention-weighted fitting (KV-Lingo section 3.2): weight each prefix token's reconstruction
error by how much the continuation's queries attend to it in the target. And the attention
distributions themselves, for the attention rehearsal of stage 2.

During a target forward over [prefix | continuation], the scores that mlx-lm's attention computes
are recomputed for the continuation queries only (an observer of `scaled_dot_product_attention` sees
queries, keys, scale and mask), softmaxed, averaged over heads and queries, and scaled to mean 1
over the prefix. Layers without softmax attention (linear attention) keep uniform weights.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from ..capture.instrument import attention_module_name, observe_function, running_layer
from ..layouts import ModelLayout


def _continuation_weights(queries, keys, scale, mask, continuation: int) -> mx.array:
    """(B, prefix) mean attention of the last `continuation` queries to each prefix key."""
    L = queries.shape[2]
    if isinstance(mask, mx.array):
        mask = mask[..., L - continuation:, :]
    elif mask is None:  # a full forward: query i sees keys <= i
        mask = "causal"
    probs = attention_probabilities(queries[:, :, L - continuation:], keys, scale, mask)
    weights = probs[..., : L - continuation].mean(axis=(1, 2))  # (B, prefix)
    return weights / mx.maximum(weights.mean(axis=-1, keepdims=True), 1e-12)


def attention_probabilities(queries, keys, scale, mask) -> mx.array:
    """(B, H, L, S) softmax attention of the L queries over the S keys, as mlx-lm's
    `scaled_dot_product_attention` computes it: an array mask is boolean or additive (MLA passes
    its rope scores so), "causal" lets the queries, the last L positions, see keys up to their
    own."""
    B, H, L, _ = queries.shape
    S = keys.shape[2]
    if keys.shape[1] != H:
        keys = mx.repeat(keys, H // keys.shape[1], axis=1)
    scores = (queries.astype(mx.float32) * scale) @ keys.astype(mx.float32).swapaxes(-1, -2)
    if isinstance(mask, mx.array):
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    elif mask == "causal":
        visible = mx.arange(S)[None, :] <= (mx.arange(L) + S - L)[:, None]
        scores = mx.where(visible, scores, -mx.inf)
    return mx.softmax(scores, axis=-1)


@contextlib.contextmanager
def recording_attention_probabilities(model):
    """Within the block, every softmax-attention call appends its (B, H, L, S) probabilities to
    the list yielded, in layer order."""
    found: list[mx.array] = []

    def observe(queries, keys, values, cache=None, scale=1.0, mask=None, **kw):
        found.append(attention_probabilities(queries, keys, scale, mask))

    with contextlib.ExitStack() as stack:
        for name in {attention_module_name(layer) for layer in model.layers} - {None}:
            stack.enter_context(observe_function(name, "scaled_dot_product_attention", observe))
        yield found


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


SINK_TOKENS = 4  # StreamingLLM's attention sink: the first tokens a pretrained model rests on
SINK_RATIO = 3.0  # a sink holds this many times the attention the first tokens' share would
SINK_FROM = 32  # queries from this position on: past where the first tokens are most of it
SINK_WINDOW = 512  # tokens of one window read: enough to see a sink, (H, L, L) stays small


def attention_sink(model, windows) -> dict:
    """Whether `model` rests its attention on the first tokens (StreamingLLM's sink): the mean
    attention its softmax layers' heads put on the first SINK_TOKENS keys, from queries at
    SINK_FROM on, over the first row of each of `windows` ((B, T) token arrays), against
    attending evenly. With a sink (SINK_RATIO times even), a target handed a conversation reads
    its first `tokens` itself; a model of linear attention alone has none to measure."""
    masses, even = [], []

    def observe(queries, keys, values, cache=None, scale=1.0, mask=None, **kw):
        probs = attention_probabilities(queries[:1], keys[:1], scale, mask if not isinstance(
            mask, mx.array) else mask[:1] if mask.ndim == 4 else mask)
        masses.append(probs[:, :, SINK_FROM:, :SINK_TOKENS].sum(-1).mean().item())

    with contextlib.ExitStack() as stack:
        for name in {attention_module_name(layer) for layer in model.layers} - {None}:
            stack.enter_context(observe_function(name, "scaled_dot_product_attention", observe))
        for tokens in windows:
            tokens = tokens[:1, :SINK_WINDOW]
            if tokens.shape[1] > SINK_FROM:
                model(tokens)
                even.append(float(mx.mean(SINK_TOKENS / (mx.arange(SINK_FROM, tokens.shape[1])
                                                         + 1))))
    if not masses:
        return {"tokens": 0, "mass": None, "even": None}
    mass, uniform = sum(masses) / len(masses), sum(even) / len(even)
    return {"tokens": SINK_TOKENS if mass >= SINK_RATIO * uniform else 0,
            "mass": round(mass, 4), "even": round(uniform, 4)}
