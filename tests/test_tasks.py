"""The evaluation task generators is deterministic per seed and its answers are in its prompts."""

import pytest

from mlx_kvtrans.evaluation import tasks


@pytest.mark.parametrize("make", [lambda s: tasks.needle(s, 800),
                                  lambda s: tasks.key_value(s),
                                  lambda s: tasks.dialogue(s, turns=6)])
def test_same_seed_same_sample_other_seed_other_sample(make):
    assert make(7) == make(7)
    assert make(7) != make(8)


def test_needle_is_stated_once_and_asked_at_the_end():
    for seed in range(20):
        s = tasks.needle(seed, n_chars=2000)
        code = s.meta["code"]
        assert len(code) == 6 and code.isdigit()
        assert s.prompt.count(code) == 1
        assert s.prompt.endswith(tasks.ANSWER_PREFIX)
        assert s.answer == code + "."
        assert len(s.prompt) >= 2000


def test_needle_depth_is_respected():
    early = tasks.needle(1, n_chars=3000, depth=0.0)
    late = tasks.needle(1, n_chars=3000, depth=1.0)
    assert early.prompt.index(early.meta["code"]) < 200
    assert late.prompt.index(late.meta["code"]) > 2500


def test_key_value_answer_is_the_asked_value():
    s = tasks.key_value(3, n_pairs=10)
    assert f"{s.meta['key']}: {s.answer[:-1]}" in s.prompt


def test_dialogue_asks_for_a_fact_stated_earlier():
    for seed in range(10):
        s = tasks.dialogue(seed, turns=10)
        assert s.messages[-1]["role"] == "user"
        number = s.answer.split()[-1].rstrip(".")
        said = " ".join(m["content"] for m in s.messages[:-1] if m["role"] == "user")
        assert f"{s.meta['key']} is {number}" in said
    with pytest.raises(ValueError):
        tasks.dialogue(0, turns=1)
