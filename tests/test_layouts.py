"""Layouts are derived from config and modules: check them against each family's config."""

import json

import pytest

import mlx_kvtrans as kv
from mlx_kvtrans.errors import UnsupportedModelError
from mlx_kvtrans.zoo.families import FAMILIES

K = kv.layouts.ObjectKind
EXPECTED_KINDS = {
    "qwen3": {K.TOKEN_KEY, K.TOKEN_VALUE},
    "llama": {K.TOKEN_KEY, K.TOKEN_VALUE},
    "qwen2": {K.TOKEN_KEY, K.TOKEN_VALUE},
    "deepseek_v3": {K.MLA_LATENT, K.ROPE_KEY},
    "kimi_vl": {K.MLA_LATENT, K.ROPE_KEY},
    "kimi_linear": {K.MLA_LATENT, K.ROPE_KEY, K.CONV_HISTORY, K.RECURRENT_STATE},
    "qwen3_next": {K.TOKEN_KEY, K.TOKEN_VALUE, K.CONV_HISTORY, K.RECURRENT_STATE},
    "qwen3_5": {K.TOKEN_KEY, K.TOKEN_VALUE, K.CONV_HISTORY, K.RECURRENT_STATE},
    "deepseek_v32": {K.MLA_LATENT, K.ROPE_KEY, K.INDEXER_KEY},
    "glm_moe_dsa": {K.MLA_LATENT, K.ROPE_KEY, K.INDEXER_KEY},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_has_the_family_objects(loaded, family):
    layout = kv.layout_of(loaded(family).model)
    assert layout.kinds() == EXPECTED_KINDS[family]
    json.dumps(layout.to_json())  # serialisable


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_sizes_are_what_the_engine_caches(loaded, family):
    """After a prefill of T tokens, the engine's per-token objects hold T * bytes_per_token and
    its fixed-size objects fixed_bytes, layer by layer and object by object."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = loaded(family).model
    layout = kv.layout_of(model)
    T = 37
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, 259, (1, T), key=mx.random.key(3)), cache=cache))
    per_token = 0
    for layer, c in zip(layout.layers, cache):
        held = layer.cache.read_engine(c)
        assert set(held) == {o.name for o in layer.objects}
        for obj in layer.objects:
            if obj.per_token:
                assert held[obj.name].nbytes == T * obj.bytes_per_token, (layer.index, obj.name)
                per_token += held[obj.name].nbytes
            else:
                assert held[obj.name].nbytes == obj.fixed_bytes, (layer.index, obj.name)
    assert per_token == T * layout.bytes_per_token


def test_gqa_layout_follows_config(loaded):
    lm = loaded("qwen3")
    c = lm.config
    for layer in kv.layout_of(lm.model).layers:
        keys = layer.cache.object("keys")
        assert keys.engine_shape == (1, c["num_key_value_heads"], "T", c["head_dim"])
        assert keys.rotation.mode == "full" and not keys.rotation.interleaved
        assert keys.bytes_per_token == c["num_key_value_heads"] * c["head_dim"] * 4
        assert layer.cache.object("values").rotation.mode == "none"
    llama = kv.layout_of(loaded("llama").model).layers[0].cache.object("keys")
    assert llama.rotation.scaling == "llama3"


def test_mla_layout_follows_config(loaded):
    lm = loaded("deepseek_v3")
    c = lm.config
    layer = kv.layout_of(lm.model).layers[0]
    assert layer.cache.object("latent").engine_shape == (1, 1, "T", c["kv_lora_rank"])
    rope = layer.cache.object("rope_key")
    assert rope.engine_shape == (1, 1, "T", c["qk_rope_head_dim"])
    assert rope.rotation.interleaved and rope.rotation.scaling == "yarn"
    assert kv.layout_of(loaded("kimi_vl").model).layers[0].cache.object("rope_key").rotation.mode == "full"


def test_kimi_linear_layers_follow_kda_list(loaded):
    lm = loaded("kimi_linear")
    cfg = lm.config["linear_attn_config"]
    layout = kv.layout_of(lm.model)
    for layer in layout.layers:
        if layer.index + 1 in cfg["kda_layers"]:  # 1-based in the config
            assert layer.mixer == "kda"
            state = layer.cache.object("state")
            assert state.engine_shape == (1, cfg["num_heads"], cfg["head_dim"], cfg["head_dim"])
            assert state.dtype == "float32"
            conv = layer.cache.object("conv_q")
            width = cfg["num_heads"] * cfg["head_dim"]
            assert conv.engine_shape == (1, cfg["short_conv_kernel_size"] - 1, width)
        else:
            assert layer.mixer == "mla"
            assert layer.cache.object("rope_key").rotation.mode == "none"  # no RoPE in this MLA


def test_gdn_layout_follows_config(loaded):
    lm = loaded("qwen3_5")
    c = lm.config
    for layer in kv.layout_of(lm.model).layers:
        if (layer.index + 1) % c["full_attention_interval"] == 0:
            keys = layer.cache.object("keys")
            assert keys.rotation.mode == "partial"
            assert keys.rotation.dims == int(c["head_dim"] * 0.25)
        else:
            conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + \
                c["linear_num_value_heads"] * c["linear_value_head_dim"]
            assert layer.cache.object("conv").engine_shape == (1, c["linear_conv_kernel_dim"] - 1, conv_dim)
            assert layer.cache.object("state").engine_shape == (
                1, c["linear_num_value_heads"], c["linear_value_head_dim"], c["linear_key_head_dim"])
            assert layer.cache.object("state").capture_points == (2, 3)


def test_indexer_layout_follows_config(loaded):
    lm = loaded("deepseek_v32")
    c = lm.config
    layer = kv.layout_of(lm.model).layers[0]
    assert layer.cache.cache_class == "CacheList(KVCache, KVCache)"
    idx = layer.cache.object("indexer_key")
    assert idx.engine_shape == (1, 1, "T", c["index_head_dim"])
    assert idx.rotation.mode == "partial" and idx.rotation.dims == c["qk_rope_head_dim"]
    assert not idx.rotation.interleaved
    glm = kv.layout_of(loaded("glm_moe_dsa").model).layers[0].cache.object("indexer_key")
    assert glm.rotation.interleaved  # glm_moe_dsa defaults indexer_rope_interleave to True


def test_recurrent_state_asked_at_raw_point_gives_inputs(loaded):
    state = kv.layout_of(loaded("qwen3_5").model).layers[0].cache.object("state")
    assert state.point_for(1) == 2 and state.point_for(3) == 3


def test_unsupported_model_type_lists_families(loaded):
    model = loaded("qwen3").model
    model.model_type = "gpt2"
    try:
        with pytest.raises(UnsupportedModelError) as err:
            kv.layout_of(model)
    finally:
        model.model_type = "qwen3"
    for family in kv.layouts.SUPPORTED_FAMILIES:
        assert family in str(err.value)
