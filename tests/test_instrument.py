"""Run-time hooks on mlx-lm nest in any order and leave everything as it was; the one
indexer-score formula is mlx-lm's own."""

from __future__ import annotations

import importlib

import mlx.core as mx
import pytest

import mlx_kvtrans as kv
from mlx_kvtrans.capture import capture, tapped
from mlx_kvtrans.capture.instrument import (chunked_recurrence, final_norm, head_on_last_token,
                                            hook_module, observe_function, recording_final_rows,
                                            recording_indexer_scores)
from mlx_kvtrans.tools.verify import max_abs_diff

from conftest import HYBRID_RECURRENT


def tokens(n=40):
    return mx.random.randint(0, 259, (1, n), key=mx.random.key(5))


def recorded_inputs(cap):
    return [found[("state", kv.layouts.CapturePoint.NORMED)] for found in cap.objects
            if ("state", kv.layouts.CapturePoint.NORMED) in found]


@pytest.mark.parametrize("family", HYBRID_RECURRENT)
@pytest.mark.parametrize("order", ["capture inside recurrence", "recurrence inside capture"])
def test_capture_records_recurrence_inputs_nested_with_the_chunked_recurrence(loaded, family,
                                                                              order):
    model = loaded(family).model
    reference = recorded_inputs(capture(model, tokens(), points=(2,)))
    assert reference
    layout = kv.layout_of(model)
    if order == "capture inside recurrence":
        with chunked_recurrence(), tapped(model, layout, {kv.layouts.CapturePoint.NORMED}) as rec:
            mx.eval(model(tokens()))
    else:
        with tapped(model, layout, {kv.layouts.CapturePoint.NORMED}) as rec, chunked_recurrence():
            mx.eval(model(tokens()))
    nested = [found[("state", kv.layouts.CapturePoint.NORMED)] for found in rec.joined()
              if ("state", kv.layouts.CapturePoint.NORMED) in found]
    assert len(nested) == len(reference)
    for a, b in zip(reference, nested):
        for x, y in zip(a.arrays(), b.arrays()):
            assert x.shape == y.shape and max_abs_diff(x, y) <= 1e-5


@pytest.mark.parametrize("family", ["qwen3", "kimi_linear", "deepseek_v32"])
def test_a_capture_pays_the_output_head_for_its_last_token_only(loaded, family):
    """Under `head_on_last_token` a forward returns its last token's logits alone, equal to
    the whole forward's, while a hook on the final norm still reads every row; a capture's
    last logits and cache are those of a plain forward."""
    from mlx_lm.models.cache import make_prompt_cache

    model = loaded(family).model
    ids = tokens(24)
    whole = model(ids, cache=make_prompt_cache(model))
    with recording_final_rows(model, 24) as rows, head_on_last_token(model):
        last = model(ids, cache=make_prompt_cache(model))
    assert last.shape[1] == 1 and rows.last(24).shape[0] == 24
    assert max_abs_diff(last[:, -1], whole[:, -1]) < 1e-4
    cap = capture(model, ids, points=(1,))
    assert max_abs_diff(cap.last_logits, whole[:, -1]) < 1e-4
    assert not type(final_norm(model)).__name__.startswith("Hooked")


def test_hooks_leave_classes_and_functions_as_they_were(loaded):
    model = loaded("qwen3_5").model
    module = importlib.import_module("mlx_lm.models.qwen3_5")
    original, layer_class = module.gated_delta_update, type(model.layers[0])
    calls = []
    with observe_function("mlx_lm.models.qwen3_5", "gated_delta_update",
                          lambda *a, **k: calls.append("outer")):
        with hook_module(model.layers[0], before=lambda *a: calls.append("layer")):
            with chunked_recurrence():
                mx.eval(model(tokens(8)))
        assert type(model.layers[0]) is layer_class
    assert module.gated_delta_update is original and type(model.layers[0]) is layer_class
    assert calls.count("layer") == 1 and "outer" in calls
    mx.eval(model(tokens(8)))  # no hook left behind
    assert calls.count("layer") == 1


def test_hooks_restore_when_left_out_of_order(loaded):
    model = loaded("qwen3").model
    base = type(model.layers[1])
    first = hook_module(model.layers[1], before=lambda *a: None)
    second = hook_module(model.layers[1], after=lambda *a: None)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the earlier one leaves first
    assert type(model.layers[1]) is not base  # the later one still holds
    second.__exit__(None, None, None)
    assert type(model.layers[1]) is base


