"""The gate's copy probe: both models read spans of the translated history again, and a target
that lost the history's exact tokens copies them worse than the source. A probe leaves every
cache as it was; noise the tail misses is caught; a translator that copies worse than its
target's own cache by over `COPY_LOSS` on held-out text re-reads every switch, and one switch
over its threshold re-reads and continues as native."""

from __future__ import annotations

import copy
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import RotatingKVCache

from mlx_kvtrans.session import Session
from mlx_kvtrans.session.line import CacheLine
from mlx_kvtrans.tools.verify import max_abs_diff
from mlx_kvtrans.training import calibrate
from mlx_kvtrans.translators import artifact, gate
from test_gate import SHIPPED, held_out, native_cache, noise, shipped, used


def with_copy_band(translator, **copy_band):
    """The translator with a copy probe calibration of `copy_band` in every band."""
    calibration = translator.info["gate"]
    band = {"threshold": 0.5, "loss": 0.0, **copy_band}
    bands = [{**b, "copy": band} for b in calibration["bands"]]
    return replace(translator, info={**translator.info, "gate": {**calibration, "bands": bands}})


def test_a_band_takes_its_own_copy_record_or_none():
    calibration = {"tail": gate.GATE_TOKENS, "bands": [
        {"prefix": [32, 256]}, {"prefix": [257, 512], "copy": {"threshold": 0.4, "loss": 0.3}}]}
    assert gate.copy_band(calibration, gate.GATE_TOKENS, 100) is None  # not the next band's
    assert gate.copy_band(calibration, gate.GATE_TOKENS, 300)["threshold"] == 0.4
    assert gate.copy_band(calibration, gate.GATE_TOKENS, 4000)["threshold"] == 0.4
    assert gate.copy_band(calibration, 4, 300) is None  # calibrated for another tail
    assert gate.copy_refusal(calibration, gate.GATE_TOKENS, 300).startswith("fidelity gate")
    assert gate.copy_refusal(calibration, gate.GATE_TOKENS, 100) is None


def test_copy_spans_lie_evenly_within_the_translated_span():
    spans = gate.copy_spans(10, 210)
    assert [s.start for s in spans] == [10, 60, 110, 160]
    assert all(len(s) == gate.COPY_WIDTH and 10 <= s.start and s.stop <= 210 for s in spans)
    assert len(gate.copy_spans(0, 40)) == 2 and gate.copy_spans(0, 15) == []


def quantized(cache: list) -> list:
    maybe_quantize_kv_cache(cache, 0, 64, 8)
    return cache


@pytest.mark.parametrize("name,kind", [("qwen3-small", None), ("qwen3-small", quantized),
                                       ("qwen3.5-a", None), ("kimi-vl", None)])
def test_a_peek_leaves_the_line_as_it_was(name, kind, zoo):
    """Attention caches (8-bit ones too) are trimmed back and recurrent states put back: the
    logits of the peek are a forward's, the next forward is as if there had been none, and
    nothing else of the line moves."""
    lm = zoo(name)
    kind = kind or (lambda cache: cache)
    tokens = held_out(lm.tokenizer, 48, 1)
    line = CacheLine("m", lm, cache=kind(native_cache(lm, tokens[:40])), seen=40)
    line.next_logits, line.states = mx.zeros((4,)), {40: []}
    probe = tokens[5:25]
    expected = lm.model(mx.array([probe]), cache=kind(native_cache(lm, tokens[:40])))[0]
    assert max_abs_diff(line.peek(probe), expected) <= 1e-5
    x = mx.array([tokens[40:48]])
    assert max_abs_diff(lm.model(x, cache=line.cache),
                        lm.model(x, cache=kind(native_cache(lm, tokens[:40])))) <= 1e-5
    assert (line.seen, line.states, line.next_logits.shape) == (40, {40: []}, (4,))


def test_a_cache_that_cannot_be_put_back_is_not_peeked(zoo):
    lm = zoo("qwen3-small")
    window = [RotatingKVCache(max_size=64) for _ in lm.model.layers]
    lm.model(mx.array([held_out(lm.tokenizer, 40, 2)]), cache=window)
    line = CacheLine("m", lm, cache=window, seen=40)
    assert line.peek([5, 6, 7]) is None and all(c.offset == 40 for c in window)


def test_the_probe_sees_noise_the_tail_misses(zoo):
    """Into an MLA target a noise latent is normalised on install and the tail's NLL barely
    moves; copying the history shows it. A good translation copies as its target's own cache
    does."""
    tr, src, tgt = shipped(used("kimi-linear", "kimi-vl"), zoo)
    bare = replace(tr, info={k: v for k, v in tr.info.items() if k != "gate"})
    losses = {"good": [], "noise": []}
    for seed in range(3):
        window = held_out(tgt.tokenizer, 250, seed)
        for name, t in (("good", bare), ("noise", noise(bare, 10.0))):
            session = calibrate.window_switch(t, src, tgt, window, 240, "read")
            translated, native, _ = calibrate.copy_gaps(session)
            losses[name].append(translated - native)
            tail, _ = gate.threshold(tr.info["gate"], gate.GATE_TOKENS, 0.0, 240)
            assert session.switches[-1].gate_gap <= tail  # the tail alone lets it stand
    assert max(abs(x) for x in losses["good"]) < 0.05, losses
    assert min(losses["noise"]) > 0.4, losses


