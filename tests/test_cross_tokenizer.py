"""Translating across tokenizers: the source's capture pooled onto the target's tokens, fitted
and translated as a same-tokenizer pair is."""

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_kvtrans.translators.alignment import POOLINGS, align, char_spans
from mlx_kvtrans.capture import capture
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.layouts import CapturePoint
from mlx_kvtrans.translators.cross_tokenizer import (RECIPES, aligned_text, realigned,
                                                     translate_text)
from mlx_kvtrans.training.fit import FitConfig, fit
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


# -- sessions across tokenizers ----------------------------------------------------------------

def loaded(name, model, tokenizer):
    from mlx_kvtrans.models import LoadedModel

    return LoadedModel(name, None, model, tokenizer, {"model_type": "qwen3_5"})


@pytest.fixture(scope="module")
def both_ways(pair):
    """The pair's translators each way, fitted across its two tokenizers."""
    source, target, coarse, fine = pair
    there = fit(source, target, [aligned_text(coarse, fine, c) for c in chunks()], config=CONFIG)
    back = fit(target, source, [aligned_text(fine, coarse, c) for c in chunks()], config=CONFIG)
    return there, back


def test_views_keep_every_tokenizer_on_the_same_text_and_map_at_common_splits(pair):
    from mlx_kvtrans.translators.alignment import Views

    _, _, coarse, fine = pair
    views = Views({"coarse": coarse, "fine": fine})
    views.add_text(TEXT[:60])
    # a reply in the coarse model's own tokens, its first word one character at a time
    # where its tokenizer would merge them
    ids, spans = char_spans(coarse, TEXT)
    word = max((TEXT[a:b] for a, b in spans), key=len)
    said = word + " cold river"
    reply = [i for ch in word for i in char_spans(coarse, ch)[0]] + \
        char_spans(coarse, " cold river")[0]
    assert reply != char_spans(coarse, said)[0]
    views.tokens["coarse"].extend(reply)
    views.add_text(TEXT[60:120])
    text = TEXT[:60] + said + TEXT[60:120]
    assert views.length == len(text)
    assert views.tokens["fine"] == char_spans(fine, TEXT[:60])[0] + \
        char_spans(fine, said)[0] + char_spans(fine, TEXT[60:120])[0]
    assert views.ends["coarse"][-1] == views.ends["fine"][-1] == len(text)
    alignment = views.alignment("coarse", "fine")
    assert alignment.source_starts[-1] == len(views.tokens["coarse"])
    # a mapped position is a place both split, within what the source's tokens cover
    for position in range(len(views.tokens["coarse"]) + 1):
        got = views.mapped("coarse", position, "fine")
        char = views.ends["fine"][got - 1] if got else 0
        assert char <= (views.ends["coarse"][position - 1] if position else 0)
        assert got == 0 or char in set(views.ends["coarse"][:position])
    assert views.mapped("coarse", len(views.tokens["coarse"]), "fine") == len(views.tokens["fine"])


def test_a_session_switch_across_tokenizers_translates_what_translate_text_does(pair, both_ways):
    """With no tokens read natively, the target's cache after a switch is the translation of
    the whole text: its next-token logits equal those from `translate_text`."""
    from mlx_kvtrans.session import Outcome, Session

    source, target, coarse, fine = pair
    there, _ = both_ways
    session = Session({"a": loaded("a", source, coarse), "b": loaded("b", target, fine)},
                      {("a", "b"): there}, gate_tokens=0, reread=0)
    session.add_text(TEXT)
    list(session.generate(max_tokens=0))  # the source reads the text
    status = session.switch("b")
    assert status.status == Outcome.APPLIED
    assert status.tokens_translated == len(session.view("b")) == len(char_spans(fine, TEXT)[0])
    cache = translate_text(there, source, target, aligned_text(coarse, fine, TEXT))
    probe = mx.array([[ord("a")]])
    expected = target(probe, cache=cache)
    got = target(probe, cache=session.lines["b"].cache)
    assert np.allclose(np.array(got), np.array(expected), atol=1e-4)


def test_a_conversation_across_tokenizers_moves_both_ways_and_stays_in_step(pair, both_ways):
    from mlx_kvtrans.session import Outcome, Session

    source, target, coarse, fine = pair
    there, back = both_ways
    session = Session({"a": loaded("a", source, coarse), "b": loaded("b", target, fine)},
                      {("a", "b"): there, ("b", "a"): back})
    pieces = chunks(6)
    for i, piece in enumerate(pieces):
        session.add_text(piece)
        reply = list(session.generate(max_tokens=6))
        assert reply and session.tokens[-len(reply):] == reply  # the active view holds them
        status = session.switch("b" if session.active == "a" else "a")
        assert status.status == Outcome.APPLIED, status.reason
        if i:  # the first switch is short: the target reads it all itself
            assert status.tokens_translated > 0
            # the gate reads both models on the same text (no calibration: it stands)
            assert status.gate == "uncalibrated" and status.gate_gap is not None
    # every view is the same text; each line read its own view up to its last switch
    a, b = (session.view(n) for n in "ab")
    from mlx_kvtrans.translators.alignment import decode
    assert decode(coarse, a) == decode(fine, b)
    for name in "ab":
        line = session.lines[name]
        assert all(c.offset == line.seen for c in line.cache if getattr(c, "offset", 0))


