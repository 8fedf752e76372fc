"""The exponential, softmax attention and logsumexp by integer bits and a polynomial."""

import math

import mlx_kvtrans  # noqa: F401  (selects the BLAS before mlx.core loads)
import mlx.core as mx
import pytest

from mlx_kvtrans.backend import fast_math


def test_exp_is_mlx_exp_within_float32_rounding_with_its_gradient():
    """Across the floats' range (and past it: held at 2^-126 and 2^127.49), within 1.2e-7
    relative of `mx.exp`; its gradient is exp too."""
    x = mx.concatenate([mx.linspace(-87, 88, 20001), mx.random.normal((4000,)) * 5,
                        mx.array([0.0, -0.5 * math.log(2), 0.5 * math.log(2)])])
    ours, ref = fast_math.exp(x), mx.exp(x)
    assert float((mx.abs(ours - ref) / ref).max()) <= 1.2e-7
    assert float(fast_math.exp(mx.array([-1000.0]))[0]) == pytest.approx(2.0 ** -126)
    assert bool(mx.isfinite(fast_math.exp(mx.array([1000.0]))).all())
    small = x[::40]
    grad = mx.grad(lambda v: fast_math.exp(v).sum())(small)
    assert float((mx.abs(grad - mx.exp(small)) / mx.exp(small)).max()) <= 1e-6


@pytest.mark.parametrize("mask", ["none", "additive", "boolean", "causal", "per batch",
                                  "per head", "heads only"])
def test_attention_is_mlx_scaled_dot_product_attention(mask):
    """Every head of the queries over shared keys and values (one head, as MLA's latents), over
    grouped heads or as many heads, with an additive, boolean, causal or no mask, broadcast as
    MLX broadcasts it: MLX's own attention."""
    keys = mx.random.normal((2, 4, 700, 64), key=mx.random.key(1))
    queries = mx.random.normal((2, 8, 9, 64), key=mx.random.key(2))
    uniform = lambda shape: mx.random.uniform(shape=shape, key=mx.random.key(4))  # noqa: E731
    m = {"none": None, "causal": "causal",
         "additive": mx.random.normal((2, 8, 9, 700), key=mx.random.key(3)) * 4,
         "boolean": uniform((1, 1, 9, 700)) > 0.3,
         "per batch": uniform((2, 1, 9, 700)) > 0.3,
         "per head": uniform((1, 8, 9, 700)) > 0.3,
         "heads only": uniform((8, 9, 700)) > 0.3,
         }[mask]
    for heads in (1, 2, 8):
        kv = keys[:, :heads] if heads <= 4 else mx.repeat(keys, 2, axis=1)
        ours = fast_math.attention(queries, kv, kv, 0.125, m)
        ref = mx.fast.scaled_dot_product_attention(queries, kv, kv, scale=0.125, mask=m)
        assert ours.shape == ref.shape
        assert float(mx.abs(ours - ref).max()) < 1e-5, heads


def test_attention_of_a_row_that_sees_no_key_averages_the_values_as_mlx_does():
    """A left-padded row masked everywhere stays finite (MLX's attention averages the values
    there), so nothing NaN reaches the next layer."""
    keys = mx.random.normal((1, 2, 5, 16), key=mx.random.key(7))
    queries = mx.random.normal((1, 4, 5, 16), key=mx.random.key(8))
    mask = mx.arange(5)[None] <= mx.arange(5)[:, None]
    mask = mask & (mx.arange(5)[None] >= 3)  # the first three keys are padding
    ours = fast_math.attention(queries, keys, keys, 0.25, mask)
    ref = mx.fast.scaled_dot_product_attention(queries, keys, keys, scale=0.25, mask=mask)
    assert bool(mx.isfinite(ours).all())
    assert float(mx.abs(ours - ref).max()) < 1e-5


def test_exp_of_half_precision_computes_in_float32():
    x = mx.linspace(-20, 20, 999).astype(mx.bfloat16)
    ours = fast_math.exp(x)
    assert ours.dtype == mx.bfloat16
    ref = mx.exp(x.astype(mx.float32))
    assert float((mx.abs(ours.astype(mx.float32) - ref) / ref).max()) <= 2 ** -8


def test_logsumexp_is_mlx_logsumexp():
    logits = mx.random.normal((8, 4096), key=mx.random.key(5)) * 6
    assert float(mx.abs(fast_math.logsumexp(logits) - mx.logsumexp(logits, axis=-1)).max()) < 1e-5
