"""The switch: a session's target model receives the span of the conversation it has not
seen, translated from the source's recorded objects and installed after what its cache holds
(segment-wise transfer, KV-Lingo section 4.7).

Strategies: `segment` (the default), `naive` (re-translate the whole prefix at every switch),
`refresh` (segment-wise, but re-reading the target every N switches). A switch falls back to
re-reading the unseen span, visibly, when there is no translator for the pair, when the
translated tensors are not finite, or when the context is longer than the translator allows.

The fidelity dial (`dial`) and the gate: the translation covers the span except its last
max(R, r) tokens (R: the dial's setting, r = `gate_tokens`), which the target then reads itself;
its NLL on the last of them is compared with the source's, and over the translator's
calibrated threshold the target re-reads the span instead (with `Session(escalate=True)` it
first tries once more reading 4 max(R, r) tokens itself, `dial.escalated`); so it does where
the gate's copy probe finds the history blurred (`gate.read_copy`). The source's side comes
from the final-norm rows every model keeps of the last tokens it read (`CacheLine.tail`). A
translator that copies the source's recurrent state needs that state where the translation
stops: it stops at one of the source's state snapshots.

The attention sink (`Session(sink=s)`, by default what the translator's fit measured): a
pretrained model's attention rests much of its weight on the first tokens of its context
(StreamingLLM), where its keys and values are least like any other position's, so a token-wise
map errs most there. A target that receives the conversation from its start then reads its first
s tokens itself (exact, and s tokens' prefill: they see nothing before them), and the
translation covers the rest. The zoo's small models have no sink
(their fits record s = 0); a real pretrained pair does (`research/results/real.md`).

The target reads those last tokens and whatever the conversation holds after them (the next
prompt, when added before the switch) in one forward, and keeps its last logits: the first
token costs no further forward (`decode`), and the gate, the prompt and it one forward.

Across tokenizers (`views`) positions are the target's: the switch gives the target's tokens
of the text the source has read, up to the last place where both split; each of them reads its
alignment group's source tokens pooled, as its translator was fitted (`_across`). The gate
compares each model's NLL of its own tokens of the same text (`gate.compare_across`).

`receive_span` is the one switch: `plan_switch` decides from values what it does (`SwitchPlan`),
`carry_out` does it. `Session.switch`, the server and the switch benchmark all run it.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace

import mlx.core as mx

from ..translators import gate, relay
from ..capture import PREFILL_CHUNK, RESIDUAL, Capture
from ..translators.install import NotFinite, recompute_first_layers, translate_into
from ..translators.cross_tokenizer import AlignedText, pooling, realigned
from ..errors import KvtransError
from ..layouts import CapturePoint, ObjectKind
from ..layouts.linear_attention import RawRecurrentInputs
from ..translators.alignment import Views
from ..translators.translator import measured_sink
from . import decode, dial
from .line import CacheLine, covers, fixed_slots
from .status import Outcome, SwitchStatus, Verdict


@dataclass(frozen=True)
class Settings:
    """How a session switches: its options (`Session(...)`), as values."""

    strategy: str = "segment"
    refresh_every: int = 4
    max_context: int | None = None
    gate_tokens: int = gate.GATE_TOKENS
    reread: int | None = None
    fidelity: float | None = None
    escalate: bool = False
    recompute: int | None = None
    sink: int | None = None

    def sink_for(self, translator) -> int:
        """The first tokens a target handed the conversation from its start reads itself: the
        session's `sink`, else what the translator's fit measured of its target."""
        return measured_sink(translator) if self.sink is None else self.sink


@dataclass(frozen=True)
class Conversation:
    """The conversation as each model reads it: one token list per tokenizer (`views`), the
    group each model reads (`groups`), and the session's `settings`. A switch reads the session
    through this alone."""

    views: Views
    groups: dict[str, int]
    settings: Settings

    def view(self, name: str) -> list[int]:
        """The conversation as model `name` reads it: its tokenizer's tokens."""
        self.views.sync()
        return self.views.tokens[self.groups[name]]

    def across(self, source: str, target: str) -> bool:
        """Whether `source` and `target` read different tokens of the conversation."""
        return self.groups[source] != self.groups[target]

    def mapped(self, source: str, position: int, target: str) -> int:
        """`target`'s tokens of what `source`'s first `position` tokens cover (`Views.mapped`;
        `position` itself when they share a tokenizer)."""
        if not self.across(source, target):
            return position
        return self.views.mapped(self.groups[source], position, self.groups[target])

    def read(self, line: CacheLine, upto: int, whole: bool = False,
             split_at: int | None = None, generated: range | None = None):
        """Let `line`'s model read the conversation up to `upto` (`decode.read`)."""
        return decode.read(line, self.view(line.name), upto, whole, split_at, generated)