def test_a_translator_that_copies_worse_than_native_rereads_every_switch(zoo):
    tr, src, tgt = shipped(used("qwen3-small", "qwen3-large"), zoo)
    lossy = with_copy_band(tr, loss=gate.COPY_LOSS + 0.1)
    s = Session({"a": src, "b": tgt}, {("a", "b"): lossy, ("b", "a"): lossy}, active="a")
    s.add(held_out(src.tokenizer, 120, 3))
    list(s.generate(4))
    s.switch("b")
    s.add(held_out(src.tokenizer, 40, 4))
    list(s.generate(4))
    s.switch("a")
    s.add(held_out(src.tokenizer, 40, 5))
    list(s.generate(4))
    status = s.switch("b")  # every switch, the first and a later one
    for status in s.switches:
        assert (status.status, status.gate, status.tokens_translated) == \
            ("fallback", "fired", 0), status
        assert "copies the history" in status.reason and "lose facts" in status.reason
    x = mx.array([[s.tokens[-1], 11, 12]])
    assert max_abs_diff(tgt.model(x, cache=copy.deepcopy(s.lines["b"].cache)),
                        tgt.model(x, cache=native_cache(tgt, s.tokens[:-1]))) <= 1e-4
    off = Session({"a": src, "b": tgt}, {("a", "b"): lossy}, active="a", gate_tokens=0)
    off.add(held_out(src.tokenizer, 120, 3))
    list(off.generate(4))
    assert off.switch("b").status == "applied"  # no gate, no probe


@pytest.mark.parametrize("threshold,outcome", [(1e9, "applied"), (-1e9, "fallback"),
                                               (None, "applied")])
def test_one_switch_over_the_copy_threshold_rereads(threshold, outcome, zoo):
    """The probe runs where the tail passed; over its threshold the switch re-reads at once (a
    wider tail would copy no better) and the conversation continues as native. A band with no
    threshold (the target barely copies from its history) is not probed."""
    tr, src, tgt = shipped(used("qwen3.5-a", "qwen3.5-b"), zoo)
    s = Session({"a": src, "b": tgt}, {("a", "b"): with_copy_band(tr, threshold=threshold)},
                active="a", escalate=True)
    s.add(held_out(src.tokenizer, 150, 4))
    list(s.generate(4))
    status = s.switch("b")
    assert status.status == outcome and status.copy_threshold == threshold, status
    if threshold is None:
        assert (status.copy_gap, status.copy_tokens, status.gate) == (None, 0, "passed")
        return
    assert status.copy_tokens == 4 * (gate.COPY_WIDTH - gate.COPY_SKIP)
    if outcome == "fallback":
        assert status.gate == "fired" and "copies the history" in status.reason
        assert "the gate fired" not in status.setting_note and status.tokens_translated == 0
    else:
        assert status.gate == "passed" and status.gate_gap <= status.gate_threshold
    x = mx.array([[s.tokens[-1], 11, 12]])
    line = s.lines["b"]
    if outcome == "fallback":
        assert max_abs_diff(tgt.model(x, cache=copy.deepcopy(line.cache)),
                            tgt.model(x, cache=native_cache(tgt, s.tokens[:-1]))) <= 1e-4
    s.add([7, 8, 9])
    list(s.generate(4))  # the line reads on after the probe


def test_calibration_records_the_copy_probe(zoo):
    """Per band: the mean loss against the target's own cache and the history's worth to the
    target's copying, too small on the zoo's models to judge one switch by."""
    tr, src, tgt = shipped(used("qwen3-small", "qwen3-large"), zoo)
    record = calibrate.calibrate(tr, src, tgt, held_out(tgt.tokenizer, 4000, 2),
                                 calibrate.CalibrationConfig(windows=3))
    for band in record["bands"]:
        probe = band["copy"]
        assert probe["native"]["windows"] >= 3  # of 6: the band's probe read half or more
        assert probe["loss"] == pytest.approx(
            probe["translated"]["mean"] - probe["native"]["mean"], abs=2e-4)
        assert abs(probe["loss"]) < gate.COPY_LOSS  # a good translator copies as native
        # the zoo's small models barely copy from their history: no switch is judged by it
        assert probe["worth"] < gate.COPY_WORTH and "threshold" not in probe


def test_one_switch_is_judged_by_copying_where_the_history_is_worth_it():
    """A band's threshold (the native gap's quantile plus the margin) is recorded only where
    the target's own history lowers its NLL of the repeats by `COPY_WORTH` or more."""
    config = calibrate.CalibrationConfig(windows=4)
    gaps = {k: [0.1, 0.2, 0.3, 0.4] for k in gate.KINDS}
    native = np.array([-0.2, -0.1, 0.0, 0.1])
    for worth, judged in ((gate.COPY_WORTH + 0.5, True), (gate.COPY_WORTH - 0.1, False)):
        copies = np.stack([native + 0.05, native, native + worth], axis=1)
        band = calibrate._band((32, 256), gaps, copies, config)["copy"]
        assert band["worth"] == pytest.approx(worth, abs=1e-4)
        assert band["loss"] == pytest.approx(0.05, abs=1e-4)
        assert ("threshold" in band) == judged
        if judged:
            assert band["threshold"] == pytest.approx(
                np.quantile(native, config.quantile) + calibrate.COPY_MARGIN, abs=1e-4)


def test_the_probe_is_not_run_across_tokenizers(zoo):
    across = next(n for n in SHIPPED if "alignment" in artifact.read_manifest(n))
    tr, src, tgt = shipped(across, zoo)
    s = Session({"a": src, "b": tgt}, {("a", "b"): with_copy_band(tr, threshold=-1e9)},
                active="a")
    s.add(held_out(tgt.tokenizer, 150, 6), model="b")
    list(s.generate(0))
    status = s.switch("b")
    assert status.copy_gap is None, status
    assert status.gate_note == "history not probed: the models read different tokens"
