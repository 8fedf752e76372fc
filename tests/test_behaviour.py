"""`eval behaviour`: native and translated answers compared with paired bootstrap intervals;
an exact translation flags nothing, a biased one is flagged."""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

import mlx_kvtrans as kv
from mlx_kvtrans.cli.main import app
from mlx_kvtrans.evaluation.behaviour import (Answer, Prompt, compare, generate_pairs,
                                              held_out_prompts, native_cache, MEASURES)
from mlx_kvtrans.models import held_out_split
from mlx_kvtrans.translators import artifact

PAIR = artifact.shipped("qwen3-small", "qwen3-large").name  # the zoo's smallest GQA pair


@pytest.fixture(scope="module")
def target():
    return kv.load("qwen3-large")


@pytest.fixture(scope="module")
def prompts(target):
    ids = target.tokenizer.encode(held_out_split("test").read_text())
    return held_out_prompts(target.tokenizer, 4, 64, ids)


@pytest.fixture(scope="module")
def self_translated(target, prompts):
    """The native cache in place of a translated one: an exact translation."""
    return generate_pairs(target.model, target.tokenizer, prompts, native_cache(target.model),
                          max_tokens=12)


def _flagged(rows):
    return {r["metric"] for r in rows if r["flagged"]}


def test_held_out_prompts_hold_every_kind(prompts, target):
    assert [p.kind for p in prompts] == ["dialogue"] * 4 + ["needle"] * 4 + ["prose"] * 4
    assert all(p.text.endswith("<|im_start|>assistant\n") for p in prompts[:4])
    assert all(p.text.endswith("The code is ") for p in prompts[4:8])
    assert all(len(p.ids) == 64 for p in prompts[8:])


def test_self_translation_answers_alike_and_flags_nothing(self_translated):
    assert all(p.native == p.translated for p in self_translated)
    rows = compare(self_translated)
    assert _flagged(rows) == set()
    assert all(r["difference"] == 0 for r in rows if r["difference"] is not None)
    by_metric = {r["metric"]: r for r in rows}
    assert by_metric["first_token_agreement"]["translated"] == 1.0
    assert by_metric["digit_copy"]["prompts"] >= 8  # dialogues and needles state numbers


def test_leading_space_added_to_translated_answers_is_flagged(self_translated):
    spaced = [replace(p, translated=replace(p.translated, text=" " + p.translated.text))
              for p in self_translated]
    rows = {r["metric"]: r for r in compare(spaced)}
    assert _flagged(rows.values()) == {"leading_space"}
    assert rows["leading_space"]["ci_low"] > 0
    assert rows["leading_space"]["by_kind"]["dialogue"]["translated"] == 1.0


def test_answers_without_the_prompt_are_flagged(target, prompts):
    """A cache that lost the prompt (the target reads only its last token) answers differently."""
    pairs = generate_pairs(target.model, target.tokenizer, prompts, lambda ids: None,
                           max_tokens=12)
    rows = {r["metric"]: r for r in compare(pairs)}
    assert "first_token_agreement" in _flagged(rows.values())
    assert rows["first_token_agreement"]["ci_high"] < 0


def test_intervals_are_seeded_and_hold_the_mean(target, prompts):
    pairs = generate_pairs(target.model, target.tokenizer, prompts[:6], lambda ids: None,
                           max_tokens=6)
    assert compare(pairs, seed=3) == compare(pairs, seed=3)
    for r in compare(pairs, resamples=500, seed=3):
        if r["difference"] is not None:
            assert r["ci_low"] <= r["difference"] <= r["ci_high"]


def test_measures_of_one_answer():
    prompt = Prompt("needle", [], "The secret code is 482913.\nWhat is the secret code?")
    copied = Answer(1, [5, 6, 7, 5, 6, 7], "482913. I'm sorry")
    wrong = Answer(1, [1, 2, 3], " 482914, I don’t know")
    measure = {name: m for name, (_, m) in MEASURES.items()}
    assert measure["digit_copy"](prompt, copied) == 1.0
    assert measure["digit_copy"](prompt, wrong) == 0.0
    assert measure["digit_copy"](Prompt("prose", [], "no numbers here"), copied) is None
    assert measure["leading_space"](prompt, wrong) == 1.0
    assert measure["refusal"](prompt, copied) == 1.0 and measure["refusal"](prompt, wrong) == 0.0
    assert measure["dont_know"](prompt, wrong) == 1.0  # a curly apostrophe counts too
    assert measure["repetition"](prompt, copied) == pytest.approx(1 / 4)  # (5, 6, 7) twice
    assert measure["repetition"](prompt, Answer(1, [1, 2], "")) is None
    assert measure["answer_tokens"](prompt, copied) == 6.0


def test_cli_prints_rows_as_json():
    result = CliRunner().invoke(app, ["eval", "behaviour", "--translator", PAIR, "--prompts", "1",
                                      "--max-tokens", "4", "--length", "32", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["source"], report["target"]) == ("qwen3-small", "qwen3-large")
    assert {r["metric"] for r in report["rows"]} == {"first_token_agreement", *MEASURES}


def test_cli_prints_a_table():
    result = CliRunner().invoke(app, ["eval", "behaviour", "--translator", PAIR, "--prompts", "1",
                                      "--max-tokens", "2", "--length", "32"])
    assert result.exit_code == 0, result.output
    assert "first-token agreement" in result.stdout and "95% interval" in result.stdout


HUGE = "99999999999"
BAD_INPUT = {
    "zero prompts": (["--prompts", "0"], "--prompts"),
    "zero max tokens": (["--max-tokens", "0"], "--max-tokens"),
    "max tokens past the positions": (["--max-tokens", HUGE], "--max-tokens"),
    "short length": (["--length", "5"], "--length"),
    "length past the positions": (["--length", "40000"], "positions"),
    "negative seed": (["--seed", "-1"], "--seed"),
    "text missing": (["--text", "{nowhere}"], "--text"),
    "text empty": (["--text", "{empty}"], "empty"),
    "text shorter than a window": (["--text", "{short}", "--length", "256"], "fewer than"),
    "translator missing": (["--translator", "{nowhere}"], "not found"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("A short held-out text.\n")
    paths = {"nowhere": tmp_path / "nowhere", "empty": tmp_path / "empty.txt",
             "short": tmp_path / "short.txt"}
    args, fragment = BAD_INPUT[case]
    args = [a.format(**paths) for a in args]
    if "--translator" not in args:
        args = ["--translator", PAIR] + args
    result = CliRunner().invoke(app, ["eval", "behaviour", *args])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