def test_the_frontier_switches_across_tokenizers_as_a_session_does(pair, both_ways):
    """The frontier's prompts are the target's tokens: its timed switch (the source reading its
    own tokens of their text, pooled) builds the cache a session's switch builds."""
    from mlx_kvtrans.evaluation.frontier import SessionSwitch, Setting, Switch

    source, target, coarse, fine = pair
    there, _ = both_ways
    prefix = char_spans(fine, TEXT)[0][:150]
    session = SessionSwitch(there, loaded("a", source, coarse), loaded("b", target, fine),
                            gate_tokens=0)
    timed = Switch(there, source, target, tokenizers=(coarse, fine))
    assert session.tokenizers is not None
    probe = mx.array([[ord("a")]])
    expected = target(probe, cache=session.cache(Setting(0), prefix))
    got = target(probe, cache=timed.cache(Setting(0), prefix))
    assert np.allclose(np.array(got), np.array(expected), atol=1e-4)
    assert session.statuses[Setting(0)][0].tokens_translated == len(prefix)


def test_views_cut_at_a_place_every_tokenizer_splits_and_copy_apart(pair):
    from mlx_kvtrans.translators.alignment import Views

    _, _, coarse, fine = pair
    views = Views({"coarse": coarse, "fine": fine})
    views.add_text(TEXT[:100])
    views.add_text(TEXT[100:200])
    twin = views.copy()
    cut = views.common("fine", len(char_spans(fine, TEXT[:100])[0]) + 7)
    assert cut >= len(char_spans(fine, TEXT[:100])[0])  # a piece's end is a common place
    views.cut("fine", cut)
    kept = views.ends["fine"][-1]
    assert views.length == kept == views.ends["coarse"][-1]
    assert views.tokens["fine"] == char_spans(fine, TEXT[:kept])[0]
    assert views.tokens["coarse"] == char_spans(coarse, TEXT[:100])[0] + \
        char_spans(coarse, TEXT[100:kept])[0]
    assert twin.length == 200 and len(twin.tokens["fine"]) > len(views.tokens["fine"])


def test_conversation_groups_join_tokenizers_a_translator_crosses(pair, both_ways):
    from mlx_kvtrans.translators.alignment import conversation_groups

    source, target, coarse, fine = pair
    models = {"a": loaded("a", source, coarse), "b": loaded("b", target, fine),
              "c": loaded("c", target, fine)}
    assert conversation_groups(models, {}) == {"a": "a", "b": "b", "c": "b"}
    assert conversation_groups(models, {("b", "a"): both_ways[1]}) == {"a": "a", "b": "a",
                                                                       "c": "a"}


def test_a_models_own_split_of_its_reply_ends_where_its_prefixes_decode(pair):
    """A reply's tokens that its tokenizer would merge, a character's bytes split between two
    of them: each token ends where the decoded prefix up to it ends."""
    from mlx_kvtrans.translators.alignment import decode, own_ends

    _, _, coarse, _ = pair
    word = max((TEXT[a:b] for a, b in char_spans(coarse, TEXT)[1]), key=len)
    ids = [i for ch in word + " café" for i in char_spans(coarse, ch)[0]]
    assert ids != char_spans(coarse, word + " café")[0]
    text, ends = own_ends(coarse, ids)
    assert text == word + " café"
    assert ends == [min(len(decode(coarse, ids[:i + 1])), len(text)) for i in range(len(ids))]


def test_the_gate_across_one_tokenizer_reads_what_the_gate_within_one_does(pair):
    """Across tokenizers the gate compares each model's NLL of its own tokens of the same text;
    given one tokenizer on both sides, that is the gap the gate within one tokenizer reads."""
    from mlx_kvtrans.translators import gate
    from mlx_kvtrans.capture.instrument import recording_final_rows

    source, target, _, fine = pair
    ids, spans = char_spans(fine, TEXT)
    ids, ends = ids[:80], [end for _, end in spans[:80]]
    tails = []
    for model in (source, target):
        with recording_final_rows(model, 16) as rows:
            model(mx.array([ids[:70]]))
        tails.append(gate.tail_of(rows.last(16), 70))
    within = gate.compare(source, tails[0], target, tails[1], ids, 60, 70)
    across = gate.compare_across(source, tails[0], ids, ends, target, tails[1], ids, ends, 60, 70)
    assert across.tokens == within.tokens == 10
    assert abs(across.gap - within.gap) < 1e-4 and across.agreement is None


