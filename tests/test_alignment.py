"""Token alignment across tokenizers: minimal groups covering the same characters."""

import numpy as np
import pytest

from mlx_kvtrans.translators.alignment import align, char_spans
from mlx_kvtrans.zoo.tokenizer import byte_tokenizer, train_bpe

TEXT = ("The committee met on 14 March 2024. Its report, 312 pages long, was read aloud: "
        "nobody objected. Café owners — and naïve tourists — wrote 8,640 letters.")


def test_groups_close_where_both_sides_end_together():
    # "Hello world": source [Hello][ world], target [Hel][lo][ wor][ld]
    a = align([(0, 5), (5, 11)], [(0, 3), (3, 5), (5, 9), (9, 11)])
    assert a.source_starts.tolist() == [0, 1, 2] and a.target_starts.tolist() == [0, 2, 4]
    assert a.groups == 2 and a.one_to_one() == 0.0
    rows = np.array([[1.0, 10.0], [3.0, 30.0]])
    assert a.pool(rows).tolist() == [[1, 10], [1, 10], [3, 30], [3, 30]]
    # one source token over two target tokens over one group: mean, first and last differ
    b = align([(0, 2), (2, 4)], [(0, 4)])
    assert b.pool(rows, "mean").tolist() == [[2, 20]]
    assert b.pool(rows, "first").tolist() == [[1, 10]] and b.pool(rows, "last").tolist() == [[3, 30]]
    with pytest.raises(ValueError, match="different text"):
        align([(0, 5)], [(0, 4)])
    with pytest.raises(ValueError, match="pooling"):
        a.pool(rows, "max")


def test_bytes_of_one_character_and_tokens_without_characters_stay_in_their_group():
    # a two-byte character split over two source tokens of the same span; a zero-width token
    a = align([(0, 1), (1, 2), (1, 2), (2, 2), (2, 3)], [(0, 2), (2, 3)])
    assert a.source_starts.tolist() == [0, 4, 5] and a.target_starts.tolist() == [0, 1, 2]


def test_two_real_tokenizers_split_into_groups_of_the_same_text():
    """The zoo's kind of byte-level BPE with few merges against bytes alone: every group spans
    the same characters on both sides and has no common boundary inside it (minimal)."""
    coarse = train_bpe([TEXT * 20], vocab_size=300)
    fine = byte_tokenizer()
    ids_c, spans_c = char_spans(coarse, TEXT)
    ids_f, spans_f = char_spans(fine, TEXT)
    assert len(ids_c) < len(ids_f) == len(TEXT.encode())
    a = align(spans_c, spans_f)
    ends_c = {e for _, e in spans_c}
    for g in range(a.groups):
        sc, ec = a.source_starts[g], a.source_starts[g + 1]
        tc, et = a.target_starts[g], a.target_starts[g + 1]
        assert ec > sc and et > tc
        assert spans_c[sc][0] == spans_f[tc][0] and spans_c[ec - 1][1] == spans_f[et - 1][1]
        inner = {e for _, e in spans_f[tc:et - 1]} & {e for _, e in spans_c[sc:ec - 1]}
        assert not inner - {spans_c[ec - 1][1]}
    # a coarse token holds whole bytes: its groups are one coarse token, but where it splits a
    # character's bytes ("f" and half of "é", then the other half) its two tokens share one
    single = np.diff(a.source_starts) == 1
    assert single.mean() > 0.9 and a.groups < len(ids_c) and 0 < a.one_to_one() < 1
    pooled = a.pool(np.arange(len(ids_c), dtype=float)[:, None])
    assert pooled.shape == (len(ids_f), 1) and (np.diff(pooled[:, 0]) >= 0).all()
    assert ends_c <= {e for _, e in spans_f}
