"""The switch benchmark: the bound measured beside every row, install bytes, a cold switch
whose source prefill runs the chunkwise recurrence yet yields the same first token, and a gated
switch that is a session's switch. No timed assertions: timings are only checked to exist and
to add up."""

import importlib
import json
import os
import time

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

import mlx_kvtrans as kv
from mlx_kvtrans.layouts import gated_delta
from mlx_kvtrans.layouts.gated_delta import metal_recurrence_available
from mlx_kvtrans.session import Session
from mlx_kvtrans.timing.switch import (BenchConfig, bench_switch, cache_nbytes, first_token,
                                       gated_session, gated_switch, source_prefill,
                                       switch_cache)
from mlx_kvtrans.training.fit import FitConfig, fit
from mlx_kvtrans.training.plan import plan


TIMING = importlib.import_module("mlx_kvtrans.timing.switch")


def test_timings_alternate_repeat_while_quick_and_stop_at_their_own_counts(monkeypatch):
    """Runs compared are taken in turn; runs of milliseconds repeat up to QUICK_RUNS within
    QUICK_S (a slow run past the budget stops at `repeats`); a run that must happen once
    (`quick=False`) runs `repeats` times."""
    monkeypatch.setattr(TIMING, "QUICK_RUNS", 5)
    monkeypatch.setattr(TIMING, "QUICK_S", 60.0)
    calls = []
    medians = TIMING._medians({"a": lambda: calls.append("a"),
                               "b": lambda: calls.append("b")}, repeats=2)
    assert calls == ["a", "b"] * 5 and set(medians) == {"a", "b"}
    calls.clear()
    TIMING._median(lambda: calls.append("once"), 1, quick=False)
    assert calls == ["once"]
    calls.clear()
    monkeypatch.setattr(TIMING, "QUICK_S", 0.01)
    TIMING._medians({"fast": lambda: calls.append("fast"),
                     "slow": lambda: (calls.append("slow"), time.sleep(0.02))}, repeats=3)
    assert calls.count("slow") == 3 and calls.count("fast") >= 3


def batches(n=3, length=48, seed=0):
    return [mx.random.randint(0, 259, (4, length), key=mx.random.key(seed + i)) for i in range(n)]


def tiny_translator(S, T):
    return fit(S, T, batches(), plan(kv.layout_of(S), kv.layout_of(T), point=1, nu=2),
               FitConfig(point=1))


def hand_count(cache) -> int:
    """Bytes of an mlx-lm cache, object by object."""
    total = 0
    for c in cache:
        if isinstance(c, CacheList):
            total += hand_count(c.caches)
        elif isinstance(c, KVCache):
            total += c.keys[..., :c.offset, :].nbytes + c.values[..., :c.offset, :].nbytes
        elif isinstance(c, ArraysCache):
            total += sum(a.nbytes for a in c.cache if a is not None)
        else:
            raise AssertionError(f"unexpected cache class {type(c).__name__}")
    return total


@pytest.mark.parametrize("source,target", [("kimi_linear", "kimi_vl"), ("kimi_vl", "kimi_linear")])
def test_bound_parts_are_positive_and_sum_to_the_bound(loaded, source, target):
    S, T = loaded(source).model, loaded(target).model
    row, = bench_switch(tiny_translator(S, T), S, T, BenchConfig([64], repeats=1))
    parts = (row.first_step_s, row.flops_at_peak_s, row.bytes_at_bandwidth_s)
    assert all(p > 0 for p in parts)
    assert row.bound_s == pytest.approx(sum(parts))
    assert row.warm_over_bound == pytest.approx(row.warm_switch_s / row.bound_s)
    assert row.matmul_peak_gflops > 0 and row.bandwidth_gbs > 0
    data = row.to_json()
    assert data["bound_s"] == row.bound_s and data["warm_over_bound"] == row.warm_over_bound
    # a chunked re-reading is timed only for a target with linear-attention layers
    assert (row.reread_chunked_s is not None) == (target == "kimi_linear")
    assert row.reread_chunked_s is None or row.reread_chunked_s > 0


