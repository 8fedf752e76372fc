"""Translating across tokenizers: the source's capture pooled onto the target's tokens, fitted
and translated as a same-tokenizer pair is."""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_kvtrans.alignment import POOLINGS, align, char_spans
from mlx_kvtrans.capture import capture
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.layouts import CapturePoint
from mlx_kvtrans.translators.cross_tokenizer import (RECIPES, aligned_text, realigned,
                                                     translate_text)
from mlx_kvtrans.translators.fit import FitConfig, fit
from mlx_kvtrans.translators.translator import translate_cache
from mlx_kvtrans.zoo.families import tiny_config
from mlx_kvtrans.zoo.random_model import build_model
from mlx_kvtrans.zoo.tokenizer import byte_tokenizer, train_bpe

TEXT = ("The committee met on a cold morning in March. Its report, three hundred pages long, "
        "was read aloud to the members, and nobody objected to a single line of it. Later "
        "that week the owners of the small cafes along the river wrote many letters about "
        "the new rules for the market. ")
CONFIG = FitConfig(point=1, nu=2, features="all", token_identity="ids", recipes=RECIPES)
VOCAB = 300


@pytest.fixture(scope="module")
def pair():
    """A hybrid source and a hybrid target, small random models, and two tokenizers of the
    same text: a BPE with a few merges (the source's) and bytes alone (the target's)."""
    source = build_model(tiny_config("qwen3_5", VOCAB), seed=1)
    target = build_model(tiny_config("qwen3_5", VOCAB), seed=2)
    return source, target, train_bpe([TEXT * 20], vocab_size=VOCAB), byte_tokenizer()


def dense(text) -> np.ndarray:
    """(T_target, T_source): an aligned text's pooling as one matrix."""
    matrix = np.zeros((text.target.shape[1], text.source.shape[1]), dtype=np.float32)
    rows = np.arange(matrix.shape[0])[:, None].repeat(text.sources.shape[1], 1)
    np.add.at(matrix, (rows, np.array(text.sources)), np.array(text.weights))
    return matrix


def chunks(n: int = 4) -> list[str]:
    step = len(TEXT) // n
    return [TEXT[i * step:(i + 1) * step] for i in range(n)]


def test_one_tokenizer_on_both_sides_fits_what_a_plain_fit_does(pair):
    source, target, _, fine = pair
    texts = [aligned_text(fine, fine, chunk) for chunk in chunks()]
    for text in texts:
        assert text.one_to_one == 1.0
        assert np.array_equal(dense(text), np.eye(text.target.shape[1]))
    across = fit(source, target, texts, config=CONFIG)
    plain = fit(source, target, [text.target for text in texts], config=CONFIG)
    assert across.params.keys() == plain.params.keys()
    for name, value in plain.params.items():
        assert np.allclose(np.array(across.params[name]), np.array(value), atol=1e-5), name


def test_source_objects_pool_onto_the_target_tokens_and_states_stay(pair):
    source, _, coarse, fine = pair
    text = aligned_text(coarse, fine, TEXT, "mean")
    n_source, n_target = text.source.shape[1], text.target.shape[1]
    assert n_source < n_target and 0 < text.one_to_one < 1
    pooling = dense(text)
    assert pooling.shape == (n_target, n_source) and np.allclose(pooling.sum(1), 1.0)
    # each pooling, gathered per target token, is the alignment's own pooling of the rows
    alignment = align(char_spans(coarse, TEXT)[1], char_spans(fine, TEXT)[1])
    for how in POOLINGS:
        matrix = dense(aligned_text(coarse, fine, TEXT, how))
        assert np.allclose(matrix, alignment.pool(np.eye(n_source), how)), how
    seen = capture(source, text.source, points={CapturePoint.RAW, CapturePoint.ENGINE})
    moved = realigned(seen, text)
    assert moved.length == n_target
    pooled_any = kept_any = False
    for before, after in zip(seen.objects, moved.objects):
        for key, value in before.items():
            if key[1] == CapturePoint.RAW:  # per token: pooled rows
                expected = np.einsum("ts,bs...->bt...", pooling, np.array(value))
                assert np.allclose(np.array(after[key]), expected, atol=1e-5)
                pooled_any = True
            elif key[0] == "state":  # a recurrent state: the same object
                assert after[key] is value
                kept_any = True
    assert pooled_any and kept_any


def test_a_translator_fitted_across_tokenizers_builds_the_target_cache(pair):
    source, target, coarse, fine = pair
    texts = [aligned_text(coarse, fine, chunk) for chunk in chunks()]
    translator = fit(source, target, texts, config=CONFIG)
    prompt = aligned_text(coarse, fine, TEXT, target_tokens=120)
    assert prompt.target.shape[1] == 120
    assert prompt.source.shape[1] < 120  # the source's tokens of the same characters
    cache = translate_text(translator, source, target, prompt)
    assert all(c.offset == 120 for c in cache if hasattr(c, "offset") and c.offset)
    logits = target(mx.array([[ord("a")]]), cache=cache)
    assert logits.shape[1] == 1 and bool(mx.isfinite(logits).all())
    # the fit records what it was fitted on, and what reads one token list refuses it
    assert translator.info["alignment"] == {"pooling": "mean"}
    with pytest.raises(KvtransError, match="across tokenizers"):
        translate_cache(translator, source, target, prompt.target)


def test_a_plan_across_tokenizers_replays_states_and_times_a_fit(tmp_path):
    """From configs alone, vocabularies of different sizes mean different tokenizers: the plan
    replays the recurrent states a same-geometry pair would copy, and its timed fit feeds each
    model ids it has."""
    from typer.testing import CliRunner

    from mlx_kvtrans.cli.main import app
    from mlx_kvtrans.zoo.random_model import write_random_model

    ours = write_random_model("qwen3_5", tmp_path / "ours", seed=1)
    other = write_random_model("qwen3_5", tmp_path / "other", seed=2,
                               config=tiny_config("qwen3_5", VOCAB))
    for source, target in ((other, ours), (ours, other)):
        result = CliRunner().invoke(app, ["plan", "--from", str(source), "--to", str(target),
                                          "--json"])
        assert result.exit_code == 0, result.output
        recipes = json.loads(result.output)["config"]["recipes"]
        assert recipes == {"recurrent_state": "replay"}
    same = CliRunner().invoke(app, ["plan", "--from", str(ours), "--to", str(ours), "--json"])
    assert json.loads(same.output)["config"]["recipes"] == {}