@dataclass(frozen=True)
class SwitchPlan:
    """What a switch from `source` to `target` does, decided from values before anything is
    read or translated: give nothing, re-read up to `upto` (`reason` says why; `full`: the
    target's whole line), or translate [`start`, `upto`) at the dial's `choice`, which the
    gate may still turn into a re-read."""

    source: str
    target: str
    upto: int  # the target's tokens of what the source has read
    start: int = 0
    reason: str | None = None
    full: bool = False
    choice: dial.Choice | None = None
    translator_note: str = ""
    refused_by_gate: bool = False  # the gate's calibration says the translator loses facts

    @property
    def gives_nothing(self) -> bool:
        """Whether the target holds everything already."""
        return self.reason is None and self.choice is None


def plan_switch(conversation: Conversation, src: CacheLine, tgt: CacheLine, translator,
                number: int, refused: str | None = None) -> SwitchPlan:
    """The plan of the switch that gives `tgt` what `src` has read and it has not. `number`:
    this switch's count among the target's (`refresh` re-reads every Nth); `refused`: why a
    switch made ahead fell back (the target reads on instead of translating again)."""
    source, target = src.name, tgt.name
    settings = conversation.settings
    n = conversation.mapped(source, src.seen, target)
    note = translator.info.get("fitted_on", "") if translator is not None else ""
    plan = SwitchPlan(source, target, n, start=tgt.seen, translator_note=note)
    if source == target or n <= tgt.seen and settings.strategy != "naive":
        return plan
    if translator is None:
        return replace(plan, reason="no translator for this pair")
    if refused is not None:
        return replace(plan, reason=f"{refused} (when translating ahead)")
    if settings.strategy == "refresh" and number % settings.refresh_every == 0:
        return replace(plan, reason=f"refresh every {settings.refresh_every} switches",
                       full=True)
    if settings.max_context is not None and n > settings.max_context:
        return replace(plan, reason=f"context {n} tokens is longer than the translator "
                                    f"allows ({settings.max_context})")
    lost = gate.copy_refusal(translator.info.get("gate"), settings.gate_tokens, n)
    if lost is not None:
        return replace(plan, reason=lost, refused_by_gate=True)
    start = 0 if settings.strategy == "naive" else tgt.seen
    if conversation.mapped(target, start, source) < src.recorded_from:
        return replace(plan, reason="the source did not record the span the target has not "
                                    "seen")
    # the frontier's L counts the token the target reads next: n + 1
    choice, why = dial.choose(translator, n + 1, settings.reread, settings.fidelity,
                              settings.recompute)
    if choice is None:
        return replace(plan, reason=why)
    return replace(plan, start=start, choice=choice)