@pytest.mark.parametrize("source,target", [("kimi_linear", "kimi_vl"), ("kimi_vl", "kimi_linear")])
def test_install_bytes_equal_the_installed_caches_nbytes(loaded, source, target):
    S, T = loaded(source).model, loaded(target).model
    tr = tiny_translator(S, T)
    prompt = mx.random.randint(0, 259, (1, 63), key=mx.random.key(64))
    layout = kv.layout_of(T)
    cache = switch_cache(tr, source_prefill(tr, S, prompt), T, layout, prompt)
    assert cache_nbytes(cache) == hand_count(cache)
    assert cache_nbytes(cache) == layout.bytes_per_token * 63 + layout.fixed_bytes
    row, = bench_switch(tr, S, T, BenchConfig([64], repeats=1))  # the prompt: 63 tokens + 1
    assert row.install_bytes == cache_nbytes(cache)


def test_cold_switch_under_chunked_recurrence_gives_the_same_first_token(loaded, monkeypatch):
    S, T = loaded("kimi_linear").model, loaded("kimi_vl").model  # the source has KDA layers
    tr = tiny_translator(S, T)
    tokens = mx.random.randint(0, 259, (1, 96), key=mx.random.key(7))
    prompt, last = tokens[:, :-1], tokens[:, -1:]
    layout = kv.layout_of(T)
    calls = []
    chunked = gated_delta.gated_delta_update_chunked
    monkeypatch.setattr(gated_delta, "gated_delta_update_chunked",
                        lambda *a, **k: calls.append(1) or chunked(*a, **k))
    fast = switch_cache(tr, source_prefill(tr, S, prompt, fast=True), T, layout, prompt)
    assert bool(calls) != metal_recurrence_available()  # off a Mac GPU: the chunkwise form ran
    calls.clear()
    plain = switch_cache(tr, source_prefill(tr, S, prompt, fast=False), T, layout, prompt)
    assert not calls
    assert first_token(T, last, fast).item() == first_token(T, last, plain).item()
    fast = switch_cache(tr, source_prefill(tr, S, prompt, fast=True), T, layout, prompt)
    plain = switch_cache(tr, source_prefill(tr, S, prompt, fast=False), T, layout, prompt)
    logits_fast, logits_plain = T(last, cache=fast), T(last, cache=plain)
    assert mx.abs(logits_fast - logits_plain).max().item() < 1e-4


def test_doctor_reports_memory_bandwidth_and_the_exponential_rates():
    from mlx_kvtrans.translators.gate import GATE_TOKENS
    from mlx_kvtrans.tools.doctor import diagnose

    report = diagnose()
    assert report["memory_bandwidth_gbs"] > 0 and report["fresh_buffer_bandwidth_gbs"] > 0
    assert report["exp_mlx_mvalues_per_s"] > 0 and report["exp_fast_math_mvalues_per_s"] > 0
    assert set(report["short_read_matmul_ms"]) == {"1", str(GATE_TOKENS + 1), "16"}
    assert all(ms > 0 for ms in report["short_read_matmul_ms"].values())


def test_the_cpu_buffer_cache_is_sized_at_import(monkeypatch):
    """Without a GPU the package keeps freed buffers for reuse (1/8 of MLX's memory limit, at
    most 4 GiB, or `KVTRANS_CPU_CACHE_MB`; 0 or an unreadable value leaves MLX's own), unless
    the program set a limit of its own first."""
    from mlx_kvtrans.backend import buffer_cache

    if mx.metal.is_available():
        assert buffer_cache.CPU_CACHE_LIMIT is None
        return
    if buffer_cache.ENV not in os.environ:
        assert buffer_cache.CPU_CACHE_LIMIT == int(min(mx.get_memory_limit() / 8, 4 << 30))
        assert buffer_cache.CPU_CACHE_LIMIT > buffer_cache.MLX_CPU_DEFAULT
    monkeypatch.setenv(buffer_cache.ENV, "64")
    assert buffer_cache.cpu_cache_limit() == 64 << 20
    monkeypatch.setenv(buffer_cache.ENV, "0")
    assert buffer_cache.cpu_cache_limit() is None
    for unreadable in ("lots", "inf", "-5"):
        monkeypatch.setenv(buffer_cache.ENV, unreadable)
        with pytest.warns(RuntimeWarning, match="KVTRANS_CPU_CACHE_MB"):
            assert buffer_cache.cpu_cache_limit() is None
    monkeypatch.setenv(buffer_cache.ENV, "64")
    current = mx.set_cache_limit(123 << 20)  # a program's own limit stays
    try:
        assert buffer_cache.configure() is None
        assert mx.set_cache_limit(buffer_cache.MLX_CPU_DEFAULT) == 123 << 20
        assert buffer_cache.configure() == 64 << 20  # MLX's own is raised
    finally:
        mx.set_cache_limit(current)


