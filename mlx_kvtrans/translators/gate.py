"""The fidelity gate: does the target continue from a translated cache as the source would?

At a switch the target receives the span it has not seen translated, except its last r tokens,
which it reads itself on top of the translation (C = N - r, as the hybrid-translation paper
times its switch; the target must read them anyway). Its mean NLL on those tokens, beside the
source's NLL on the same tokens, is the gap:

    gap = mean_i NLL_T(x_i | translated cache, x_C..x_i-1) - mean_i NLL_S(x_i | x_<i)

The source's NLL comes from what it computed while reading or writing those tokens: a `Tail` of
its final-norm rows, kept as it goes, turned into NLLs only at a switch (r rows through the
output head, never the whole prompt). A translator's manifest carries the threshold the gap of
good translations stays under (`mlx_kvtrans.training.calibrate`: a high quantile over held-out windows
plus a margin); a switch whose gap is over it re-reads. The session records the verdict
(`session.status.Verdict`).

A model's NLL on the tokens it sampled itself is lower than on text it read (greedy decoding
picks its most likely token), so the gap runs higher when the tail is the source's own reply;
calibration measures both kinds of tail and a switch takes the threshold of the mix it holds.

The tail shows how the target reads on, not what it can still find in the history: a
translation that blurs exact tokens (a number, a name) reads prose as well as a good one and
loses the facts. So the gate also probes the history (`copy_spans`): both models read a few
spans of the translated part again on top of what they hold, their caches left as they were
after (`CacheLine.peek`), and a model that holds the history predicts such a repeat from it (an
induction head's copy). The target's mean NLL of the repeats beside the source's is the copy
gap. Models copy unequally even from their own caches, so calibration measures the same gap
with the target reading its own cache of each window, and records per band:
- `loss`: the mean of translated - native gap over the windows. A translator whose target
  copies the history this much worse than from its own cache loses facts as a rule, not by
  chance: over `COPY_LOSS` its switches re-read (`copy_refusal`), saying why.
- `worth`: how much the target's own history lowers its NLL of the repeats against reading
  them alone (with no history before them, so no sink either).
- `threshold`, where `worth` is `COPY_WORTH` or more: a high quantile of the native gap plus
  `COPY_MARGIN`: a switch over it copies worse than the target ever does from its own cache,
  and re-reads. A band calibrated before `worth` was measured keeps its threshold.

Between models that tokenize differently (`compare_across`) each reads its own tokens of the
same text: the tail's text is cut to places where both split, each model's NLL of its tokens
of it summed, and the gap is their difference per target token.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import mlx.core as mx

from ..backend import fast_math
from ..capture.instrument import output_head

GATE_TOKENS = 8  # r: the span's last tokens the target reads itself
KINDS = ("read", "generated")  # a tail the source read, or one it wrote: thresholds per kind
# the copy probe: spans of the translated history read again, and their first tokens, which
# the model cannot yet tell from any other place they could continue, not scored
COPY_SPANS = 4
COPY_WIDTH = 16
COPY_SKIP = 3
# nats/token a translator's target may copy the history worse than from its own cache, on
# average over the calibration's windows: well above what the real family's continued sibling's
# translations lose, well below its pruned sibling's, which lose needles (each manifest's
# gate bands' `copy`; `benchmarks/results/real-family.md`)
COPY_LOSS = 0.25
COPY_MARGIN = 0.25  # nats/token over the native gap's high quantile: one switch's threshold
# nats/token the target's own history must lower its NLL of the repeats by, on average over the
# calibration's windows, for one switch's copy gap to be judged: where the target barely copies
# from its history (the zoo's small models), the gap is how two models read a text, which moves
# with the text (chat against prose) more than with what a translation lost
COPY_WORTH = 0.5


@dataclass(frozen=True)
class Tail:
    """Final-norm rows of the last tokens a model read: row i is its hidden state after reading
    conversation token `start + i`, from which it predicts token `start + i + 1`."""

    rows: mx.array  # (k, D), in the dtype the model computed them in
    start: int
    generated: tuple[bool, ...]  # per row: the model sampled the next token from it

    @property
    def end(self) -> int:
        return self.start + len(self.generated)

    def cut(self, stop: int) -> "Tail | None":
        """The rows of tokens before `stop`."""
        n = min(stop, self.end) - self.start
        return Tail(self.rows[:n], self.start, self.generated[:n]) if n > 0 else None

    def then(self, later: "Tail", keep: int) -> "Tail":
        """`later` after this one (joined when it starts where this ends), its last `keep` rows."""
        if later.start == self.end:
            later = Tail(mx.concatenate([self.rows, later.rows]), self.start,
                         self.generated + later.generated)
        drop = max(0, len(later.generated) - keep)
        return Tail(later.rows[drop:], later.start + drop, later.generated[drop:])


def tail_of(rows: mx.array | None, end: int, generated: range | None = None
            ) -> Tail | None:
    """A Tail of `rows` ending after conversation token `end - 1`; the tokens at positions
    `generated` were sampled by the model."""
    if rows is None:
        return None
    start = end - rows.shape[0]
    return Tail(rows, start, tuple(generated is not None and p + 1 in generated
                                   for p in range(start, end)))


def tail_logits(model, rows: mx.array) -> mx.array:
    """(k, V) float32 logits `model` predicts from final-norm `rows` (k, D): its output head on
    k rows."""
    return output_head(model)(rows).astype(mx.float32)


def tail_nll(model, rows: mx.array, targets: mx.array) -> mx.array:
    """(k,) NLL of token ids `targets` under the predictions `model` makes from `rows`."""
    return nll_of(tail_logits(model, rows), targets)


def nll_of(logits: mx.array, targets: mx.array) -> mx.array:
    picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return fast_math.logsumexp(logits) - picked


@dataclass(frozen=True)
class Reading:
    gap: float  # nats/token: target's mean NLL - the source's
    tokens: int  # tokens compared
    generated: float  # share of them the source had sampled itself
    target_nll: float
    source_nll: float
    # share of the tokens where the two models' argmax is the same (None across tokenizers)
    agreement: float | None = 1.0


def compare(source_model, source: Tail | None, target_model, target: Tail | None,
            tokens: list[int], start: int, stop: int) -> Reading | None:
    """The gap over the tokens predicted from rows [start, stop) that both models hold (None
    when they share none). `tokens`: the conversation, so token p + 1 is what row p predicts."""
    if source is None or target is None:
        return None
    positions = [p for p in range(start, stop) if p + 1 < len(tokens)
                 and source.start <= p < source.end and target.start <= p < target.end]
    if not positions:
        return None
    targets = mx.array([tokens[p + 1] for p in positions])
    s = tail_logits(source_model, source.rows[mx.array([p - source.start for p in positions])])
    t = tail_logits(target_model, target.rows[mx.array([p - target.start for p in positions])])
    # one evaluation for the three figures
    figures = mx.stack([nll_of(s, targets).mean(), nll_of(t, targets).mean(),
                        (mx.argmax(s, axis=-1) == mx.argmax(t, axis=-1)).mean()])
    s_mean, t_mean, agree = figures.tolist()
    share = sum(source.generated[p - source.start] for p in positions) / len(positions)
    return Reading(t_mean - s_mean, len(positions), share, t_mean, s_mean, agree)


def band_of(calibration: dict, length: int) -> dict:
    """The calibration's band of prefix lengths a switch after `length` tokens takes (a longer
    switch the last)."""
    bands = calibration["bands"]
    return next((b for b in bands if length <= b["prefix"][1]), bands[-1])


def threshold(calibration: dict | None, tail: int, generated: float, length: int
              ) -> tuple[float | None, str]:
    """(the threshold for a switch after `length` tokens whose tail of `tail` tokens the source
    had sampled a share `generated` of, why there is none)."""
    if not calibration:
        return None, ("the translator has no gate calibration (`kvtrans calibrate` or "
                      "calibrate.calibrate_directory makes one)")
    if calibration.get("tail") != tail:
        return None, (f"the translator's gate is calibrated for a tail of "
                      f"{calibration.get('tail')} tokens, not {tail}")
    t = band_of(calibration, length)["threshold"]
    return generated * t["generated"] + (1 - generated) * t["read"], ""



def compare_across(source_model, source: Tail | None, source_tokens: list[int],
                   source_ends: list[int], target_model, target: Tail | None,
                   target_tokens: list[int], target_ends: list[int], start: int, stop: int
                   ) -> Reading | None:
    """The gap between two models that tokenize differently, over the text of the target's
    tokens predicted from rows [start, stop), cut to places where both split: each model's NLL
    of its own tokens of that text, summed, the difference per target token. `*_ends`: the
    character where each token ends (`alignment.Views`). None when the tails share no such
    text."""
    if source is None or target is None:
        return None
    first, last = max(start, target.start) + 1, min(stop, target.end, len(target_tokens) - 1)
    if first > last:
        return None
    splits = sorted(set(source_ends) & set(target_ends) | {0})
    low = target_ends[first - 1]  # the predicted text begins after it
    c0 = next((c for c in splits if c >= low), None)
    c1 = max((c for c in splits if c <= target_ends[last]), default=None)
    if c0 is None or c1 is None or c1 <= c0:
        return None
    t = range(bisect_right(target_ends, c0), bisect_right(target_ends, c1))
    s = range(bisect_right(source_ends, c0), bisect_right(source_ends, c1))
    # every token predicted by a row its model's tail holds (row p predicts token p + 1)
    if not (t and s and target.start <= t.start - 1 and t.stop - 1 <= target.end
            and source.start <= s.start - 1 and s.stop - 1 <= source.end):
        return None
    rows_t = target.rows[mx.array([q - 1 - target.start for q in t])]
    rows_s = source.rows[mx.array([q - 1 - source.start for q in s])]
    figures = mx.stack([
        nll_of(tail_logits(source_model, rows_s), mx.array([source_tokens[q] for q in s])).sum(),
        nll_of(tail_logits(target_model, rows_t), mx.array([target_tokens[q] for q in t])).sum()])
    s_sum, t_sum = figures.tolist()
    share = sum(source.generated[q - 1 - source.start] for q in s) / len(s)
    return Reading((t_sum - s_sum) / len(t), len(t), share, t_sum / len(t), s_sum / len(t),
                   None)


# -- the copy probe -----------------------------------------------------------------------------
def copy_spans(start: int, stop: int, spans: int = COPY_SPANS, width: int = COPY_WIDTH
               ) -> list[range]:
    """The history's spans the probe reads again: up to `spans` of `width` tokens, evenly
    across [start, stop); none when it is shorter than one."""
    k = min(spans, (stop - start) // width)
    return [range(start + (stop - start) * i // k, start + (stop - start) * i // k + width)
            for i in range(k)]


def copy_probe(tokens: list[int], spans: list[range]) -> list[int]:
    """The spans' tokens, one after another: what each model reads on top of its cache."""
    return [tokens[p] for span in spans for p in span]


