"""The mlx-lm facts this library relies on. An mlx-lm upgrade that changes one fails here first."""

import inspect

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import gated_delta, kimi_linear, qwen3_5, qwen3_next


def test_kv_cache_grows_in_steps_and_state_is_the_whole_buffer():
    c = mlx_cache.KVCache()
    assert c.step == 256
    c.update_and_fetch(mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    keys, values, offset = c.state
    assert offset == 3 and keys.shape[2] == 256  # only [..., :offset, :] is data


def test_recurrence_is_looked_up_in_each_model_module():
    # capture spies on it there; replay calls it from there.
    for module in (qwen3_next, qwen3_5, kimi_linear):
        assert module.gated_delta_update is gated_delta.gated_delta_update
        source = inspect.getsource(module)
        assert "gated_delta_update(\n" in source or "gated_delta_update(" in source
    params = list(inspect.signature(gated_delta.gated_delta_update).parameters)
    assert params[:9] == ["q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "mask"]
    assert "use_kernel" in params


def test_linear_attention_cache_slots():
    src = inspect.getsource(kimi_linear.Model.make_cache)
    assert "ArraysCache(size=4)" in src
    assert "ArraysCache(size=2)" in inspect.getsource(qwen3_5.TextModel.make_cache)


def test_prompt_cache_metadata_that_generate_reads():
    import importlib

    src = inspect.getsource(importlib.import_module("mlx_lm.generate").main)
    assert 'metadata["model"]' in src and 'metadata["tokenizer_config"]' in src


def test_arrays_cache_none_slots_read_as_missing():
    c = mlx_cache.ArraysCache(2)
    assert c[0] is None and c[1] is None


def test_mla_stores_latent_as_keys_and_rope_key_as_values():
    from mlx_lm.models import deepseek_v3

    src = inspect.getsource(deepseek_v3.DeepseekV3Attention.__call__)
    assert "cache.update_and_fetch(kv_latent, k_pe)" in src
    assert "traditional=True" in inspect.getsource(deepseek_v3.DeepseekV3Attention.__init__)
    assert "self.rope" not in inspect.getsource(kimi_linear.KimiMLAAttention.__call__)


def test_generation_batch_steps_merged_copies_of_each_cache():
    # serve's batches: one GenerationBatch per model, built from a conversation's cache
    # (merged: a copy), extended by requests that join, filtered as they end
    from mlx_lm.generate import GenerationBatch, StopSequences, greedy_sampler

    params = list(inspect.signature(GenerationBatch.__init__).parameters)
    assert params[1:] == ["model", "uids", "inputs", "prompt_cache", "tokens", "samplers",
                          "fallback_sampler", "logits_processors", "stop_sequences",
                          "max_tokens"]
    assert all(hasattr(GenerationBatch, m) for m in ("next", "extend", "filter"))
    assert callable(greedy_sampler) and StopSequences().matcher() is not None
    for kind in (mlx_cache.BatchKVCache, mlx_cache.ArraysCache, mlx_cache.CacheList):
        assert all(hasattr(kind, m) for m in ("merge", "extend", "filter", "extract"))
    c = mlx_cache.KVCache()
    c.update_and_fetch(mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    merged = type(c).merge([c])
    assert isinstance(merged, mlx_cache.BatchKVCache)
    merged.update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
    assert c.offset == 3 and mx.array_equal(c.state[0][..., :3, :], mx.ones((1, 2, 3, 4)))
