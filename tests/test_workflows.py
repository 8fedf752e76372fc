"""The orchestration layer: `workflows.fit_translator` / `distill_translator` do what `kvtrans
fit` / `distill` do (the stages below them no longer calibrate), `calibrate` writes a gate the
session reads, and no command replaces an existing output unless told to."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_kvtrans as kv
from mlx_kvtrans.training import workflows
from mlx_kvtrans.translators import gate
from mlx_kvtrans.training.calibrate import CalibrationConfig, calibrate_directory, window_switch
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.training.distill import DistillConfig
from mlx_kvtrans.training.fit import FitConfig, fit, mixed_windows, token_windows
from mlx_kvtrans.translators.translator import translate_cache
from mlx_kvtrans.tools.verify import max_abs_diff

TEXT = Path(__file__).parent / "data" / "corpus_sample.txt"
PAIR = ("qwen3", "llama")  # attention only: the cheapest switches to calibrate on
CONFIG = FitConfig(point=1, windows=4, length=40)


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRANS_CACHE", str(tmp_path / "cache"))  # ids of TEXT land here


@pytest.fixture(scope="module")
def fitted(model_dirs, loaded, tmp_path_factory):
    """(directory, in-memory translator, source, target): stage 1 with a gate, saved."""
    src, tgt = (loaded(f) for f in PAIR)
    out = tmp_path_factory.mktemp("fitted") / "tr"
    translator = workflows.fit_translator(src, tgt, [TEXT], CONFIG, validation=TEXT, out=out,
                                          gate_windows=1)
    return out, translator, src, tgt


def digests(directory: Path) -> dict[str, tuple[str, int]]:
    """Every file's hash and modification time: what "touched nothing" means."""
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                            p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_fit_translator_saves_what_it_fitted_and_it_translates_the_same(fitted):
    out, translator, src, tgt = fitted
    back = artifact.load(out, src, tgt)
    assert back.info["gate"] == translator.info["gate"]
    # the fit measured the target's attention sink, which its switches read: none in the zoo
    assert back.info["sink"] == translator.info["sink"] and back.info["sink"]["tokens"] == 0
    assert sorted(back.params) == sorted(translator.params)
    tokens = mx.random.randint(0, 259, (1, 36), key=mx.random.key(3))
    logits = [tgt.model(tokens[:, -1:], cache=translate_cache(t, src.model, tgt.model,
                                                              tokens[:, :-1]))
              for t in (translator, back)]
    assert max_abs_diff(*logits) == 0.0


def test_fit_translator_fits_the_windows_of_its_text(fitted):
    """The workflow is the stage on the text's windows, no more: the same parameters as `fit`
    on `token_windows` of the text's ids, and a gate that `fit` alone does not add."""
    _, translator, src, tgt = fitted
    ids = src.tokenizer.encode(TEXT.read_text())
    alone = fit(src.model, tgt.model, token_windows(ids, CONFIG.length, CONFIG.windows,
                                                    batch=workflows.FIT_BATCH), None, CONFIG)
    assert "gate" not in alone.info and alone.info["fit"]["tokens"] == 4 * 40
    for k, v in alone.params.items():
        assert mx.array_equal(v, translator.params[k]), k


def test_needle_windows_come_from_the_training_needles(loaded):
    src, tgt = (loaded(f) for f in PAIR)
    with_needles = workflows.fit_translator(src, tgt, [TEXT], replace(CONFIG, needle_share=0.5))
    ids = src.tokenizer.encode(TEXT.read_text())
    needles = workflows.training_needles(src.tokenizer.encode, [TEXT.read_text()], 40, count=2)
    assert all(len(r) >= 40 for r in needles)
    windows = token_windows(ids, 40, 4, batch=workflows.FIT_BATCH, needles=needles,
                            needle_share=0.5)
    alone = fit(src.model, tgt.model, windows, None, CONFIG)
    for k, v in alone.params.items():
        assert mx.array_equal(v, with_needles.params[k]), k
    assert "gate" not in with_needles.info  # no held-out text: no calibration


def test_mixed_windows_spread_the_tokens_over_every_length_in_turn():
    ids = list(range(5000))
    batches = mixed_windows(ids, (32, 64, 128), 3 * 768, batch_tokens=128)
    widths = [b.shape[1] for b in batches]
    assert widths[:3] == [32, 64, 128]  # interleaved: every length from the start
    assert {n: sum(b.size for b in batches if b.shape[1] == n) for n in (32, 64, 128)} == \
        {32: 768, 64: 768, 128: 768}
    assert all(b.shape[1] * b.shape[0] <= 128 for b in batches)


