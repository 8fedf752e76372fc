"""Token alignment between two tokenizers of the same text (KV-Lingo, section 4.4 and
appendix K): the minimal groups of source and target tokens that cover the same characters.

Two tokenizers split a text differently; a position of one has no single position of the
other. Both split it at some common places, though: wherever a source token and a target token
end at the same character. Between two such places lies a group, the fewest tokens of each side
that cover the same span of text (on the same corpus, most groups are one token on each side).
A source token's features then feed the target tokens of its group (`Alignment.pool`), and the
target's own positions are those of its tokens.

Character spans come from the fast tokenizers' offset mappings. A byte-level tokenizer may give
two tokens the same span (the bytes of one character split between them); tokens without
characters (special tokens) join the group they stand in; a token sharing its end with the
next (the bytes of one character) stays in the next one's group.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

POOLINGS = ("mean", "first", "last")


def char_spans(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(token ids, (start, end) character offsets of each) of `text`, without special tokens
    added: from a `tokenizers` tokenizer, a Hugging Face fast tokenizer, or mlx-lm's wrapper
    of one."""
    fast = getattr(tokenizer, "_tokenizer", tokenizer)
    if hasattr(fast, "encode_batch"):  # tokenizers.Tokenizer
        encoded = fast.encode(text, add_special_tokens=False)
        return list(encoded.ids), [tuple(span) for span in encoded.offsets]
    encoded = fast(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [tuple(span) for span in encoded["offset_mapping"]]


@dataclass
class Alignment:
    """Minimal groups: group g holds source tokens [source_starts[g], source_starts[g + 1])
    and target tokens [target_starts[g], target_starts[g + 1]) (the last bound is each side's
    length)."""

    source_starts: np.ndarray  # (groups + 1,)
    target_starts: np.ndarray  # (groups + 1,)

    @property
    def groups(self) -> int:
        return len(self.source_starts) - 1

    def one_to_one(self) -> float:
        """Share of groups that are one token on each side."""
        return float(np.mean((np.diff(self.source_starts) == 1) &
                             (np.diff(self.target_starts) == 1))) if self.groups else 1.0

    def target_group(self) -> np.ndarray:
        """(target tokens,) the group of each target token."""
        return np.repeat(np.arange(self.groups), np.diff(self.target_starts))

    def pool(self, source_rows: np.ndarray, how: str = "mean") -> np.ndarray:
        """(target tokens, ...) rows: each target token gets its group's source rows pooled
        (`how`: mean, first or last), from `source_rows` (source tokens, ...)."""
        if how not in POOLINGS:
            raise ValueError(f"pooling must be {', '.join(POOLINGS)}, not {how!r}")
        starts, ends = self.source_starts[:-1], self.source_starts[1:]
        if how == "first":
            per_group = source_rows[starts]
        elif how == "last":
            per_group = source_rows[ends - 1]
        else:
            sums = np.add.reduceat(source_rows, starts, axis=0)
            per_group = sums / np.diff(self.source_starts).reshape(-1, *[1] * (sums.ndim - 1))
        return per_group[self.target_group()]


def align(source_spans: list[tuple[int, int]], target_spans: list[tuple[int, int]]
          ) -> Alignment:
    """The minimal groups of two tokenizations of one text, from their character spans: a
    group ends at each character where a token of each side ends."""
    s_ends, t_ends = _ends(source_spans), _ends(target_spans)
    s_total, t_total = (s_ends or [0])[-1], (t_ends or [0])[-1]
    if s_total != t_total:
        raise ValueError("the two tokenizations cover different text: they end at characters "
                         f"{s_total} and {t_total}")
    common = sorted(set(s_ends) & set(t_ends))
    return Alignment(np.array([0] + [bisect_right(s_ends, c) for c in common]),
                     np.array([0] + [bisect_right(t_ends, c) for c in common]))


def _ends(spans: list[tuple[int, int]]) -> list[int]:
    """Each token's end, never before an earlier token's (a token without characters ends
    where the one before it did), so the list is sorted."""
    out, last = [], 0
    for _, end in spans:
        last = max(last, end)
        out.append(last)
    return out
