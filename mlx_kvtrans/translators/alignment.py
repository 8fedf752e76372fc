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

The conversation as each tokenizer reads it (`Views`), for a session whose models tokenize
differently: such a session keeps the conversation as text and, per tokenizer, a view: that
tokenizer's tokens of the text and the character where each token's text ends. A piece of text
added to the conversation (a user turn, a template's markup) is tokenized by every tokenizer;
tokens a model appends to its own view (its reply) are decoded to text, which the other
tokenizers read when their view is next asked for. Pieces are tokenized one by one, so every
piece's end is a place where all views split: a switch switches whole alignment groups
(`align`: the fewest tokens of each side covering the same characters), up to the last place
both views split within what the source has read.

A model's own tokens of its reply need not be what its tokenizer would make of the reply's
text; their character ends then come from decoding them piece by piece (`own_ends`).

A session whose models share one tokenizer keeps that one token list and no text: there is
nothing to keep in step.
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


# -- the conversation as each tokenizer reads it ---------------------------------------------
def tokenizer_groups(models: dict) -> dict[str, str]:
    """model -> the first model with the same vocabulary (one token list serves them); a model
    loaded without a tokenizer reads the first group's ids."""
    groups: dict[str, str] = {}
    vocabularies: list[tuple[str, dict]] = []
    for name, lm in models.items():
        if lm.tokenizer is None:
            continue
        vocab = lm.tokenizer.get_vocab()
        groups[name] = next((first for first, v in vocabularies if v == vocab), name)
        if groups[name] == name:
            vocabularies.append((name, vocab))
    first = next(iter(groups.values()), next(iter(models), None))
    return {name: groups.get(name, first) for name in models}


def conversation_groups(models: dict, translators: dict, groups: dict | None = None
                        ) -> dict[str, str]:
    """model -> the first model of those one conversation can move between: the models that
    share a tokenizer (`groups`, `tokenizer_groups` by default), joined by translators across
    tokenizers (`translators`: (source, target) -> Translator)."""
    groups, order = dict(groups or tokenizer_groups(models)), list(models)
    for a, b in translators:
        if a in groups and b in groups and groups[a] != groups[b]:
            first, later = sorted((groups[a], groups[b]), key=order.index)
            groups = {name: first if group == later else group for name, group in groups.items()}
    return groups


def decode(tokenizer, ids: list[int]) -> str:
    """The text of `ids`, special tokens and spaces as they are."""
    fast = getattr(tokenizer, "_tokenizer", tokenizer)
    if hasattr(fast, "encode_batch"):  # tokenizers.Tokenizer
        return fast.decode(ids, skip_special_tokens=False)
    return fast.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class Views:
    """The conversation's text and each tokenizer group's tokens of it. `tokenizers`: group ->
    tokenizer. `tokens[g]` is the list a model of group g reads and appends to."""

    def __init__(self, tokenizers: dict):
        self.tokenizers = dict(tokenizers)
        self.across = len(self.tokenizers) > 1  # else one token list, no text kept
        self.tokens: dict[str, list[int]] = {g: [] for g in tokenizers}
        self.ends: dict[str, list[int]] = {g: [] for g in tokenizers}  # per token, its end
        self.length = 0  # characters of text so far

    def add_text(self, text: str) -> None:
        """Append `text` to the conversation: every group tokenizes it."""
        if not self.across:
            for group, tokenizer in self.tokenizers.items():
                self.tokens[group].extend(char_spans(tokenizer, text)[0])
            return
        self.sync()
        for group, tokenizer in self.tokenizers.items():
            ids, spans = char_spans(tokenizer, text)
            self._extend(group, ids, [end for _, end in spans])
        self.length += len(text)

    def sync(self) -> None:
        """Give every group the text of tokens appended to one view since the last sync (a
        reply, tokens added as ids): decoded, and read by the other tokenizers."""
        if not self.across:
            return
        ahead = [g for g in self.tokens if len(self.tokens[g]) > len(self.ends[g])]
        if len(ahead) > 1:
            raise ValueError(f"tokens were appended to the views of {', '.join(ahead)} at once")
        if not ahead:
            return
        group = ahead[0]
        ids = self.tokens[group][len(self.ends[group]):]
        text, ends = own_ends(self.tokenizers[group], ids)
        self.ends[group].extend(self.length + e for e in _rising(ends))
        for other, tokenizer in self.tokenizers.items():
            if other != group:
                ids, spans = char_spans(tokenizer, text)
                self._extend(other, ids, [end for _, end in spans])
        self.length += len(text)

    def _extend(self, group: str, ids: list[int], ends: list[int]) -> None:
        self.tokens[group].extend(int(i) for i in ids)
        self.ends[group].extend(self.length + e for e in _rising(ends))

    def count(self, group: str, char: int) -> int:
        """How many of `group`'s tokens end at or before character `char`."""
        return bisect_right(self.ends[group], char)

    def mapped(self, source: str, position: int, target: str) -> int:
        """The target's tokens of the text that the source's first `position` tokens cover, up
        to the last place where both views split: what a switch of them may give."""
        self.sync()
        ends, targets = self.ends[source], set(self.ends[target])
        for i in range(min(position, len(ends)) - 1, -1, -1):
            char = ends[i]
            if char in targets and self.count(source, char) <= position:
                return self.count(target, char)
        return 0

    def common(self, group: str, position: int) -> int:
        """The most of `group`'s first `position` tokens that end at a place where every view
        splits (every view then holds whole tokens of the text before it)."""
        if not self.across:
            return position
        self.sync()
        ends, others = self.ends[group], [set(e) for g, e in self.ends.items() if g != group]
        for q in range(min(position, len(ends)), 0, -1):
            char = ends[q - 1]
            if self.count(group, char) == q and all(char in other for other in others):
                return q
        return 0

    def cut(self, group: str, position: int) -> None:
        """Keep the text of `group`'s first `position` tokens (a place `common` gives) and
        every view's tokens of it."""
        if not self.across:
            del self.tokens[group][position:]
            return
        self.sync()
        char = self.ends[group][position - 1] if position else 0
        for g in self.tokens:
            n = self.count(g, char)
            del self.tokens[g][n:], self.ends[g][n:]
        self.length = char

    def copy(self) -> "Views":
        twin = Views(self.tokenizers)
        twin.tokens = {g: list(t) for g, t in self.tokens.items()}
        twin.ends = {g: list(e) for g, e in self.ends.items()}
        twin.length = self.length
        return twin

    def alignment(self, source: str, target: str) -> Alignment:
        """The minimal groups of the whole conversation between two views."""
        self.sync()
        return align([(0, e) for e in self.ends[source]], [(0, e) for e in self.ends[target]])


def own_ends(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """(the text of `ids`, the character where each token's text ends), for tokens a model
    chose itself: its tokenizer's split of the text when that is the same ids, else the length
    of each prefix's decoded text (a character whose bytes two tokens share ends at the
    second)."""
    text = decode(tokenizer, ids)
    own, spans = char_spans(tokenizer, text)
    if own == list(ids):
        return text, [end for _, end in spans]
    # decoded in pieces, each from the last token that ended a whole character
    ends = []
    start = 0
    at = 0
    for i in range(len(ids)):
        piece = decode(tokenizer, ids[start:i + 1])
        ends.append(min(at + len(piece), len(text)))
        if not piece.endswith("\ufffd"):
            start, at = i + 1, at + len(piece)
    if at == len(text):
        return text, ends
    # a tokenizer whose pieces do not add up (a leading space dropped): every prefix
    return text, [min(len(decode(tokenizer, ids[:i + 1])), len(text)) for i in range(len(ids))]


def _rising(ends: list[int]) -> list[int]:
    """Each end never before an earlier one (a token without characters ends where the one
    before it did)."""
    return np.maximum.accumulate(np.asarray(ends, dtype=np.int64)).tolist() if ends else []
