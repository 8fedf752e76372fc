"""Multi-head latent attention: the MLA latent and the rope key (deepseek_v3, kimi_vl, the MLA layers
of kimi_linear and deepseek_v32 / glm_moe_dsa).

`kv_a_proj_with_mqa` outputs `[latent | k_pe]` per token: that is raw for both objects.
latent: normed = `kv_a_layernorm(latent)`; engine = normed as `(B, 1, T, kv_lora_rank)`, never rotated.
rope key: no norm, so normed = raw; engine = RoPE(k_pe) `(B, 1, T, qk_rope_head_dim)`, interleaved,
YaRN when configured. kimi_linear's MLA has no RoPE at all: its engine rope key is the raw k_pe.
mlx-lm stores the latent as the KVCache "keys" and the rope key as its "values".
"""

from __future__ import annotations

import mlx.core as mx

from .base import LayerCache, apply_rope, kv_append, kv_cache, kv_contents
from .objects import CapturePoint, ObjectKind, Rotation, activation_dtype, per_token_object


class MLALatent(LayerCache):
    mixer = "mla"
    cache_class = "KVCache"

    def __init__(self, attn):
        self.attn = attn
        self.rank = attn.kv_lora_rank
        self.rope_dim = attn.qk_rope_head_dim
        self.rope = attn["rope"] if "rope" in attn else None  # kimi_linear's MLA has none
        dtype = activation_dtype(attn.kv_a_proj_with_mqa)
        self.objects = (
            per_token_object("latent", ObjectKind.MLA_LATENT, (1, 1, "T", self.rank), dtype,
                             Rotation("none")),
            per_token_object("rope_key", ObjectKind.ROPE_KEY, (1, 1, "T", self.rope_dim), dtype,
                             Rotation.of(self.rope, self.rope_dim)),
        )

    def taps(self):
        def raw(record, args, out):
            record("latent", CapturePoint.RAW, out[..., : self.rank])
            record("rope_key", CapturePoint.RAW, out[..., self.rank:])
            record("rope_key", CapturePoint.NORMED, out[..., self.rank:])

        def normed(record, args, out):
            record("latent", CapturePoint.NORMED, out)

        return [(self.attn.kv_a_proj_with_mqa, raw), (self.attn.kv_a_layernorm, normed)]

    def read_engine(self, cache):
        latent, rope_key = kv_contents(cache)
        return {"latent": latent, "rope_key": rope_key}

    def to_engine(self, objects, point, offset=0, previous=None, rotate=apply_rope):
        latent, rope_key = objects["latent"], objects["rope_key"]
        if (p := self.point_of("latent", point)) != CapturePoint.ENGINE:
            if p == CapturePoint.RAW:
                latent = self.attn.kv_a_layernorm(latent)
            latent = mx.expand_dims(latent, 1)
        if self.point_of("rope_key", point) != CapturePoint.ENGINE:
            B, T, _ = rope_key.shape
            rope_key = rope_key.reshape(B, T, 1, self.rope_dim).transpose(0, 2, 1, 3)
            if self.rope is not None:
                rope_key = rotate("rope_key", self.rope, rope_key, offset)
        return {"latent": self.cast("latent", latent), "rope_key": self.cast("rope_key", rope_key)}

    def build_cache(self, objects):
        return kv_cache(self.cast("latent", objects["latent"]),
                        self.cast("rope_key", objects["rope_key"]))

    def append(self, cache, objects):
        return kv_append(cache, self.cast("latent", objects["latent"]),
                         self.cast("rope_key", objects["rope_key"]))