def carry_out(plan: SwitchPlan, conversation: Conversation, src: CacheLine, tgt: CacheLine,
              translator, read_fallback: bool = True) -> SwitchStatus:
    """Do what `plan` says: only the target's line changes; the session's active model, its
    dropped spans and its list of switches are the caller's. `read_fallback=False`: a
    fallback reads nothing (the status says why and how much is left to read)."""
    settings = conversation.settings
    status = SwitchStatus(plan.source, plan.target, Outcome.APPLIED, strategy=settings.strategy,
                          translator_note=plan.translator_note)
    started = time.perf_counter()
    if plan.reason is not None:
        status.gate = Verdict.FIRED if plan.refused_by_gate else status.gate
        _fallback(conversation, tgt, plan.upto, status, plan.reason, full=plan.full,
                  read=read_fallback)
    elif plan.choice is not None:
        choice = plan.choice
        status.reread, status.setting_note = choice.reread, choice.note
        status.expected_agreement = choice.expected_agreement
        status.expected_speedup = choice.expected_speedup
        _translate_and_gate(conversation, translator, src, tgt, plan, status, read_fallback,
                            settings.escalate)
    status.translate_seconds = time.perf_counter() - started
    return status


def receive_span(conversation: Conversation, src: CacheLine, tgt: CacheLine, translator,
                 number: int, read_fallback: bool = True,
                 refused: str | None = None) -> SwitchStatus:
    """Give `tgt` what `src` has read and it has not: translated by `translator` (and judged by
    the gate), or re-read with the reason why (`plan_switch`, then `carry_out`)."""
    plan = plan_switch(conversation, src, tgt, translator, number, refused)
    return carry_out(plan, conversation, src, tgt, translator, read_fallback)


def switch_point(translator, src: CacheLine, start: int, n: int, r: int,
                  at_least: int = 0) -> tuple[int, str]:
    """(C, why the gate cannot run): the translation covers [start, C), the target reads
    [C, n) itself. C = n - r (r: the larger of the gate's tokens and the dial's R); a
    translator that reads the source's state stops at a state snapshot between n - 2r and
    n - r, or, when the target must read no more than `at_least` tokens (the dial's R), up to
    n - 2; a span of r tokens or fewer is read, not translated."""
    if r == 0:
        return n, ""
    if n - start <= r:
        return start, "the target read the whole span itself"
    if CapturePoint.ENGINE not in translator.source_points():
        return n - r, ""
    back = [p for p in src.states if start <= p <= n - r and n - p <= 2 * r]
    ahead = [p for p in src.states if max(start, n - r) < p <= n - 2 and n - p >= at_least]
    if back or ahead:
        return (max(back) if back else min(ahead)), ""
    return n, "the source kept no state a few tokens back (the translator reads its state)"


