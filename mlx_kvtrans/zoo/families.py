"""Small `config.json`s for every supported mlx-lm family, for random-weight models.

Each config is what a Hugging Face checkpoint of that family would carry, shrunk: the cache objects
(their kinds, rotations and layer pattern) are the family's real ones, only the sizes differ. MoE is
off (dense MLPs) because MoE layers run only in float32 on the CPU.
"""

from __future__ import annotations

import copy

# A 4-layer stack so that hybrid families get both layer kinds (3 linear + 1 attention).
_COMMON = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, rms_norm_eps=1e-6,
               max_position_embeddings=4096, tie_word_embeddings=True)

_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, rope_theta=10000.0,
            # Experts are declared (transformers' config validation wants ints) but unused:
            # every layer is below first_k_dense_replace, so every MLP is dense.
            n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=4)

TINY: dict[str, dict] = {
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rope_theta=1_000_000.0),
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rope_theta=500_000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 512}),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=1_000_000.0),
    "deepseek_v3": dict(model_type="deepseek_v3", **_MLA,
                        rope_scaling={"type": "yarn", "factor": 4.0, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                      "original_max_position_embeddings": 1024}),
    "kimi_vl": dict(model_type="kimi_vl", text_config=dict(model_type="deepseek_v3", **_MLA)),
    "kimi_linear": dict(
        model_type="kimi_linear", num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        mla_use_nope=True, rope_theta=10000.0, model_max_length=4096, num_experts=0,
        moe_intermediate_size=64,
        linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2,
                            "head_dim": 32, "short_conv_kernel_size": 4}),
    "qwen3_next": dict(
        model_type="qwen3_next", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=0,
        decoder_sparse_step=1, shared_expert_intermediate_size=0, mlp_only_layers=[],
        moe_intermediate_size=0, rope_theta=10000.0, partial_rotary_factor=0.25,
        full_attention_interval=4),
    "qwen3_5": dict(
        model_type="qwen3_5", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25}),
    "deepseek_v32": dict(model_type="deepseek_v32", **_MLA, index_head_dim=16, index_n_heads=2,
                         index_topk=16),
    "glm_moe_dsa": dict(
        model_type="glm_moe_dsa", **{k: v for k, v in _MLA.items() if k != "rope_theta"},
        index_head_dim=16, index_n_heads=2, index_topk=16, moe_intermediate_size=64,
        routed_scaling_factor=1.0, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=1, topk_group=1, num_experts_per_tok=1, moe_layer_freq=1,
        attention_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}

FAMILIES = tuple(TINY)


def tiny_config(family: str, vocab_size: int, special_token_ids: dict | None = None) -> dict:
    """A complete `config.json` dict for a tiny model of `family` (an mlx-lm model_type).

    `special_token_ids`: bos/eos/pad ids of the tokenizer, so that config defaults of the
    full-size family (ids far outside a small vocab) do not leak in.
    """
    special_token_ids = special_token_ids or {}
    if family not in TINY:
        raise KeyError(f"no tiny config for {family!r}; families: {', '.join(FAMILIES)}")
    config = copy.deepcopy(TINY[family])
    target = config.get("text_config", config)
    for key, value in _COMMON.items():
        target.setdefault(key, value)
    target["vocab_size"] = vocab_size
    target.update(special_token_ids)
    return config


