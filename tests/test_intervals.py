"""The 95% intervals beside the frontier's and the bars' figures."""

import random

import pytest

from mlx_kvtrans.evaluation.intervals import (bootstrap, paired_gain, recovered_share, wilson,
                                               window_intervals)


def test_wilson_matches_the_score_interval():
    # textbook values: 16 of 16 right, 8 of 16, none of 10
    assert wilson(1.0, 16) == pytest.approx((0.8064, 1.0), abs=1e-4)
    assert wilson(0.5, 16) == pytest.approx((0.2800, 0.7200), abs=1e-4)
    assert wilson(0.0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)


def test_wilson_narrows_with_more_outcomes():
    few, many = wilson(0.8, 16), wilson(0.8, 256)
    assert few[0] < many[0] < 0.8 < many[1] < few[1]


def test_bootstrap_covers_a_known_mean_as_often_as_it_says():
    rng = random.Random(0)
    covered = 0
    for trial in range(200):
        values = [rng.gauss(1.0, 1.0) for _ in range(64)]
        low, high = bootstrap(lambda m: m, [values], draws=500, seed=trial)
        covered += low <= 1.0 <= high
    assert 0.88 <= covered / 200 <= 0.99


def test_bootstrap_keeps_the_windows_paired():
    # agreement and floor move together window by window: their difference is exact
    floor = [0.5, 0.6, 0.7, 0.8]
    agree = [f + 0.1 for f in floor]
    low, high = bootstrap(lambda a, f: a - f, [agree, floor])
    assert low == pytest.approx(0.1) and high == pytest.approx(0.1)


def test_recovered_share_and_a_row_of_intervals():
    assert recovered_share(0.9, 0.6) == pytest.approx(0.75)
    rng = random.Random(1)
    floor = [rng.uniform(0.6, 0.8) for _ in range(32)]
    agree = [min(1.0, f + rng.uniform(0.1, 0.2)) for f in floor]
    spans = window_intervals(agree, floor, [20.0] * 32, [1.0] * 31 + [0.0], 0.75, 32, None, 0)
    assert set(spans) == {"history_recovered", "agreement", "greedy_match", "first_token",
                          "recall_translated"}
    point = recovered_share(sum(agree) / 32, sum(floor) / 32)
    assert spans["history_recovered"][0] < point < spans["history_recovered"][1]
    assert spans["greedy_match"] == [20.0, 20.0]
    assert spans["recall_translated"] == pytest.approx(list(wilson(0.75, 32)), abs=1e-4)


def test_paired_gain_sees_a_small_gain_that_unpaired_intervals_miss():
    rng = random.Random(2)
    pairs = []
    for _ in range(2):  # two lengths, windows of very different difficulty
        hard = [rng.uniform(0.5, 1.0) for _ in range(64)]
        floor = [h - 0.3 for h in hard]
        theirs = hard
        mine = [min(1.0, h + 0.02) for h in hard]
        pairs.append((mine, theirs, floor))
    gain, low, high = paired_gain(pairs)
    assert 0 < low < gain < high
    one = bootstrap(recovered_share, [pairs[0][0], pairs[0][2]])
    other = bootstrap(recovered_share, [pairs[0][1], pairs[0][2]])
    assert one[0] < other[1]  # unpaired, the two intervals overlap


def test_paired_gain_of_a_translator_against_itself_is_zero():
    floor = [0.7, 0.8, 0.75, 0.6]
    agree = [0.9, 0.95, 0.85, 0.8]
    assert paired_gain([(agree, agree, floor)]) == (0.0, 0.0, 0.0)