def _translate_and_gate(conversation: Conversation, translator, src: CacheLine, tgt: CacheLine,
                        plan: SwitchPlan, status: SwitchStatus, read_fallback: bool = True,
                        escalate: bool = True) -> None:
    """Translate [start, C), let the target read [C, n), and let the gate judge its last
    tokens: over its threshold, the target reads more of the span itself (`dial.escalated`,
    once, if `escalate`), else re-reads [start, n) instead (`read_fallback`)."""
    start, n = plan.start, plan.upto
    reread, recompute = plan.choice.reread, plan.choice.recompute
    r = conversation.settings.gate_tokens
    stop_at, why = switch_point(translator, src, start, n, max(r, reread), reread)
    if stop_at == n and reread and why:  # no state to stop at: everything translated
        status.setting_note += f"; R not kept: {why}"
    # the attention sink, read natively by a target that holds nothing yet (under `naive`
    # a later switch starts at 0 too, over a line that holds the sink already)
    sink = conversation.settings.sink_for(translator)
    if tgt.seen == 0 and 0 < sink < stop_at:
        conversation.read(tgt, sink)
        start = status.tokens_sink = sink
    before = None if tgt.cache is None or start == 0 else fixed_slots(tgt.cache)
    if stop_at > start:
        failed = _translate_span(conversation, translator, src, tgt, range(start, stop_at),
                                 recompute, status)
        if failed is not None:
            _fallback(conversation, tgt, n, status, failed, read=read_fallback)
            return
    if r == 0:
        _read_on(conversation, tgt, n)  # the dial's R, if any
        status.tokens_tail = n - stop_at
        status.gate = Verdict.OFF
        return
    if stop_at == n:
        status.gate, status.gate_note = Verdict.UNCHECKED, why
        return
    started = time.perf_counter()
    rows = _read_on(conversation, tgt, n)
    status.tokens_tail = n - stop_at
    if stop_at == start:
        status.gate, status.gate_note = Verdict.UNCHECKED, why
        status.gate_seconds = time.perf_counter() - started
        return
    # the gate judges the last tokens only (the rows both lines keep); after a re-read of R
    # over 2r tokens these follow more native context than calibration saw, so the threshold
    # errs towards letting the translation stand
    since = max(stop_at, n - tgt.recording.tail_rows)
    reading = _gate_reading(conversation, src, tgt, rows, since, n)
    status.gate_seconds = time.perf_counter() - started
    if reading is None:
        status.gate, status.gate_note = Verdict.UNCHECKED, ("the source holds no predictions "
                                                            "of the span's last tokens")
        return
    threshold, why = gate.threshold(translator.info.get("gate"), r, reading.generated, n)
    status.gate_gap = reading.gap
    status.gate_tokens = reading.tokens
    status.gate_threshold = threshold
    status.gate_agreement = reading.agreement
    if threshold is None:
        status.gate, status.gate_note = Verdict.UNCALIBRATED, why
        return
    tail_fired = reading.gap > threshold
    if tail_fired:
        fired = (f"fidelity gate: the target's NLL on the last {reading.tokens} tokens is "
                 f"{reading.gap:+.2f} nats/token from the source's, over the translator's "
                 f"threshold {threshold:.2f}")
    else:
        fired = _copy_check(conversation, translator, src, tgt, range(start, stop_at), n,
                            status)
    if fired is None:
        status.gate = Verdict.PASSED
        return
    status.gate = Verdict.FIRED
    tgt.rewind(start, before)
    status.tokens_translated = status.tokens_tail = 0
    # a wider tail reads the history no better: only the tail's verdict escalates
    if escalate and tail_fired and _escalated(
            conversation, translator, src, tgt, replace(plan, start=start), status,
            read_fallback):
        return
    _fallback(conversation, tgt, n, status, fired, read=read_fallback)


def _copy_check(conversation: Conversation, translator, src: CacheLine, tgt: CacheLine,
                span: range, n: int, status: SwitchStatus) -> str | None:
    """The gate's copy probe of the translated `span` (calibrated where the band of `n` has it):
    why the switch re-reads, or None; the status keeps the reading, or why there is none."""
    band = gate.copy_band(translator.info.get("gate"), conversation.settings.gate_tokens, n)
    if band is None or band.get("threshold") is None:  # not judged where the target barely copies
        return None
    started = time.perf_counter()
    reading = ("the models read different tokens" if conversation.across(src.name, tgt.name)
               else gate.read_copy(src, tgt, conversation.view(tgt.name), span))
    status.gate_seconds += time.perf_counter() - started
    if isinstance(reading, str):
        status.gate_note = f"history not probed: {reading}"
        return None
    status.copy_gap, status.copy_threshold = reading.gap, band["threshold"]
    status.copy_tokens = reading.tokens
    if reading.gap <= band["threshold"]:
        return None
    return (f"fidelity gate: the target copies the history {reading.gap:+.2f} nats/token worse "
            f"than the source, over the threshold {band['threshold']:.2f}: facts may be lost")


def _translate_span(conversation: Conversation, translator, src: CacheLine, tgt: CacheLine,
                    span: range, recompute: int, status: SwitchStatus) -> str | None:
    """Translate the source's recorded `span` into the target (its first `recompute` layers
    reading the span themselves); None, or why it could not be translated."""
    own = _own_layers(tgt, span.start, recompute)
    try:
        _translate(conversation, translator, src, tgt, span.start, span.stop, status)
        status.layers_relayed = len(getattr(relay.relay_of(translator), "layers", ()))
        if own:
            ids = conversation.view(tgt.name)[span.start:span.stop]
            recompute_first_layers(tgt.lm.model, tgt.cache, own, mx.array(ids)[None], len(own))
            status.layers_recomputed = len(own)
    except ValueError as e:  # the recorded span lacks what the translator reads
        return f"cannot translate the source's cache: {e}"
    except NotFinite:
        return "translated tensors are not finite"
    tgt.snapshot()
    return None


