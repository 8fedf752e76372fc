"""The closed-form solve from streamed moments: the least-squares map lstsq finds, the ridge
objective its docstring states, and the pseudo-inverse when the system is singular."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_kvtrans.translators.stats import Moments, solve


def data(n=600, din=6, dout=3, seed=0, noise=0.1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, din)) + rng.normal(size=din)  # non-zero means: the bias matters
    w = rng.normal(size=(din, dout))
    y = x @ w + rng.normal(size=dout) + noise * rng.normal(size=(n, dout))
    return x.astype(np.float32), y.astype(np.float32)


def moments_of(x, y, batches=3):
    """Moments streamed over a few batches, as a fit accumulates them."""
    m = Moments(x.shape[1], y.shape[1])
    for xb, yb in zip(np.array_split(x, batches), np.array_split(y, batches)):
        m.add(mx.array(xb), mx.array(yb))
    return m


def lstsq(x, y, bias=True):
    """(weight (dout, din), bias (dout,), predictions) of numpy's least squares, in float64."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    a = np.hstack([x, np.ones((len(x), 1))]) if bias else x
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    w, b = (coef[:-1], coef[-1]) if bias else (coef, np.zeros(y.shape[1]))
    return w.T, b, a @ coef


def r2_of(y, pred):
    y = y.astype(np.float64)
    return 1 - ((y - pred) ** 2).sum(0) / ((y - y.mean(0)) ** 2).sum(0)


@pytest.mark.parametrize("bias", [True, False])
def test_solve_matches_lstsq_with_no_ridge(bias):
    x, y = data()
    fit = solve(moments_of(x, y), ridge=1e-12, bias=bias)
    w, b, pred = lstsq(x, y, bias)
    assert not fit.used_pinv
    np.testing.assert_allclose(fit.weight, w, atol=1e-4)
    np.testing.assert_allclose(fit.bias, b, atol=1e-4)
    np.testing.assert_allclose(fit.r2, r2_of(y, pred), atol=1e-5)
    assert fit.weight.shape == (3, 6) and fit.bias.shape == (3,)
    if not bias:
        assert np.all(fit.bias == 0)


def test_solve_minimises_the_stated_ridge_objective():
    """argmin ||W x + b - y||^2 + lam ||W||^2 with lam = ridge * tr(Cxx) / din, b unpenalised:
    lstsq on the centred data stacked over sqrt(lam) I."""
    x, y = data(n=80, noise=1.0)
    ridge = 0.5
    fit = solve(moments_of(x, y), ridge=ridge)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    xc, yc = x64 - x64.mean(0), y64 - y64.mean(0)
    lam = ridge * np.trace(xc.T @ xc) / x.shape[1]
    a = np.vstack([xc, np.sqrt(lam) * np.eye(x.shape[1])])
    w = np.linalg.lstsq(a, np.vstack([yc, np.zeros((x.shape[1], y.shape[1]))]), rcond=None)[0]
    np.testing.assert_allclose(fit.weight, w.T, atol=1e-4)
    np.testing.assert_allclose(fit.bias, y64.mean(0) - x64.mean(0) @ w, atol=1e-4)
    assert np.abs(fit.weight).sum() < np.abs(lstsq(x, y)[0]).sum()  # shrunk


@pytest.mark.parametrize("bias", [True, False])
def test_singular_system_falls_back_to_the_least_norm_least_squares_map(bias):
    """A duplicated input column makes X^T X singular; with no ridge to regularise it, the solve
    takes the pseudo-inverse: the least-squares predictions, the weight split evenly."""
    x, y = data()
    x = np.hstack([x, x[:, 2:3]])  # column 6 == column 2
    fit = solve(moments_of(x, y), ridge=0.0, bias=bias)
    assert fit.used_pinv is True
    w, _, pred = lstsq(x, y, bias)
    np.testing.assert_allclose(x @ fit.weight.T + fit.bias, pred, atol=1e-3)
    np.testing.assert_allclose(fit.weight[:, 2], fit.weight[:, 6], atol=1e-4)
    np.testing.assert_allclose(fit.weight, w, atol=1e-3)  # lstsq is least-norm too
    np.testing.assert_allclose(fit.r2, r2_of(y, pred), atol=1e-4)


def test_ridge_keeps_the_duplicated_column_solvable():
    x, y = data()
    x = np.hstack([x, x[:, 2:3]])
    fit = solve(moments_of(x, y))  # the default ridge makes the system positive definite
    assert fit.used_pinv is False
    np.testing.assert_allclose(x @ fit.weight.T + fit.bias, lstsq(x, y)[2], atol=1e-2)


def test_no_tokens_is_an_error():
    with pytest.raises(ValueError, match="no tokens"):
        solve(Moments(2, 1))


def test_an_output_constant_within_float32_has_no_r2_and_leaves_the_mean_to_the_others():
    """A norm channel's constant bias of 10^4 beside outputs of unit scale: its variance is below
    what float32 sums resolve, so it has no R^2 (nan), and `mean_r2` is the others' mean,
    never a number above 1 that would win a layer assignment."""
    x, y = data(n=400, noise=0.3)
    y = np.hstack([y, np.full((len(y), 1), 1.0e4, dtype=np.float32)])
    m = Moments(x.shape[1], y.shape[1])
    for rows in np.array_split(np.arange(len(x)), 8):  # batches, as a fit streams them
        m.add(mx.array(x[rows]), mx.array(y[rows]))
    fit = solve(m, ridge=1e-12)
    assert np.isnan(fit.r2[-1])
    _, _, pred = lstsq(x, y[:, :-1])
    np.testing.assert_allclose(fit.r2[:-1], r2_of(y[:, :-1], pred), atol=1e-4)
    assert fit.mean_r2 == pytest.approx(float(np.mean(r2_of(y[:, :-1], pred))), abs=1e-4)
    np.testing.assert_allclose(fit.bias[-1], 1.0e4, rtol=1e-6)
