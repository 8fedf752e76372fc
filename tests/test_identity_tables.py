"""Identity tables: per-token offsets of the ids at t and t-1, fitted in closed form with the map."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_kvtrans as kv
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.training.fit import FitConfig, fit
from mlx_kvtrans.translators.identity_tables import TableMoments, low_rank, table_offsets
from mlx_kvtrans.translators.recipes import RecipeError
from mlx_kvtrans.translators.translator import translate_cache


def test_tables_recover_known_per_token_offsets():
    """y = W x + b + A[id_t] + B[id_{t-1}] with x independent of the ids: the map and both
    tables come back (the shrinkage leaves n / (n + 2) of each offset)."""
    rng = np.random.default_rng(0)
    vocab, din, dout, n = 12, 5, 3, 40_000
    w, b = rng.normal(size=(dout, din)), rng.normal(size=dout)
    a, bb = rng.normal(size=(vocab, dout)), rng.normal(size=(vocab, dout))
    a -= a.mean(0)
    bb -= bb.mean(0)
    ids = rng.integers(0, vocab, size=(1, n))
    x = rng.normal(size=(1, n, din))
    prev = np.concatenate([np.zeros((1, 1, dout)), bb[ids[:, :-1]]], axis=1)
    y = x @ w.T + b + a[ids] + prev
    stats = TableMoments(vocab, din, dout)
    for s in range(0, n, 10_000):  # streamed in batches, as a fit does
        stats.add(mx.array(x[:, s:s + 10_000].astype(np.float32)),
                  mx.array(y[:, s:s + 10_000].astype(np.float32)), mx.array(ids[:, s:s + 10_000]))
    # the map a fit without tables finds: the tables' means are zero, so W and b are unbiased
    tables = stats.solve(w, b, rank=dout)
    got = table_offsets(tables, mx.array(ids[:, :200]))
    want = a[ids[:, :200]] + prev[:, :200]
    assert np.abs(np.asarray(got) - want)[:, 1:].max() < 0.1


def test_low_rank_is_the_truncated_svd():
    rng = np.random.default_rng(1)
    table = rng.normal(size=(30, 2)) @ rng.normal(size=(2, 6))  # rank 2
    u, v = low_rank(table, 2)
    assert u.shape == (30, 2) and v.shape == (2, 6)
    assert np.allclose(u @ v, table, atol=1e-5)
    u, v = low_rank(table, 10)  # never wider than the table
    assert u.shape == (30, 6) and v.shape == (6, 6)
    u, v = low_rank(table, 1)
    assert np.linalg.norm(u @ v - table) < np.linalg.norm(table)


def windows(n, length=64, seed=0):
    return [mx.random.randint(0, 259, (4, length), key=mx.random.key(seed + i)) for i in range(n)]


def layer0_error(tr, src, tgt, tokens):
    T = tokens.shape[1]
    native = kv.capture(tgt, tokens).engine[0].keys[..., :T, :]
    moved = translate_cache(tr, src, tgt, tokens)[0].keys[..., :T, :]
    return float(mx.abs(native - moved).mean())


def test_tables_carry_what_the_target_layer0_holds_per_token(loaded, tmp_path):
    """A target's layer-0 keys are a function of the token alone: from an unrelated source's
    features, a map gets them roughly; with rank-full tables they come out several times
    closer on held-out tokens. The tables save, load and distil like every parameter."""
    src, tgt = loaded("qwen3"), loaded("llama")
    config = FitConfig(point=1, token_identity="ids")
    data = windows(24)
    plain = fit(src.model, tgt.model, data, config=config)
    tabled = fit(src.model, tgt.model, data, config=FitConfig(point=1, token_identity="ids",
                                                              identity_tables=64))
    held_out = mx.random.randint(0, 259, (2, 48), key=mx.random.key(77))
    before = layer0_error(plain, src.model, tgt.model, held_out)
    after = layer0_error(tabled, src.model, tgt.model, held_out)
    assert after < 0.5 * before, (before, after)
    assert any(k.endswith("table1.u") for k in tabled.params)

    path = artifact.save(tabled, tmp_path / "tr", src, tgt)
    again = artifact.load(path, src, tgt)
    assert again.recipes == tabled.recipes
    lookups = [k for k in again.params if k.endswith(".u")]
    assert lookups and all(again.params[k].dtype == mx.bfloat16 for k in lookups)
    a = translate_cache(tabled, src.model, tgt.model, held_out)[0].keys[..., :48, :]
    b = translate_cache(again, src.model, tgt.model, held_out)[0].keys[..., :48, :]
    assert mx.allclose(a, b, atol=1e-5)


def test_tables_need_token_identity(loaded):
    src, tgt = loaded("qwen3"), loaded("llama")
    with pytest.raises(RecipeError, match="token identity"):
        FitConfig(identity_tables=8).plan(kv.layout_of(src.model), kv.layout_of(tgt.model))