def _gate_reading(conversation: Conversation, src: CacheLine, tgt: CacheLine, rows, since: int,
                  n: int):
    """The gate's reading of the tokens [since, n): across tokenizers, each model's NLL of its
    own tokens of their text."""
    if not conversation.across(src.name, tgt.name):
        return gate.compare(src.lm.model, src.tail, tgt.lm.model, rows or tgt.tail,
                            conversation.view(tgt.name), since, n)
    views = conversation.views
    s = conversation.groups[src.name]
    t = conversation.groups[tgt.name]
    views.sync()
    return gate.compare_across(src.lm.model, src.tail, views.tokens[s], views.ends[s],
                               tgt.lm.model, rows or tgt.tail, views.tokens[t], views.ends[t],
                               since, n)


def _escalated(conversation: Conversation, translator, src: CacheLine, tgt: CacheLine,
               plan: SwitchPlan, status: SwitchStatus, read_fallback: bool) -> bool:
    """After the gate fired: translate once more with the target reading a wider tail
    (`dial.escalated`), where the gate can judge that; whether it was tried."""
    r = conversation.settings.gate_tokens
    read, n = max(r, plan.choice.reread), plan.upto
    wider = dial.escalated(read, n - plan.start)
    if wider is None or not plan.start < switch_point(translator, src, plan.start, n,
                                                       max(r, wider), wider)[0] < n:
        return False
    status.setting_note += (f"; the gate fired at R = {read} (gap {status.gate_gap:+.2f}, "
                            f"threshold {status.gate_threshold:.2f}): R = {wider}")
    first_seconds = status.gate_seconds
    expected = dial.expecting(translator, wider, n + 1, plan.choice.recompute)
    status.reread = wider
    status.expected_agreement = expected.expected_agreement
    status.expected_speedup = expected.expected_speedup
    status.gate_gap = status.gate_threshold = status.gate_agreement = None
    status.gate_tokens = 0  # the second reading's, or none
    _translate_and_gate(conversation, translator, src, tgt,
                        replace(plan, choice=replace(plan.choice, reread=wider)), status,
                        read_fallback, escalate=False)
    status.gate_seconds += first_seconds
    return True


def _own_layers(tgt: CacheLine, start: int, recompute: int) -> list:
    """The caches of the target's first `recompute` layers before the span (copies, or fresh
    ones where the span starts the target's cache), which it then reads itself; none on a
    sharded target, whose layers live in several processes."""
    from mlx_lm.models.cache import make_prompt_cache

    k = min(recompute, len(tgt.layout.layers))
    if k == 0 or tgt.shards is not None:
        return []
    if start == 0 or tgt.cache is None:
        return make_prompt_cache(tgt.lm.model)[:k]
    return copy.deepcopy(tgt.cache[:k])


def _read_on(conversation: Conversation, tgt: CacheLine, n: int):
    """The target reads the span's last tokens [seen, n) on the translation and, in the same
    forward, what the conversation holds after them (the next prompt, which it reads before
    its first token anyway): one forward for the gate and the first decode step, whose logits
    the line keeps. Returns the final-norm rows of the tokens read (None when it took more
    than one forward)."""
    ahead = len(conversation.view(tgt.name))
    if ahead - tgt.seen > PREFILL_CHUNK:
        conversation.read(tgt, n)
        return None
    return conversation.read(tgt, ahead, whole=True, split_at=n)


