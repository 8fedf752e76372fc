"""Grouped-query attention: token keys and token values (qwen3, llama, qwen2, and the full-attention
layers of qwen3_next / qwen3_5).

raw keys = `k_proj` output; normed = `k_norm` output (qwen3, qwen3_next; llama and qwen2 have no key
norm, so normed = raw); engine = RoPE(normed) at the token's position, `(B, n_kv, T, head_dim)`.
Values are the raw `v_proj` output at every point.
"""

from __future__ import annotations


from .base import LayerCache, apply_rope, kv_append, kv_cache, kv_contents
from .objects import CapturePoint, ObjectKind, Rotation, activation_dtype, per_token_object


class GQAKeysValues(LayerCache):
    mixer = "gqa"
    cache_class = "KVCache"

    def __init__(self, attn):
        self.attn = attn
        self.n_kv = getattr(attn, "n_kv_heads", None) or attn.num_key_value_heads
        self.head_dim = attn.k_proj.weight.shape[0] // self.n_kv
        self.v_head_dim = attn.v_proj.weight.shape[0] // self.n_kv
        if "scales" in attn.k_proj:  # quantized: the packed weight is narrower than the output
            self.head_dim = attn.k_proj.scales.shape[0] // self.n_kv
            self.v_head_dim = attn.v_proj.scales.shape[0] // self.n_kv
        self.k_norm = attn.k_norm if "k_norm" in attn else None
        dtype = activation_dtype(attn.k_proj)
        self.objects = (
            per_token_object("keys", ObjectKind.TOKEN_KEY, (1, self.n_kv, "T", self.head_dim),
                             dtype, Rotation.of(attn.rope, self.head_dim)),
            per_token_object("values", ObjectKind.TOKEN_VALUE,
                             (1, self.n_kv, "T", self.v_head_dim), dtype, Rotation("none")),
        )

    def taps(self):
        def keys_raw(record, args, out):
            record("keys", CapturePoint.RAW, out)
            if self.k_norm is None:
                record("keys", CapturePoint.NORMED, out)

        def keys_normed(record, args, out):
            record("keys", CapturePoint.NORMED, out.reshape(*out.shape[:2], -1))

        def values(record, args, out):
            record("values", CapturePoint.RAW, out)
            record("values", CapturePoint.NORMED, out)

        taps = [(self.attn.k_proj, keys_raw), (self.attn.v_proj, values)]
        if self.k_norm is not None:
            taps.append((self.k_norm, keys_normed))
        return taps

    def read_engine(self, cache):
        keys, values = kv_contents(cache)
        return {"keys": keys, "values": values}

    def to_engine(self, objects, point, offset=0, previous=None, rotate=apply_rope):
        keys, values = objects["keys"], objects["values"]
        if (p := self.point_of("keys", point)) != CapturePoint.ENGINE:
            B, T, _ = keys.shape
            keys = keys.reshape(B, T, self.n_kv, self.head_dim)
            if p == CapturePoint.RAW and self.k_norm is not None:
                keys = self.k_norm(keys)
            keys = rotate("keys", self.attn.rope, keys.transpose(0, 2, 1, 3), offset)
        if self.point_of("values", point) != CapturePoint.ENGINE:
            B, T, _ = values.shape
            values = values.reshape(B, T, self.n_kv, self.v_head_dim).transpose(0, 2, 1, 3)
        return {"keys": self.cast("keys", keys), "values": self.cast("values", values)}

    def build_cache(self, objects):
        return kv_cache(self.cast("keys", objects["keys"]), self.cast("values", objects["values"]))

    def append(self, cache, objects):
        return kv_append(cache, self.cast("keys", objects["keys"]),
                         self.cast("values", objects["values"]))
