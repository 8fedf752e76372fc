"""The chunkwise-parallel gated delta rule equals mlx-lm's token-by-token recurrence."""

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

import mlx_kvtrans as kv
from mlx_kvtrans.capture.instrument import chunked_recurrence
from mlx_kvtrans.layouts.gated_delta import gated_delta_update_chunked, metal_recurrence_available
from mlx_kvtrans.tools.verify import max_abs_diff


def inputs(T, per_channel, Hk=2, Hv=4, Dk=32, Dv=16, weak_decay=False, seed=0):
    keys = mx.random.split(mx.random.key(seed), 8)
    q, k = normalize_qk(mx.random.normal((2, T, Hk, Dk), key=keys[0]),
                        mx.random.normal((2, T, Hk, Dk), key=keys[1]), inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((2, T, Hv, Dv), key=keys[2])
    a = mx.random.normal((2, T, Hv, Dk) if per_channel else (2, T, Hv), key=keys[3])
    b = mx.random.normal((2, T, Hv), key=keys[4])
    low, high = (0.001, 0.05) if weak_decay else (1.0, 16.0)  # weak: the initial state matters
    if weak_decay == "strong":  # chunks decay by 40-60 nats: they factor, near the limit
        low, high = (3.0, 4.0)
    A_log = mx.log(mx.random.uniform(low, high, (Hv, 1) if per_channel else (Hv,), key=keys[5]))
    if weak_decay == "mixed":  # one head forgets fast: some of its chunks do not factor
        A_log = mx.concatenate([A_log[:1] + 7.0, A_log[1:]])
    dt_bias = 0.5 * mx.random.normal((Hv, Dk) if per_channel else (Hv,), key=keys[6])
    state = 0.5 * mx.random.normal((2, Hv, Dv, Dk), key=keys[7])
    return q, k, v, a, b, A_log, dt_bias, state


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("T", [1, 3, 16, 33, 64, 257])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("weak_decay", [False, True])
def test_chunked_equals_recurrence(per_channel, T, with_state, weak_decay):
    q, k, v, a, b, A_log, dt_bias, state = inputs(T, per_channel, weak_decay=weak_decay)
    state = state if with_state else None
    y_ref, s_ref = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, use_kernel=False)
    for chunk in (None, 8):
        y, s = gated_delta_update_chunked(q, k, v, a, b, A_log, dt_bias, state, chunk_size=chunk)
        assert max_abs_diff(y, y_ref) <= 2e-5
        assert max_abs_diff(s, s_ref) <= 2e-5
        for tree in (False, True):  # the chunks one after another, or composed as a tree
            none, s = gated_delta_update_chunked(q, k, v, a, b, A_log, dt_bias, state,
                                                 chunk_size=chunk, state_only=True, tree=tree)
            assert none is None and max_abs_diff(s, s_ref) <= 2e-5


