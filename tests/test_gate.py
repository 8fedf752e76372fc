"""The fidelity gate: at a switch the target reads the span's last r tokens itself and its NLL on
them is held against the source's; over the translator's calibrated threshold the switch
re-reads instead. Shipped translators pass on held-out text and carry their calibration; noise
weights make it fire; a fired switch continues exactly as a native prefill would."""

from __future__ import annotations

import copy
import hashlib
import random
import shutil
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import mlx_kvtrans as kv
from mlx_kvtrans.training import calibrate
from mlx_kvtrans.translators import gate
from mlx_kvtrans.capture import capture
from mlx_kvtrans.translators.install import install
from mlx_kvtrans.capture.instrument import output_head, recording_final_rows
from mlx_kvtrans.models import weights_dir
from mlx_kvtrans.session import Session
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.tools.verify import max_abs_diff
from mlx_kvtrans.zoo.families import FAMILIES

SHIPPED = artifact.shipped_names()
# translators between models that tokenize differently: each model reads its own tokens
ACROSS = [n for n in SHIPPED if "alignment" in artifact.read_manifest(n)]


def used(source: str, target: str) -> str:
    """The shipped translator a session uses between two zoo models (distilled first)."""
    return artifact.shipped(source, target).name


TEST_TEXT = weights_dir() / "corpus" / "test.txt"


def shipped(name, zoo):
    """(translator, source, target) of a shipped translator, loaded with its pair."""
    manifest = artifact.read_manifest(name)
    src, tgt = zoo(manifest["source"]["name"]), zoo(manifest["target"]["name"])
    return artifact.load(name, src, tgt), src, tgt


def noise(translator, scale=10.0, seed=0):
    """The translator with every weight replaced by Gaussian noise, `scale` times that weight's
    spread."""
    params = {name: (mx.random.normal(w.shape, key=mx.random.key(seed * 100_003 + i))
                     * scale * float(mx.std(w.astype(mx.float32)))).astype(w.dtype)
              for i, (name, w) in enumerate(sorted(translator.params.items()))}
    return replace(translator, params=params)


# Where noise weights make the gate fire. Into an MLA target (kimi-vl, kimi-linear, dsa) a
# garbage latent is normalised on install, and into the qwen3.5 hybrids the harm of noise
# within 30x the weights' spread stays within the gap's natural spread: the gate misses most of
# them (benchmarks/results/gate.md).
CAUGHT = [(used("qwen3-small", "qwen3-large"), 10.0),
          (used("qwen3-large", "qwen3-small"), 10.0), (used("kimi-linear", "kimi-vl"), 30.0)]


def always_firing(translator):
    """The translator with a gate calibration every gap is over."""
    calibration = translator.info["gate"]
    bands = [{**b, "threshold": {k: -1e9 for k in gate.KINDS}} for b in calibration["bands"]]
    return replace(translator, info={**translator.info, "gate": {**calibration, "bands": bands}})


def held_out(tokenizer, n, seed):
    """`n` token ids from a seeded place in the test split."""
    ids = tokenizer.encode(TEST_TEXT.read_text()[:60000])
    start = random.Random(seed).randrange(0, len(ids) - n)
    return ids[start:start + n]


def native_cache(lm, tokens):
    cache = make_prompt_cache(lm.model)
    mx.eval(lm.model(mx.array([tokens]), cache=cache))
    return cache