@pytest.mark.parametrize("source,target", [("kimi_linear", "kimi_vl"), ("kimi_vl", "kimi_linear")])
def test_the_benchs_gated_switch_is_a_sessions_switch(loaded, source, target):
    """For the same prompt, the switch the bench times and `Session.switch` leave the target
    the same cache (bit for bit), the same gate reading and the same first token."""
    from mlx_kvtrans.models import LoadedModel

    S, T = loaded(source).model, loaded(target).model
    tr = tiny_translator(S, T)
    tokens = mx.random.randint(0, 259, (1, 57), key=mx.random.key(3))
    prompt, last = tokens[0, :-1].tolist(), tokens[:, -1:]
    bench = gated_session(tr, S, T, prompt, int(last.item()), gate_tokens=8, fast=False)
    timed, token = gated_switch(bench)
    timed_again, token_again = gated_switch(bench)  # repeatable: the source is untouched
    session = Session({"source": LoadedModel("source", None, S, None, {}),
                       "target": LoadedModel("target", None, T, None, {})},
                      {("source", "target"): tr}, active="source", gate_tokens=8)
    session.add(prompt)
    list(session.generate(0))
    session.add([int(last.item())])
    switched = session.switch("target")
    assert switched.status == timed.status == "applied"
    assert (timed.tokens_translated, timed.tokens_tail) == (48, 8)
    for a, b in ((timed, switched), (timed_again, switched)):
        assert (a.tokens_translated, a.tokens_tail, a.gate, a.gate_gap) == \
            (b.tokens_translated, b.tokens_tail, b.gate, b.gate_gap)
    # both targets read the prompt's last token in the switch's forward
    assert bench.lines["target"].seen == session.lines["target"].seen == 57
    theirs = next(session.generate(1))
    assert token.item() == token_again.item() == theirs
    mine, theirs = (tree_flatten([c.state for c in s.lines["target"].cache])
                    for s in (bench, session))
    assert [name for name, _ in mine] == [name for name, _ in theirs]
    for (name, x), (_, y) in zip(mine, theirs):
        assert (x is None and y is None) or mx.array_equal(x, y).item(), name


def test_bench_times_switch_and_reread_side_by_side(kimi_pair, tmp_path):
    from typer.testing import CliRunner

    from mlx_kvtrans.cli.main import app

    a, b, paths = kimi_pair
    result = CliRunner().invoke(app, ["bench", "--from", a.name, "--to", b.name, "--translator",
                                      str(paths[(a.name, b.name)]), "--lengths", "32,64",
                                      "--repeats", "1", "--out-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [r["length"] for r in data["rows"]] == [32, 64]
    for r in data["rows"]:
        assert r["warm_switch_s"] > 0 and r["reread_s"] > 0 and r["cold_switch_s"] > 0
        assert r["gated_switch_s"] > 0
        if r["gated_outcome"].startswith("applied"):  # its read and gate: part of the switch
            assert 0 < r["gated_read_s"] < r["gated_switch_s"]
        assert r["speedup_warm"] == pytest.approx(r["reread_s"] / r["warm_switch_s"])
    assert data["blas"] in ("openblas", "accelerate") and data["dtype"] == "float32"
    assert (tmp_path / "bench-kimi_linear__kimi_vl-float32.json").exists()
    assert (tmp_path / "bench-kimi_linear__kimi_vl-float32.png").exists()
