"""Sparse-attention indexer keys (deepseek_v32, glm_moe_dsa): small per-token keys that decide
which tokens the MLA attention reads once the cache is longer than `index_topk`.

raw = `indexer.wk` output; normed = `indexer.k_norm` (LayerNorm) output; engine = RoPE over the first
`qk_rope_head_dim` features of normed, `(B, 1, T, index_head_dim)`. The indexer's KVCache "values"
are dummies (zeros the shape of the keys), which mlx-lm also writes.
"""

from __future__ import annotations

import mlx.core as mx

from .base import LayerCache, apply_rope, kv_append, kv_cache, kv_contents
from .objects import CapturePoint, ObjectKind, Rotation, activation_dtype, per_token_object


class IndexerKeys(LayerCache):
    mixer = "indexer"
    cache_class = "KVCache"

    def __init__(self, indexer):
        self.indexer = indexer
        self.head_dim = indexer.head_dim
        self.top_k = indexer.index_topk
        dtype = activation_dtype(indexer.wk)
        self.objects = (
            per_token_object("indexer_key", ObjectKind.INDEXER_KEY, (1, 1, "T", self.head_dim),
                             dtype, Rotation.of(indexer.rope, self.head_dim)),
        )

    def taps(self):
        def raw(record, args, out):
            record("indexer_key", CapturePoint.RAW, out)

        def normed(record, args, out):
            record("indexer_key", CapturePoint.NORMED, out)

        return [(self.indexer.wk, raw), (self.indexer.k_norm, normed)]

    def read_engine(self, cache):
        keys, _ = kv_contents(cache)
        return {"indexer_key": keys}

    def to_engine(self, objects, point, offset=0, previous=None, rotate=apply_rope):
        keys = objects["indexer_key"]
        if (p := self.point_of("indexer_key", point)) != CapturePoint.ENGINE:
            if p == CapturePoint.RAW:
                keys = self.indexer.k_norm(keys)
            B, T, _ = keys.shape
            keys = rotate("indexer_key", self.indexer.rope, keys.reshape(B, 1, T, self.head_dim),
                          offset)
        return {"indexer_key": self.cast("indexer_key", keys)}

    def build_cache(self, objects):
        keys = self.cast("indexer_key", objects["indexer_key"])
        return kv_cache(keys, mx.zeros_like(keys))

    def append(self, cache, objects):
        keys = self.cast("indexer_key", objects["indexer_key"])
        return kv_append(cache, keys, mx.zeros_like(keys))


def indexer_keys(indexer, x: mx.array, offset: int = 0) -> mx.array:
    """(B, 1, T, head_dim) keys of hidden states `x`, as the indexer caches them."""
    b, s, _ = x.shape
    keys = indexer.k_norm(indexer.wk(x)).reshape(b, 1, s, indexer.head_dim)
    return indexer.rope(keys, offset=offset)


def indexer_scores(indexer, x: mx.array, qr: mx.array, keys: mx.array,
                   offset: int = 0) -> mx.array:
    """(B, queries, keys) pre-top-k scores of the queries of `x` (low-rank queries `qr`, at
    positions from `offset`) against `keys`, as mlx-lm's `Indexer.__call__` computes them before
    its top-k: sum over heads of relu(q . k) * weights_proj(x) * n_heads^-1/2 * head_dim^-1/2.
    Pinned by a test against the indices mlx-lm's own indexer selects."""
    b, s, _ = x.shape
    q = indexer.wq_b(qr).reshape(b, s, indexer.n_heads, indexer.head_dim).swapaxes(1, 2)
    q = indexer.rope(q, offset=offset)
    scores = mx.maximum(q @ keys.swapaxes(-1, -2), 0)
    weights = indexer.weights_proj(x) * (indexer.n_heads**-0.5 * indexer.softmax_scale)
    return (scores * weights.swapaxes(-1, -2)[..., None]).sum(axis=1)