def test_a_switch_across_tokenizers_meets_its_calibrated_gate(pair, both_ways):
    from mlx_kvtrans.training.calibrate import CalibrationConfig, calibrate
    from mlx_kvtrans.session import Session

    source, target, coarse, fine = pair
    there, _ = both_ways
    a, b = loaded("a", source, coarse), loaded("b", target, fine)
    ids = char_spans(fine, TEXT * 3)[0]
    # prose alone: these bare test tokenizers write no needles
    record = calibrate(there, a, b, ids, CalibrationConfig(windows=2, bands=((32, 120),),
                                                         needle_share=0.0))
    assert record["tail"] == 8 and len(record["bands"]) == 1
    calibrated = replace(there, info={**there.info, "gate": record})
    session = Session({"a": a, "b": b}, {("a", "b"): calibrated})
    session.add_text(TEXT)
    list(session.generate(0))
    status = session.switch("b")
    assert status.gate in ("passed", "fired") and status.gate_gap is not None
    assert status.gate_threshold is not None and status.gate_tokens > 0


def test_distillation_across_tokenizers_is_the_plain_one_given_one_tokenizer(pair):
    """Stage 2 on the target's tokens, the source reading its own tokens of each window: with
    one tokenizer on both sides, the very steps of a plain distillation; across two, it runs."""
    import tempfile

    from mlx_kvtrans.training.distill import DistillConfig, Distiller

    source, target, coarse, fine = pair
    same = fit(source, target, [aligned_text(fine, fine, c) for c in chunks()], config=CONFIG)
    plain = replace(same, info={k: v for k, v in same.info.items() if k != "alignment"})
    ids = char_spans(fine, TEXT * 8)[0]
    config = DistillConfig(steps=6, lr=3e-4, warmup=2, batch=2, min_prefix=48, max_prefix=64,
                           continuation=8, validate_every=100, validation_windows=2)
    with pytest.raises(KvtransError, match="needs the two tokenizers"):
        Distiller(same, source, target, ids, ids, config, "unused")
    summaries = []
    for translator, tokenizers in ((plain, None), (same, (fine, fine)),
                                   (fit(source, target, [aligned_text(coarse, fine, c)
                                                         for c in chunks()], config=CONFIG),
                                    (coarse, fine))):
        with tempfile.TemporaryDirectory() as workdir:
            summaries.append(Distiller(translator, source, target, ids, ids, config, workdir,
                                       tokenizers=tokenizers).run())
    keys = ("validation_kl_before", "validation_kl_after")
    assert [summaries[0][k] for k in keys] == pytest.approx([summaries[1][k] for k in keys],
                                                            abs=1e-6)
    assert all(np.isfinite(summaries[2][k]) for k in keys)


@pytest.mark.parametrize("source_family,target_family", [("kimi_linear", "kimi_vl"),
                                                         ("qwen3_5", "deepseek_v32"),
                                                         ("qwen3", "kimi_linear")])
def test_every_object_kind_translates_across_tokenizers(pair, source_family, target_family):
    """MLA latents and rope keys, indexer keys, KDA conv rows and states: fitted across two
    tokenizers and built from a text's translation, the target's cache holds every token."""
    _, _, coarse, fine = pair
    source = build_model(tiny_config(source_family, VOCAB), seed=3)
    target = build_model(tiny_config(target_family, VOCAB), seed=4)
    states = target_family in ("kimi_linear", "qwen3_5")  # replayed over the target's tokens
    translator = fit(source, target, [aligned_text(coarse, fine, c) for c in chunks()],
                     config=replace(CONFIG, recipes=RECIPES if states else {}))
    prompt = aligned_text(coarse, fine, TEXT, target_tokens=100)
    cache = translate_text(translator, source, target, prompt)
    assert all(c.offset == 100 for c in cache if getattr(c, "offset", 0))
    logits = target(mx.array([[ord("a")]]), cache=cache)
    assert bool(mx.isfinite(logits).all())


# each command runs once, on one of the two shipped directions
ACROSS_COMMANDS = {
    "qwen3.5-a__qwen3.5-xt-distilled": {
        "fidelity": ["--prefix-lengths", "32", "--windows", "1"],
        "needle": ["--lengths", "64", "--samples", "2"],
        "behaviour": ["--prompts", "2", "--max-tokens", "4", "--length", "48"]},
    "qwen3.5-xt__qwen3.5-a-distilled": {
        "multiturn": ["--dialogues", "1", "--turns", "2"],
        "ablate": ["--lengths", "32", "--windows", "1", "--needles", "1"],
        "bench": ["--lengths", "64", "--repeats", "1"]},
}


FIGURES = {"fidelity": "rows", "needle": "translated_recall", "behaviour": "rows",
           "multiturn": "accuracy", "ablate": "rows"}  # where each command's JSON holds them


@pytest.mark.parametrize("direction", list(ACROSS_COMMANDS))
def test_every_evaluation_and_bench_take_a_translator_across_tokenizers(direction):
    """Prompts are the target's tokens of a text; the source reads its own tokens of it."""
    from typer.testing import CliRunner

    from mlx_kvtrans.cli.main import app

    runner = CliRunner()
    for command, options in ACROSS_COMMANDS[direction].items():
        args = [command] if command == "bench" else ["eval", command]
        result = runner.invoke(app, [*args, "--translator", direction, *options, "--json"])
        assert result.exit_code == 0, (command, result.output)
        found = json.loads(result.output)
        if command == "bench":
            row, = found["rows"]
            assert row["prompt"] == "held-out text" and row["warm_switch_s"] > 0
        else:
            assert found[FIGURES[command]] not in (None, [], {}), command