def test_kda_chunks_that_decay_fast_are_summed_apart():
    """Per-channel decays factor into matmuls chunk by chunk; a chunk's channel that decays by
    more than FACTOR_SPAN nats is gathered and summed pairwise (both paths in one call)."""
    from mlx_kvtrans.layouts.gated_delta import log_decay, _unsafe_channels

    q, k, v, a, b, A_log, dt_bias, state = inputs(64, True, weak_decay="mixed")
    gamma = mx.cumsum(log_decay(A_log, a, dt_bias).reshape(2, 2, 32, 4, 32), axis=2)
    unsafe = _unsafe_channels(mx.moveaxis(gamma[:, :, -1], 2, 1))
    assert unsafe is not None and 0 < unsafe[0].size < 2 * 4 * 2 * 32
    y_ref, s_ref = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, use_kernel=False)
    y, s = gated_delta_update_chunked(q, k, v, a, b, A_log, dt_bias, state, chunk_size=32)
    assert max_abs_diff(y, y_ref) <= 2e-5 and max_abs_diff(s, s_ref) <= 2e-5


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("decay", [True, "mixed", "strong"], ids=["weak", "mixed", "strong"])
def test_chunked_gradients_equal_recurrence_gradients(per_channel, decay):
    q, k, v, a, b, A_log, dt_bias, state = inputs(40, per_channel, weak_decay=decay)

    def loss(update):
        def f(q, k, v, a, b, state):
            y, s = update(q, k, v, a, b, A_log, dt_bias, state)
            return (y ** 2).sum() + (s ** 2).sum()
        return mx.grad(f, argnums=(0, 1, 2, 3, 4, 5))

    ref = loss(lambda *x: gated_delta_update(*x, use_kernel=False))(q, k, v, a, b, state)
    got = loss(gated_delta_update_chunked)(q, k, v, a, b, state)
    for g, r in zip(got, ref):
        assert mx.all(mx.isfinite(g)).item()  # a decay of e^-50 has a finite gradient too
        assert max_abs_diff(g, r) <= 1e-4 * max(1.0, float(mx.abs(r).max()))

    def state_loss(update):  # what distilling through a replayed state differentiates
        return mx.grad(lambda *x: (update(*x[:5], A_log, dt_bias, x[5])[1] ** 2).sum(),
                       argnums=(0, 1, 2, 3, 4, 5))
    ref = state_loss(lambda *x: gated_delta_update(*x, use_kernel=False))(q, k, v, a, b, state)
    for tree in (False, True):
        got = state_loss(lambda *x, tree=tree: gated_delta_update_chunked(
            *x, state_only=True, tree=tree))(q, k, v, a, b, state)
        for g, r in zip(got[1:], ref[1:]):  # q does not reach the state
            assert mx.all(mx.isfinite(g)).item()
            assert max_abs_diff(g, r) <= 1e-4 * max(1.0, float(mx.abs(r).max()))


@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_next", "qwen3_5"])
def test_models_run_the_chunked_recurrence_unchanged(loaded, family):
    model = loaded(family).model
    toks = mx.random.randint(0, 259, (2, 70), key=mx.random.key(3))
    native = model(toks)
    with chunked_recurrence():
        chunked = model(toks)
    assert max_abs_diff(chunked, native) <= 1e-4
    cap = kv.capture(model, toks[:1])
    layer = cap.layout.layers[0]
    _, state = kv.replay(layer.cache, cap.layer(0, 2)["state"], parallel=True)
    assert max_abs_diff(state, cap.layer(0, 3)["state"]) <= 1e-5


@pytest.mark.skipif(not metal_recurrence_available(),
                    reason="mlx-lm's Metal recurrence kernel runs only on a Mac GPU")
@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_5"])
def test_metal_kernel_replay_equals_the_pure_mlx_twins(loaded, family):
    model = loaded(family).model
    cap = kv.capture(model, mx.random.randint(0, 259, (1, 64), key=mx.random.key(2)))
    layer = cap.layout.layers[0]
    inputs = cap.layer(0, 2)["state"]
    _, kernel = kv.replay(layer.cache, inputs, use_kernel=True)
    _, ops = kv.replay(layer.cache, inputs, use_kernel=False)
    _, chunked = kv.replay(layer.cache, inputs, parallel=True)
    assert max_abs_diff(kernel, ops) <= 1e-4 and max_abs_diff(kernel, chunked) <= 1e-4


def test_log_decay_is_mlx_lm_compute_g_with_its_gradient():
    """log g by `fast_math` (off a GPU) is log of mlx-lm's g, and its gradient is softplus's,
    also where a + dt_bias is 0."""
    import mlx.nn as nn

    from mlx_kvtrans.layouts.gated_delta import log_decay

    a = mx.concatenate([mx.random.normal((1, 64, 4, 8), key=mx.random.key(3)) * 8,
                        mx.zeros((1, 1, 4, 8))], axis=1)
    A_log = mx.random.normal((4, 8), key=mx.random.key(4))
    dt_bias = mx.zeros((4, 8))
    ref = lambda x: -mx.exp(A_log) * nn.softplus(x + dt_bias)  # noqa: E731
    assert float(mx.abs(log_decay(A_log, a, dt_bias) - ref(a)).max()) <= 1e-6 * float(
        mx.abs(ref(a)).max())
    ours, theirs = (mx.grad(lambda x, f=f: f(x).sum())(a)
                    for f in (lambda x: log_decay(A_log, x, dt_bias), ref))
    assert float(mx.abs(ours - theirs).max()) <= 1e-5