def _scored(length: int, width: int = COPY_WIDTH, skip: int = COPY_SKIP) -> list[int]:
    """The probe's positions whose next token is scored: each span's after its first `skip`."""
    return [i for i in range(length - 1) if (i + 1) % width >= skip]


def copy_nll(logits: mx.array, probe: list[int]) -> mx.array:
    """Mean NLL of each span's tokens after its first `COPY_SKIP`, predicted by `logits`
    (len(probe), V): a model's logits reading `probe` on top of its cache."""
    nll = nll_of(logits[:-1].astype(mx.float32), mx.array(probe[1:]))
    return nll[mx.array(_scored(len(probe)))].mean()


@dataclass(frozen=True)
class CopyReading:
    gap: float  # nats/token: the target's mean NLL of the repeats - the source's
    tokens: int  # tokens scored
    target_nll: float
    source_nll: float


def compare_copy(source_logits: mx.array, target_logits: mx.array, probe: list[int]
                 ) -> CopyReading:
    """The copy gap from each model's logits reading `probe` (`copy_probe`)."""
    s, t = mx.stack([copy_nll(source_logits, probe), copy_nll(target_logits, probe)]).tolist()
    return CopyReading(t - s, len(_scored(len(probe))), t, s)


def read_copy(source, target, tokens: list[int], span: range) -> CopyReading | str:
    """The copy gap of two cache lines (`CacheLine`: they `peek`) that read the same `tokens`,
    over spans of `span`; or why it cannot be read."""
    spans = copy_spans(span.start, span.stop)
    if not spans:
        return "the translated span is shorter than a probe"
    if not span.stop <= source.seen <= target.seen:
        return "the source holds another part of the conversation"
    probe = copy_probe(tokens, spans)
    # the target has read the next prompt too: the source reads it first, so that both read
    # the probe after the same tokens
    behind = tokens[source.seen:target.seen]
    s = source.peek(behind + probe)
    t = target.peek(probe) if s is not None else None
    if t is None:
        return "a cache cannot be put back after a probe"
    return compare_copy(s[len(behind):], t, probe)


def copy_band(calibration: dict | None, tail: int, length: int) -> dict | None:
    """The copy probe's calibration (`loss`, and `threshold` where one switch is judged) of the
    band a switch after `length` tokens falls in, as `threshold` picks it; None where the gate
    is calibrated for another tail, or without the probe in that band."""
    if not calibration or calibration.get("tail") != tail:
        return None
    return band_of(calibration, length).get("copy")


def copy_refusal(calibration: dict | None, tail: int, length: int) -> str | None:
    """Why a switch after `length` tokens re-reads without translating: the translator's target
    copied the history worse than from its own cache by over `COPY_LOSS` on held-out text."""
    band = copy_band(calibration, tail, length)
    if band is None or band["loss"] <= COPY_LOSS:
        return None
    return (f"fidelity gate: on held-out text this translator's target copies the history "
            f"{band['loss']:+.2f} nats/token worse than from its own cache (over "
            f"{COPY_LOSS:.2f}): its translations lose facts")