def test_indexer_scores_select_what_mlx_lms_indexer_selects(loaded):
    """The top-k of `indexer_scores` are the indices mlx-lm's own `Indexer` returns."""
    model = loaded("deepseek_v32").model
    indexer = model.layers[0].self_attn.indexer
    n = indexer.index_topk + 24
    selected = {}

    def keep(module, args, kwargs, out):
        selected.setdefault("indices", out)

    cap = capture(model, tokens(n)[:, :-1], points=(3,))
    with hook_module(indexer, after=keep), recording_indexer_scores(model) as scores:
        mx.eval(model(tokens(n)[:, -1:], cache=cap.engine))
    ours = scores[0].reshape(-1)
    top = set(mx.argpartition(ours, kth=-indexer.index_topk)[-indexer.index_topk:].tolist())
    assert ours.shape == (n,)
    assert set(selected["indices"].reshape(-1).tolist()) == top


@pytest.mark.parametrize("name", ["kimi-vl", "dsa", "kimi-linear"])
def test_short_reads_over_mla_attend_in_the_latent_space_as_mlx_lm_does(name):
    """A few tokens over a long MLA cache: the queries absorbed into the latent space, as in
    mlx-lm's decode step (the expanded keys and values are never computed), and every head
    attending as rows of one (off a GPU with `fast_math`'s softmax), give mlx-lm's own logits,
    as does a one-token step; a long read keeps mlx-lm's expanded form."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_kvtrans.capture.instrument import absorbed_wins, short_reads

    model = kv.load(name).model
    ids = mx.random.randint(3, 400, (1, 300), key=mx.random.key(7))
    attention = next(m for m in model.modules() if hasattr(m, "embed_q"))
    assert absorbed_wins(attention, 9, 291) and not absorbed_wins(attention, 290, 290)
    unembedded = []  # the length of what each unembed_out call reads
    heads = set()  # (read length, heads of the queries mlx-lm's attention was given)
    for length in (1, 9, 290):
        plain, short = make_prompt_cache(model), make_prompt_cache(model)
        model(ids[:, :300 - length], cache=plain)
        model(ids[:, :300 - length], cache=short)
        expected = model(ids[:, 300 - length:], cache=plain)
        seen = lambda q, *args, **kwargs: heads.add((length, q.shape[1]))  # noqa: E731
        with hook_module(attention.unembed_out,
                         before=lambda m, args, kwargs: unembedded.append(args[0].shape[2])), \
                observe_function("mlx_lm.models.base", "scaled_dot_product_attention", seen), \
                observe_function("mlx_kvtrans.backend.fast_math", "attention", seen):
            with short_reads(model):
                got = model(ids[:, 300 - length:], cache=short)
        assert max_abs_diff(expected, got) < 1e-4
        assert bool((mx.argmax(expected, -1) == mx.argmax(got, -1)).all())
    # the short reads unembed the attention output (1 and 9 rows), the long one the 300
    # cached latents, in mlx-lm's own expanded form; every hook left
    assert set(unembedded) == {1, 9, 300}
    # in the latent space every head is a row of one
    assert heads == {(1, 1), (9, 1), (290, attention.num_heads)}
    assert "_kvtrans_hooks" not in type(attention.embed_q).__dict__


@pytest.mark.parametrize("name", ["qwen3-large", "qwen3.5-a"])
def test_short_reads_over_grouped_attention_give_mlx_lm_logits(name):
    """A read of a few tokens (grouped-query attention, a hybrid's attention layers) off a GPU
    takes `fast_math`'s softmax, a long one MLX's own; both give mlx-lm's own logits."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_kvtrans.capture.instrument import SHORT_READ, short_reads

    model = kv.load(name).model
    ids = mx.random.randint(3, 400, (1, 300), key=mx.random.key(8))
    fast = []  # the read lengths fast_math's attention served
    for length in (1, 9, SHORT_READ + 1):
        plain, short = make_prompt_cache(model), make_prompt_cache(model)
        model(ids[:, :300 - length], cache=plain)
        model(ids[:, :300 - length], cache=short)
        expected = model(ids[:, 300 - length:], cache=plain)
        with observe_function("mlx_kvtrans.backend.fast_math", "attention",
                              lambda q, *args, **kwargs: fast.append(q.shape[2])):
            with short_reads(model):
                got = model(ids[:, 300 - length:], cache=short)
        assert max_abs_diff(expected, got) < 1e-4
        assert bool((mx.argmax(expected, -1) == mx.argmax(got, -1)).all())
    assert set(fast) == ({1, 9} if mx.default_device() != mx.gpu else set())