def _translate(conversation: Conversation, translator, src: CacheLine, tgt: CacheLine, start: int,
               stop: int, status: SwitchStatus) -> None:
    """Translate the source's recorded [start, stop) and install it after what the target
    holds (a fresh cache when it holds nothing, or under `naive`)."""
    if conversation.across(src.name, tgt.name):
        span = _across(conversation, translator, src, tgt, start, stop)
    else:
        span = src.span(conversation.view(src.name), start, stop)
    fresh = start == 0 or tgt.cache is None
    # What the target now holds for the span, at the points the translator produced it and
    # its own translators read: a later switch away translates it onwards, errors and all;
    # a conv history's every row only where one of them reads it (else its K-1 rows)
    select = set(tgt.recording.select)
    layers = tgt.layout.layers
    all_rows = any(layers[i].cache.object(name).kind == ObjectKind.CONV_HISTORY
                   for i, name, p in select if (name, p) != RESIDUAL)
    # the conv histories before the span: a replay's raw rows are recorded convolved after them
    raw = any(getattr(r, "convolve", False) for r in translator.recipes)
    before = ([{}] * len(layers) if fresh or not raw else [None] * len(layers)
              if tgt.shards is not None
              else [layer.cache.read_engine(c) for layer, c in zip(layers, tgt.cache)])
    objects, points, cache = translate_into(translator, span, tgt.lm.model, span.tokens,
                                            offset=start, cache=None if fresh else tgt.cache,
                                            all_rows=all_rows, finite=True)
    if fresh:
        tgt.recorded = []
        tgt.tail = None
        tgt.states = {}
    held = [{(name, points[i][name]): _recorded(layers[i].cache, value, before[i])
             for name, value in objs.items()
             if (i, name, points[i][name]) in select and covers(value, stop - start)}
            for i, objs in enumerate(objects)]
    if tgt.shards is not None:  # each process translated the layers it holds
        held = tgt.shards.share_held(held)
    tgt.keep(start, Capture(tgt.layout, span.tokens, held, cache), own=False)
    tgt.cache, tgt.seen = cache, stop
    status.tokens_translated = stop - start


def _recorded(layer, value, before: dict | None):
    """What the target records of a translated object: replay's rows before the convolution
    (`RawRecurrentInputs`) as the recurrence inputs installing made of them, after the conv
    histories `before` (None: not read, on a sharded target), so a switch onwards reads what a
    recorded normed is."""
    if not isinstance(value, RawRecurrentInputs):
        return value
    if before is None:
        raise KvtransError("a sharded target cannot yet record a replay through its "
                           "convolution after a span it holds; fit without replay_convolve")
    return layer.convolved(value, before)


def _across(conversation: Conversation, translator, src: CacheLine, tgt: CacheLine, start: int,
            stop: int) -> Capture:
    """What the source recorded of the text of the target's tokens [start, stop), seen at the
    target's tokens: each reads its group's source tokens pooled as the translator was fitted
    (`cross_tokenizer.realigned`). Its state is rebuilt by replay, so no engine objects."""
    how = translator.info["alignment"].get("pooling", "mean")
    groups = conversation.groups
    alignment = conversation.views.alignment(groups[src.name], groups[tgt.name])
    sources, weights = pooling(alignment, how)
    sources, weights = sources[start:stop], weights[start:stop]
    lo, hi = int(sources.min()), int(sources.max()) + 1
    ids = conversation.view(src.name)
    span = src.span(ids, lo, hi)
    objects = [{key: value for key, value in layer.items() if key[1] != CapturePoint.ENGINE}
               for layer in span.objects]
    text = AlignedText(mx.array([ids[lo:hi]]), mx.array([conversation.view(tgt.name)[start:stop]]),
                       mx.array(sources - lo), mx.array(weights), alignment.one_to_one(), how)
    return realigned(Capture(span.layout, span.tokens, objects, span.engine), text)


def _fallback(conversation: Conversation, tgt: CacheLine, n: int, status: SwitchStatus, reason: str,
              full: bool = False, read: bool = True) -> None:
    """Re-reading: the target reads up to `n`, what it has not seen (everything, when
    `full`); without `read`, that is left to the caller."""
    status.status, status.reason = Outcome.FALLBACK, reason
    if full:
        tgt.reset()
    status.tokens_fallback = n - tgt.seen
    if read:
        conversation.read(tgt, n)