# Per-layer sizes of the real checkpoints, with 4 layers (2 for DeepSeek-V3.2) and MoE off
# (dense MLPs of the checkpoint's dense width), for timing: a switch's cost depends on the
# per-layer objects, a prefill's on the per-layer weights, so the ratios carry over per layer.
REALISTIC: dict[str, dict] = {
    "kimi-linear": dict(  # Kimi-Linear-48B-A3B: MLA latent 512 + rope 64 (no RoPE), KDA 32 x 128
        model_type="kimi_linear", hidden_size=2304, num_hidden_layers=4, intermediate_size=9216,
        num_attention_heads=32, num_key_value_heads=32, head_dim=72, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True,
        rope_theta=10000.0, model_max_length=131072, num_experts=0, moe_intermediate_size=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 32,
                            "head_dim": 128, "short_conv_kernel_size": 4}),
    "kimi-vl": dict(  # Kimi-VL-A3B text model: DeepSeek-V3 MLA, latent 512 + rope 64
        model_type="kimi_vl", text_config=dict(
            model_type="deepseek_v3", hidden_size=2048, num_hidden_layers=4,
            intermediate_size=11264, num_attention_heads=16, num_key_value_heads=16,
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, n_routed_experts=64, n_shared_experts=2, first_k_dense_replace=4,
            rope_theta=800000.0, rms_norm_eps=1e-5, max_position_embeddings=131072)),
    "qwen3.5": dict(  # Qwen3.5-27B: GDN 16 x 128 keys, 48 x 128 values; attention 24/4 x 256
        model_type="qwen3_5", hidden_size=5120, num_hidden_layers=4, intermediate_size=17408,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_value_heads=48,
        linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.25}),
    # DeepSeek-V3.2: MLA 512 + 64, indexer 64 heads x 128, top-k 2048. Two layers: four of its
    # layers beside four of Qwen3.5's, in float32, passed 24 GB (OOM-killed on a 24 GB machine).
    "deepseek-v3.2": dict(
        model_type="deepseek_v32", hidden_size=7168, num_hidden_layers=2, intermediate_size=18432,
        num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256,
        n_shared_experts=1, first_k_dense_replace=4, index_head_dim=128, index_n_heads=64,
        index_topk=2048, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=163840),
}
REALISTIC_PAIRS = {"kimi": ("kimi-linear", "kimi-vl"), "qwen3.5": ("qwen3.5", "qwen3.5"),
                   "dsa": ("qwen3.5", "deepseek-v3.2")}


# The full checkpoints' text-model layer counts, vocabularies and mixtures of experts, for
# projections from the per-layer sizes above (Kimi: FIELD_NOTES section 6; Kimi-Linear puts MLA
# at every fourth layer and the last). The experts set the weights a fit holds (48B, 16B, 671B);
# a token's forward reads only its routed share of them (`training.cost.active_parameters`).
FULL = {"kimi-linear": dict(layers=27, vocab=163840, mla_layers=[4, 8, 12, 16, 20, 24, 27],
                            moe=dict(num_experts=256, num_experts_per_token=8,
                                     moe_intermediate_size=1024, num_shared_experts=1,
                                     first_k_dense_replace=1)),
        "kimi-vl": dict(layers=27, vocab=163840,
                        moe=dict(n_routed_experts=64, num_experts_per_tok=6,
                                 moe_intermediate_size=1408, n_shared_experts=2,
                                 first_k_dense_replace=1)),
        "qwen3.5": dict(layers=64, vocab=248320),
        "deepseek-v3.2": dict(layers=61, vocab=129280,
                              moe=dict(n_routed_experts=256, num_experts_per_tok=8,
                                       moe_intermediate_size=2048, n_shared_experts=1,
                                       first_k_dense_replace=3))}


def full_config(name: str) -> dict:
    """A full checkpoint's text-model config: the per-layer sizes of `REALISTIC[name]` at the
    real layer count, vocabulary and experts (for planning; build it lazily, never run it)."""
    config = copy.deepcopy(REALISTIC[name])
    full = FULL[name]
    target = config.get("text_config", config)
    target["num_hidden_layers"], target["vocab_size"] = full["layers"], full["vocab"]
    target.update(full.get("moe", {}), torch_dtype="bfloat16")  # as the checkpoints ship
    if "linear_attn_config" in target:
        mla = full["mla_layers"]
        target["linear_attn_config"] = {**target["linear_attn_config"], "full_attn_layers": mla,
                                        "kda_layers": [i for i in range(1, full["layers"] + 1)
                                                       if i not in mla]}
    return config


def realistic_config(name: str, vocab_size: int, special_token_ids: dict | None = None) -> dict:
    config = copy.deepcopy(REALISTIC[name])
    target = config.get("text_config", config)
    target["vocab_size"] = vocab_size
    target.update(special_token_ids or {})
    return config