def test_fit_translator_on_mixed_lengths_fits_those_windows(loaded):
    src, tgt = (loaded(f) for f in PAIR)
    config = FitConfig(point=1, windows=4, length=40, mix=(20, 40))
    mixed = workflows.fit_translator(src, tgt, [TEXT], config)
    ids = src.tokenizer.encode(TEXT.read_text())
    alone = fit(src.model, tgt.model, mixed_windows(ids, (20, 40), 160,
                                                    workflows.FIT_BATCH * 20), None, config)
    assert mixed.info["fit"]["tokens"] == alone.info["fit"]["tokens"] == 160
    for k, v in alone.params.items():
        assert mx.array_equal(v, mixed.params[k]), k


def test_calibrate_directory_writes_a_gate_the_session_reads(loaded, tmp_path):
    src, tgt = (loaded(f) for f in PAIR)
    out = tmp_path / "bare"
    workflows.fit_translator(src, tgt, [TEXT], CONFIG, out=out)
    assert "gate" not in artifact.read_manifest(out)
    weights = hashlib.sha256((out / "weights.safetensors").read_bytes()).hexdigest()
    record = calibrate_directory(out, TEXT, CalibrationConfig(windows=1))
    assert hashlib.sha256((out / "weights.safetensors").read_bytes()).hexdigest() == weights
    translator = artifact.load(out, src, tgt)
    assert translator.info["gate"] == record and record["tail"] == gate.GATE_TOKENS
    limit, why = gate.threshold(translator.info["gate"], gate.GATE_TOKENS, 0.0, 40)
    assert why == "" and limit == record["bands"][0]["threshold"]["read"]
    window = src.tokenizer.encode(TEXT.read_text())[:60]
    status = window_switch(translator, src.model, tgt.model, window, 48, "read").switches[-1]
    assert status.gate in ("passed", "fired")  # it judged
    assert status.gate_threshold == pytest.approx(limit)


def test_existing_outputs_are_refused_untouched_unless_forced(fitted, model_dirs, tmp_path):
    from typer.testing import CliRunner

    from mlx_kvtrans.cli.main import app

    out, _, _, _ = fitted
    before = digests(out)
    runner = CliRunner()
    src, tgt = (str(model_dirs(f)) for f in PAIR)
    commands = {
        "fit": ["fit", "--from", src, "--to", tgt, "--out", str(out), "--data", str(TEXT)],
        "distill": ["distill", "--translator", str(out), "--out", str(out), "--data", str(TEXT),
                    "--validation", str(TEXT), "--workdir", str(tmp_path / "w"),
                    "--max-prefix", "32"],
        "calibrate": ["calibrate", "--translator", str(out), "--validation", str(TEXT)],
        # checkpoints are not written among a translator's files either
        "distill --workdir": ["distill", "--translator", str(out), "--out", str(tmp_path / "d"),
                              "--data", str(TEXT), "--validation", str(TEXT), "--workdir",
                              str(out), "--max-prefix", "32", "--steps", "1"]}
    for name, args in commands.items():
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (name, result.output)
        assert ("--workdir" if name.endswith("workdir") else "--force") in result.output, name
        assert "Traceback" not in result.output, name
        assert digests(out) == before, name
    assert not (tmp_path / "d").exists()
    assert not (tmp_path / "w").exists()
    forced = runner.invoke(app, [*commands["calibrate"], "--windows", "1", "--force", "--json"])
    assert forced.exit_code == 0, forced.output
    assert artifact.read_manifest(out)["gate"]["bands"][0]["gap"]["read"]["windows"] == 1
    assert json.loads(forced.output)["relay"] == artifact.read_manifest(out)["relay"]
    assert hashlib.sha256((out / "weights.safetensors").read_bytes()).hexdigest() == \
        before["weights.safetensors"][0]


def test_distill_translator_distils_calibrates_and_saves(fitted, tmp_path):
    path, stage1, src, tgt = fitted
    config = DistillConfig(steps=2, lr=1e-3, warmup=1, batch=2, min_prefix=16, max_prefix=32,
                           continuation=8, validate_every=1, validation_windows=2)
    stopped = workflows.distill_translator(path, [TEXT], TEXT, replace(config, max_minutes=1e-9),
                                           out=tmp_path / "early", workdir=tmp_path / "w",
                                           gate_windows=1)
    assert not stopped.finished and stopped.translator is None
    assert not (tmp_path / "early").exists() and (tmp_path / "w" / "state.json").exists()
    with pytest.raises(kv.KvtransError, match="--resume"):
        workflows.distill_translator(path, [TEXT], TEXT, config, workdir=tmp_path / "w")
    notes = []
    run = workflows.distill_translator(path, [TEXT], TEXT, config, out=tmp_path / "d",
                                       workdir=tmp_path / "w", resume=True, gate_windows=1,
                                       note=notes.append)
    assert run.finished and run.resumed_at == 1 and any("resuming" in n for n in notes)
    manifest = artifact.read_manifest(tmp_path / "d")
    assert manifest["stage"] == 2 and manifest["distill"]["steps"] == 2
    assert manifest["gate"] == run.translator.info["gate"] != stage1.info["gate"]
    assert artifact.load(tmp_path / "d", src, tgt).info["gate"]["tail"] == gate.GATE_TOKENS
