"""Fidelity of a translated cache: how the target continues from it, beside its bounds.

For held-out prefixes: the mean KL(p_T(. | native cache) || p_T(. | translated cache)) over the
continuation tokens (nats/token, the papers' measure), and the greedy agreement of 32 generated
tokens; the same two figures for the "no cache" floor (the target given no context) so every
number sits between 0 (native) and the floor.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..capture import capture
from ..capture.instrument import recording_indexer_scores
from ..layouts import CapturePoint, layout_of
from .translator import Translator, translate_cache


def kl_per_token(native_logits: mx.array, other_logits: mx.array) -> mx.array:
    p = nn.log_softmax(native_logits.astype(mx.float32), axis=-1)
    q = nn.log_softmax(other_logits.astype(mx.float32), axis=-1)
    return (mx.exp(p) * (p - q)).sum(-1)


def tempered_kl(native_logits: mx.array, other_logits: mx.array, temperature: float) -> mx.array:
    """T^2 KL(softmax(native / T) || softmax(other / T)) per token: at T below 1 it grows where
    native's top tokens are nearly tied and the other orders them differently, the positions
    where a switched target's argmax parts from native's, and fades where native is sure; T^2
    keeps a near tie's gradient at about its size at T = 1."""
    if temperature == 1.0:
        return kl_per_token(native_logits, other_logits)
    return temperature ** 2 * kl_per_token(native_logits.astype(mx.float32) / temperature,
                                           other_logits.astype(mx.float32) / temperature)


def greedy(model, first_token: int, cache, n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array([first_token]), model, prompt_cache=cache,
                                             max_tokens=n)]


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


@dataclass(frozen=True)
class FidelityConfig:
    """What `fidelity` measures and on how much, apart from the models and text."""
    prefix_lengths: list[int]
    windows: int = 8  # held-out windows per prefix length
    continuation: int = 64  # tokens after each prefix the KL is taken over
    generated: int = 32  # greedy tokens compared for agreement
    seed: int = 0  # where the windows start
    sink: int | None = None  # the target reads these first tokens itself; None: the translator's


def fidelity(translator: Translator, source, target, token_ids: list[int],
             config: FidelityConfig, progress=None, build_cache=None) -> list[dict]:
    """Per prefix length: KL and greedy agreement, translated and no-cache, over
    `config.windows` held-out windows of `token_ids`. `source` and `target` are mlx-lm models.
    `progress(done, total, what)` follows the windows. `build_cache(translator, source, target,
    prefix)`: the target's cache of the prefix another way than translation (a baseline);
    `config.sink`: the target reads the prefix's first tokens itself (`translate_cache`; None:
    the translator's measured sink)."""
    if build_cache is None:
        def build_cache(translator, source, target, prefix):
            return translate_cache(translator, source, target, prefix, sink=config.sink)
    prefix_lengths, windows = config.prefix_lengths, config.windows
    continuation, generated = config.continuation, config.generated
    rng = random.Random(config.seed)
    target_layout = layout_of(target)
    rows = []
    for n, length in enumerate(prefix_lengths):
        span = length + continuation
        if len(token_ids) < span + 1:
            raise ValueError(f"held-out text has {len(token_ids)} tokens, fewer than {span + 1}")
        kls = []
        floor_kls = []
        agree = []
        floor_agree = []
        for w in range(windows):
            if progress:
                progress(n * windows + w, len(prefix_lengths) * windows, f"prefix {length:,}")
            start = rng.randrange(0, len(token_ids) - span)
            window = mx.array(token_ids[start:start + span])[None]
            prefix, last = window[:, :length - 1], int(window[0, length - 1])
            inputs = window[:, length - 1:span - 1]  # the last prefix token, then continuation

            def fresh_native():
                return capture(target, prefix, points=(CapturePoint.ENGINE,), layout=target_layout).engine

            native = target(inputs, cache=fresh_native())
            translated = target(inputs, cache=build_cache(translator, source, target, prefix))
            no_context = target(inputs)  # no cache: the target has not read the prefix
            kls.append(float(kl_per_token(native, translated).mean()))
            floor_kls.append(float(kl_per_token(native, no_context).mean()))
            reference = greedy(target, last, fresh_native(), generated)
            agree.append(agreement(reference, greedy(
                target, last, build_cache(translator, source, target, prefix), generated)))
            floor_agree.append(agreement(reference, greedy(target, last, None, generated)))
        rows.append({"prefix_length": length, "windows": windows,
                     "kl": sum(kls) / windows, "kl_no_cache": sum(floor_kls) / windows,
                     "greedy_agreement": sum(agree) / windows,
                     "greedy_agreement_no_cache": sum(floor_agree) / windows})
    return rows


def _top_k(scores: mx.array, k: int) -> set[int]:
    """Positions an indexer selects from its scores over the keys (all when there are <= k)."""
    scores = scores.reshape(-1)
    if scores.size <= k:
        return set(range(scores.size))
    return set(mx.argpartition(scores, kth=-k)[-k:].tolist())


def indexer_selection(translator: Translator, source, target, prompts: list[list[int]],
                      needles: list[list[int]] | None = None) -> dict:
    """DSA targets: what the sparse indexer selects when it reads translated indexer keys.

    For each prompt, the target reads its last token from a cache of the rest (native or
    translated); each DSA layer's indexer picks its top-k keys for that query. Returns the mean
    share of the native selection that the translated selection keeps, and (with `needles`: the
    positions of each prompt's needle tokens) the share of (layer, prompt) pairs whose selection
    holds every needle token, native and translated (a layer that does not read the needle need
    not select it; the two shares side by side show whether translation loses it)."""
    layout = layout_of(target)
    top_k = [layer.self_attn.indexer.index_topk for layer in target.layers
             if hasattr(getattr(layer, "self_attn", None), "indexer")]
    if not top_k:
        raise ValueError("the target has no sparse-attention indexer")
    overlap, kept = [], {"native": 0, "translated": 0}
    for i, prompt in enumerate(prompts):
        ids = mx.array(prompt)[None]
        caches = {"native": capture(target, ids[:, :-1], points=(CapturePoint.ENGINE,), layout=layout).engine,
                  "translated": translate_cache(translator, source, target, ids[:, :-1])}
        chosen = {}
        for name, cache in caches.items():
            with recording_indexer_scores(target) as scores:
                mx.eval(target(ids[:, -1:], cache=cache))
            chosen[name] = [_top_k(s[..., : ids.shape[1] - 1], k) for s, k in zip(scores, top_k)]
        overlap += [len(n & t) / len(n) for n, t in zip(chosen["native"], chosen["translated"])]
        if needles is not None:
            for name in kept:
                kept[name] += sum(set(needles[i]) <= c for c in chosen[name])
    result = {"selection_overlap": sum(overlap) / len(overlap), "prompts": len(prompts),
              "index_topk": top_k[0]}
    if needles is not None:
        result.update({f"needle_selected_{n}": v / (len(prompts) * len(top_k))
                       for n, v in kept.items()})
    return result