def greedy(lm, tokens, n):
    return [t for t, _ in generate_step(mx.array(tokens), lm.model, max_tokens=n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_output_head_of_final_norm_rows_reproduces_the_logits(loaded, family):
    lm = loaded(family)
    ids = mx.array([[5, 17, 42, 99, 3, 250, 8]])
    with recording_final_rows(lm.model, 4) as rows:
        logits = lm.model(ids)
    assert max_abs_diff(output_head(lm.model)(rows.last(4)), logits[0, -4:]) <= 1e-4


def test_every_shipped_translator_carries_its_calibration():
    assert ACROSS  # across tokenizers too
    for name in SHIPPED:
        calibration = artifact.read_manifest(name)["gate"]
        assert calibration["tail"] == gate.GATE_TOKENS, name
        assert [tuple(b["prefix"]) for b in calibration["bands"]] == list(calibrate.BANDS)
        for band in calibration["bands"]:
            for kind in gate.KINDS:  # a high quantile of the held-out gaps, plus the margin
                # across tokenizers a tail whose text has no place both split is not judged
                assert band["gap"][kind]["windows"] == calibrate.WINDOWS if name not in ACROSS \
                    else band["gap"][kind]["windows"] >= 0.9 * calibrate.WINDOWS
                assert band["threshold"][kind] == pytest.approx(
                    band["gap"][kind]["q99"] + calibration["margin"], abs=1e-3)


@pytest.mark.parametrize("name", SHIPPED)
def test_gate_passes_every_shipped_translator_on_held_out_text(name, zoo):
    tr, src, tgt = shipped(name, zoo)
    for seed, (kind, prefix) in enumerate([("read", 64), ("read", 400), ("generated", 96),
                                           ("generated", 480)]):  # both bands of lengths
        window = held_out(tgt.tokenizer, prefix + gate.GATE_TOKENS + 2, seed)
        status = calibrate.window_switch(tr, src, tgt, window, prefix, kind).switches[-1]
        assert (status.status, status.gate) == ("applied", "passed"), (kind, prefix, status)
        assert status.gate_gap <= status.gate_threshold
        assert status.tokens_tail >= gate.GATE_TOKENS
        # across tokenizers the text compared is cut to places where both split
        assert 0 < status.gate_tokens <= status.tokens_tail if name in ACROSS \
            else status.gate_tokens == status.tokens_tail


@pytest.mark.parametrize("name,scale", CAUGHT)
def test_gate_fires_on_a_translator_whose_weights_are_noise(name, scale, zoo):
    tr, src, tgt = shipped(name, zoo)
    window = held_out(tgt.tokenizer, 160, 7)
    session = calibrate.window_switch(noise(tr, scale), src, tgt, window, 150, "read")
    status = session.switches[-1]
    assert (status.status, status.gate) == ("fallback", "fired"), status
    assert status.reason.startswith("fidelity gate: ") and status.gate_gap > status.gate_threshold
    assert status.tokens_translated == 0 and status.tokens_fallback == 150
    assert session.lines["target"].seen == 150


def test_uncalibrated_translator_reports_its_gap_and_never_fires(zoo):
    tr, src, tgt = shipped(used("qwen3-small", "qwen3-large"), zoo)
    bare = noise(replace(tr, info={k: v for k, v in tr.info.items() if k != "gate"}))
    window = held_out(tgt.tokenizer, 160, 7)
    status = calibrate.window_switch(bare, src, tgt, window, 150, "read").switches[-1]
    assert (status.status, status.gate) == ("applied", "uncalibrated")
    assert "calibration" in status.gate_note and status.gate_threshold is None
    threshold, _ = gate.threshold(tr.info["gate"], gate.GATE_TOKENS, 0.0, 150)
    assert status.gate_gap > threshold  # it would have fired


@pytest.mark.parametrize("a_to_b,b_to_a", [
    (used("kimi-linear", "kimi-vl"), used("kimi-vl", "kimi-linear")),  # a: MLA + KDA
    (used("qwen3.5-a", "qwen3.5-b"), used("qwen3.5-b", "qwen3.5-a")),  # both GDN hybrids
])
def test_a_fired_gate_rereads_and_the_conversation_continues_as_native(a_to_b, b_to_a, zoo):
    """Both ways: the first switch re-reads into a fresh cache, the second puts the model's own
    cache back (recurrent state included) and re-reads the span on top of it."""
    ab, a, b = shipped(a_to_b, zoo)
    ba, _, _ = shipped(b_to_a, zoo)
    s = Session({"a": a, "b": b}, {("a", "b"): always_firing(ab),
                                   ("b", "a"): always_firing(ba)}, active="a",
                reread=0)  # the gate alone: the dial's default R aside
    s.add(held_out(a.tokenizer, 60, 3))
    list(s.generate(12))
    first = s.switch("b")
    assert (first.status, first.gate) == ("fallback", "fired"), first
    s.add(held_out(a.tokenizer, 20, 4))
    expected = greedy(b, s.tokens, 12)
    assert list(s.generate(12)) == expected
    back = s.switch("a")
    assert (back.status, back.gate) == ("fallback", "fired"), back
    assert back.tokens_fallback == len(s.tokens) - 1 - 71  # only what a had not read
    x = mx.array([[s.tokens[-1], 11, 12]])
    for name, lm in (("a", a), ("b", b)):
        line = s.lines[name]
        assert line.seen == len(s.tokens) - 1
        assert max_abs_diff(lm.model(x, cache=copy.deepcopy(line.cache)),
                            lm.model(x, cache=native_cache(lm, s.tokens[:-1]))) <= 1e-4
    s.add([7, 8, 9])
    expected = greedy(a, s.tokens, 8)
    assert list(s.generate(8)) == expected


def test_gate_gap_is_the_two_models_nll_on_the_tail(zoo):
    tr, src, tgt = shipped(used("qwen3-small", "qwen3-large"), zoo)
    window = held_out(src.tokenizer, 140, 5)
    status = calibrate.window_switch(tr, src, tgt, window, 128, "read").switches[-1]
    n, r = 128, status.tokens_tail
    ids = mx.array([window[:n + 1]])
    targets = ids[0, n - r + 1:n + 1]

    def nll(logits):
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return float(-mx.take_along_axis(logp, targets[:, None], axis=-1).mean())

    source_logits = src.model(ids[:, :n])[0, -r:]
    head = ids[:, :n - r]
    cache = kv.translate_cache(tr, src.model, tgt.model, head)
    target_logits = tgt.model(ids[:, n - r:n], cache=cache)[0]
    assert status.gate_gap == pytest.approx(nll(target_logits) - nll(source_logits), abs=1e-4)
    # and the share of the tail's tokens both models predict alike
    same = mx.argmax(source_logits, -1) == mx.argmax(target_logits, -1)
    assert status.gate_agreement == pytest.approx(float(same.mean()), abs=1e-6)


def test_a_translator_that_reads_the_source_state_stops_at_a_snapshot(zoo):
    """The bilinear state recipe reads the source's recurrent state: the gated switch hands
    over the state as it was where the translation stops, not at the end of the span."""
    tr, src, tgt = shipped(used("qwen3.5-a", "qwen3.5-b"), zoo)
    assert kv.layouts.CapturePoint.ENGINE in tr.source_points()
    s = Session({"a": src, "b": tgt}, {("a", "b"): tr}, active="a", reread=0)
    s.add(held_out(src.tokenizer, 50, 8))
    list(s.generate(21))
    assert len(s.lines["a"].states) <= 3  # a few snapshots, not one per token
    status = s.switch("b")
    assert (status.status, status.gate) == ("applied", "passed"), status
    n = s.lines["a"].seen
    switch = n - status.tokens_tail
    assert gate.GATE_TOKENS <= status.tokens_tail < 2 * gate.GATE_TOKENS
    head = mx.array([s.tokens[:switch]])
    source = capture(src.model, head, points=tr.source_points())
    layout = kv.layout_of(tgt.model)
    cache = install(layout, *tr.translate(source, tgt.model, layout, head))
    # the switch's forward read the span's last tokens and the one after them
    mx.eval(tgt.model(mx.array([s.tokens[switch:n + 1]]), cache=cache))
    x = mx.array([[5, 6]])
    assert max_abs_diff(tgt.model(x, cache=s.lines["b"].cache), tgt.model(x, cache=cache)) <= 1e-4


@pytest.mark.parametrize("pair", [("qwen3-small", "qwen3-large"), ("qwen3.5-a", "qwen3.5-b")])
def test_a_fired_gate_reads_more_before_it_rereads(pair, zoo, monkeypatch):
    """A switch whose gate fires at r tokens tries once more with 4r read natively (a
    translator that reads the source's state stopping at a snapshot 4r-8r back), judged by the
    gate again: applied, it holds the translation of the head and the target's own reading of
    the rest. By default (no `escalate`) it re-reads the span at once."""
    tr, src, tgt = shipped(used(*pair), zoo)
    firsts, calibrated = [], gate.threshold

    def first_fires(calibration, tail, generated, length):  # the first reading fails
        firsts.append(length)
        threshold = calibrated(calibration, tail, generated, length)
        return (-1e9, "") if len(firsts) == 1 else threshold
    monkeypatch.setattr(gate, "threshold", first_fires)
    tokens = held_out(src.tokenizer, 150, 11)
    s = Session({"a": src, "b": tgt}, {("a", "b"): tr}, active="a", reread=0, escalate=True)
    s.add(tokens)
    list(s.generate(0))
    status = s.switch("b")
    assert (status.status, status.gate, status.reread) == ("applied", "passed", 32), status
    assert "the gate fired at R = 8" in status.setting_note and len(firsts) == 2
    assert status.gate_gap <= status.gate_threshold  # the second reading's, not the first's
    n = s.lines["a"].seen
    assert 32 <= status.tokens_tail < 64 and status.tokens_translated == n - status.tokens_tail
    head = mx.array([s.tokens[:n - status.tokens_tail]])
    layout = kv.layout_of(tgt.model)
    cache = install(layout, *tr.translate(capture(src.model, head, points=tr.source_points()),
                                          tgt.model, layout, head))
    mx.eval(tgt.model(mx.array([s.tokens[n - status.tokens_tail:n]]), cache=cache))
    x = mx.array([[5, 6]])
    assert max_abs_diff(tgt.model(x, cache=s.lines["b"].cache), tgt.model(x, cache=cache)) <= 1e-4
    firsts.clear()
    s = Session({"a": src, "b": tgt}, {("a", "b"): tr}, active="a", reread=0)  # by default
    s.add(tokens)
    list(s.generate(0))
    status = s.switch("b")
    assert (status.status, status.gate) == ("fallback", "fired"), status
    assert len(firsts) == 1 and status.tokens_fallback == 150


def test_a_fired_gate_on_a_short_span_rereads_at_once(zoo, monkeypatch):
    """Where 4r would read half the span or more, a fired gate re-reads the span."""
    tr, src, tgt = shipped(used("qwen3-small", "qwen3-large"), zoo)
    monkeypatch.setattr(gate, "threshold", lambda *args: (-1e9, ""))
    s = Session({"a": src, "b": tgt}, {("a", "b"): tr}, active="a", reread=0, escalate=True)
    s.add(held_out(src.tokenizer, 60, 12))
    list(s.generate(0))
    status = s.switch("b")
    assert (status.status, status.gate, status.reread) == ("fallback", "fired", 0)
    assert "R = 32" not in status.setting_note


def test_a_span_within_the_tail_is_read_not_translated(zoo):
    tr, src, tgt = shipped(used("kimi-linear", "kimi-vl"), zoo)
    s = Session({"a": src, "b": tgt}, {("a", "b"): tr}, active="a", reread=0)
    s.add(held_out(src.tokenizer, 6, 9))
    list(s.generate(2))  # a reads the 6 and its first reply token
    status = s.switch("b")
    assert (status.status, status.tokens_translated, status.tokens_tail) == ("applied", 0, 7)
    assert status.gate == "unchecked" and "whole span" in status.gate_note
    off = Session({"a": src, "b": tgt}, {("a", "b"): tr}, active="a", gate_tokens=0,
                  reread=0)  # the dial at 0 too: the translator reads everything
    off.add(held_out(src.tokenizer, 40, 9))
    list(off.generate(2))
    status = off.switch("b")
    assert (status.gate, status.tokens_translated, status.tokens_tail) == ("off", 41, 0)


def test_a_switch_takes_the_threshold_of_its_length_and_tail():
    calibration = {"tail": 8, "bands": [
        {"prefix": [32, 256], "threshold": {"read": 1.0, "generated": 2.0}},
        {"prefix": [257, 512], "threshold": {"read": 3.0, "generated": 5.0}}]}
    assert gate.threshold(calibration, 8, 0.0, 100) == (1.0, "")
    assert gate.threshold(calibration, 8, 0.5, 100) == (1.5, "")  # half its own reply
    assert gate.threshold(calibration, 8, 1.0, 300) == (5.0, "")
    assert gate.threshold(calibration, 8, 0.0, 4000) == (3.0, "")  # past them: the last band
    assert gate.threshold(calibration, 16, 0.0, 100)[0] is None  # calibrated for another r
    assert gate.threshold(None, 8, 0.0, 100)[0] is None


def test_calibration_is_stored_and_read_back(zoo, tmp_path):
    """Calibrating a shipped directory rewrites its manifest's gate and relay and its sums only
    (its format kept); a translator saved with its calibration loads with it."""
    copy = tmp_path / "qwen3-small__qwen3-large"
    shutil.copytree(artifact.shipped("qwen3-small", "qwen3-large"), copy)
    weights = hashlib.sha256((copy / "weights.safetensors").read_bytes()).hexdigest()
    before = artifact.read_manifest(copy)
    record = calibrate.calibrate_directory(copy, config=calibrate.CalibrationConfig(windows=3))
    assert hashlib.sha256((copy / "weights.safetensors").read_bytes()).hexdigest() == weights
    after = artifact.read_manifest(copy)  # its sums check out
    assert after["format_version"] == before["format_version"]
    assert after["gate"] == record and record["bands"][0]["gap"]["read"]["windows"] == 3
    assert after["relay"]["chosen"] is None  # widths differ
    assert {k: v for k, v in after.items() if k not in ("gate", "relay")} == \
        {k: v for k, v in before.items() if k not in ("gate", "relay")}
    tr, src, tgt = shipped(str(copy), zoo)
    assert tr.info["gate"] == record
    saved = artifact.save(tr, tmp_path / "saved", src, tgt)
    assert artifact.load(saved, src, tgt).info["gate"] == record
    with pytest.raises(ValueError):
        artifact.update_manifest(copy, source={"name": "another"})


def test_calibration_needles_are_chat_turns_and_plain_text_alike(zoo):
    """Users ask in the chat template (chat, serve) and in plain text (a completion request, a
    router's raw prompt): of the "read" windows' needles (every other seed), half are each, and
    of each form half switch at the prompt's end, half one token before it (where a generation
    that reads the last token as its first step starts)."""
    target = zoo("qwen3-large")
    opening = target.tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                                   tokenize=False).split("x")[0]
    needles = [calibrate._needle(target, calibrate.NEEDLE_SEED + i, 120) for i in range(0, 16, 2)]
    decode = target.tokenizer.decode
    chat = [decode(ids).startswith(opening) for _, ids in needles]
    assert sum(chat) == 4
    for form in (True, False):
        after = [len(ids) - n for (n, ids), c in zip(needles, chat) if c == form]
        answer = min(after)  # the answer's tokens after the switch; one more where it is cut
        assert sorted(after) == [answer, answer, answer + 1, answer + 1]
        assert all(decode(ids[len(ids) - answer:]).strip(" .").isdigit()
                   for (n, ids), c in zip(needles, chat) if c == form)  # the answer last


def test_calibration_on_needles_reads_their_question_tails(zoo):
    """With a needle share (by default `NEEDLE_SHARE`), "read" windows are needles of the
    calibration's own draw (the record says so, and the windows it read differ); without one
    the draw is the prose one, as it always was."""
    from mlx_kvtrans.evaluation.needles import HELD_OUT_SEED

    tr, src, tgt = shipped(artifact.shipped("qwen3-small", "qwen3-large"), zoo)
    ids = tgt.tokenizer.encode(weights_dir().joinpath("corpus", "validation.txt").read_text())
    options = calibrate.CalibrationConfig(windows=2, bands=((64, 160),))
    prose = calibrate.calibrate(tr, src, tgt, ids, replace(options, needle_share=0.0))
    again = calibrate.calibrate(tr, src.model, tgt.model, ids, options)  # no tokenizer: prose
    needles = calibrate.calibrate(tr, src, tgt, ids, replace(options, needle_share=1.0))
    assert again["data_sha256"] == prose["data_sha256"] and "needle_share" not in prose
    assert calibrate.calibrate(tr, src, tgt, ids, options)["needle_share"] == \
        calibrate.NEEDLE_SHARE
    assert needles["needle_share"] == 1.0 and needles["data_sha256"] != prose["data_sha256"]
    assert needles["bands"][0]["gap"]["read"]["windows"] == 2
    assert needles["bands"][0]["gap"]["generated"] == prose["bands"][0]["gap"]["generated"]
    assert calibrate.NEEDLE_SEED + 10_000 * 2048 < HELD_OUT_SEED  # never a held-out needle


def test_bench_times_the_gated_switch(loaded):
    from mlx_kvtrans.timing import BenchConfig, bench_switch
    from mlx_kvtrans.training.fit import fit
    from mlx_kvtrans.training.plan import plan

    S, T = loaded("kimi_linear").model, loaded("kimi_vl").model
    batches = [mx.random.randint(0, 259, (4, 48), key=mx.random.key(i)) for i in range(2)]
    tr = fit(S, T, batches, plan(kv.layout_of(S), kv.layout_of(T)))
    row, = bench_switch(tr, S, T, BenchConfig([64], repeats=1))
    assert row.gate_tokens == gate.GATE_TOKENS and row.gated_switch_s > 0
    assert row.to_json()["speedup_gated"] == pytest.approx(row.reread_s / row.gated_switch_s)


def test_serve_reports_the_sessions_switch_record_in_body_and_headers():
    """The server's report holds the session's `SwitchStatus` as the session writes it: one
    record of a switch, in seconds, for the session, the chat and the server."""
    from mlx_kvtrans.serve.records import RequestHistory
    from mlx_kvtrans.session import SwitchStatus

    switch = SwitchStatus("a", "b", gate="passed", gate_gap=0.25, gate_threshold=1.1,
                          copy_gap=-0.125, copy_threshold=0.5, tokens_translated=40,
                          tokens_tail=8, tokens_sink=4, translate_seconds=0.0123)
    h = RequestHistory(status="applied", switch=switch, ttft_seconds=0.5)
    assert h.fields()["switch"] == switch.to_json()
    assert h.fields()["switch"]["gate"] == "passed" and h.fields()["switch"]["gate_gap"] == 0.25
    assert h.fields()["switch"]["tokens_reread"] == 12 == h.tokens_reread
    assert h.headers()["x-kvtrans-gate"] == "passed"
    assert h.headers()["x-kvtrans-gate-gap"] == "0.2500"
    assert h.headers()["x-kvtrans-copy-gap"] == "-0.1250"
    assert h.headers()["x-kvtrans-source-model"] == "a"
    assert float(h.headers()["x-kvtrans-translate-seconds"]) == pytest.approx(0.0123)
    assert not any(key.endswith("_ms") for key in h.fields())
