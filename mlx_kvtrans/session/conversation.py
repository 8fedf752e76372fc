"""`Session`: one conversation, several models, one cache line per model.

The session holds the conversation's tokens, each model's `CacheLine` and the translators
between them, and decides what each model records while it reads: only what its outgoing
translators read (`Translator.reads`); a model with no translator from it records nothing.
Under `segment` and `refresh` a recorded span is dropped once every model this one has a
translator to has read it; `naive` keeps everything. Reading and decoding live in `decode`; a
switch is planned from values and carried out in `switching`.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Iterator

from ..layouts import CapturePoint
from ..models import vocabulary_rows
from ..translators import gate
from ..translators.alignment import Views, tokenizer_groups
from . import decode, dial
from .line import CacheLine, Recording
from .status import Outcome, SwitchStatus
from .switching import Conversation, SwitchPlan, Settings, carry_out, plan_switch

STRATEGIES = ("segment", "naive", "refresh")


class Session:
    """A conversation that can move between models without re-reading.

    `models`: name -> LoadedModel; `translators`: (source, target) -> Translator. Models
    that tokenize differently each read their own tokens of the conversation (`views`), and
    a translator between them is one fitted across tokenizers.
    `gate_tokens`: r, the span's last tokens the target reads itself at a switch and the gate
    compares (0: no gate). The fidelity dial (`dial`): `reread` R, the span's last tokens the
    target reads itself at every switch (at least r), or `fidelity`, a held-out agreement
    each switch meets with the cheapest setting its translator's frontier measured; neither:
    each translator's default setting. `sink`: the conversation's first tokens, which a target
    that receives it from its start reads itself (`switch`); None: what each translator's fit
    measured of its target (`attention_weights.attention_sink`: 4 for a pretrained model, 0
    for the zoo's). `groups`: model -> its tokenizer group (`views.tokenizer_groups`), when the
    caller has it (comparing vocabularies costs time at a real vocabulary's size).
    `escalate`: a switch whose gate fires tries once more with `dial.ESCALATION` times the
    tokens read before it re-reads the span: fewer re-reads, but a weaker gate (the second
    reading's tail follows more native tokens), which lets more lost needles through
    (`research/results/escalation.md`); off by default. `recompute`: k, the target's first
    layers that read the translated span themselves (DroidSpeak; `install.recompute_first_layers`),
    the rest translated; None: as the dial's setting has it (0 without a frontier that measured
    k).
    """

    def __init__(self, models: dict, translators: dict | None = None, active: str | None = None,
                 strategy: str = "segment", refresh_every: int = 4, max_context: int | None = None,
                 gate_tokens: int = gate.GATE_TOKENS, reread: int | None = None,
                 fidelity: float | None = None, sink: int | None = None, groups: dict | None = None,
                 escalate: bool = False, recompute: int | None = None):
        self.set_strategy(strategy)
        if gate_tokens < 0:
            raise ValueError("gate_tokens must be 0 (no gate) or more")
        if dial.problem(reread, fidelity):
            raise ValueError(dial.problem(reread, fidelity))
        self.groups = {name: groups[name] for name in models} if groups else \
            tokenizer_groups(models)
        for (a, b), translator in (translators or {}).items():
            across = "alignment" in getattr(translator, "info", {})
            if a in models and b in models and across != (self.groups[a] != self.groups[b]):
                raise ValueError(f"the translator {a} -> {b} was fitted for models that "
                                 f"{'do not share' if across else 'share'} a tokenizer; "
                                 f"these {'share' if across else 'do not share'} one")
        # one token list for models that share a tokenizer; across tokenizers, the text too
        self.views = Views({g: models[g].tokenizer for g in set(self.groups.values())})
        self.lines = {name: CacheLine(name, lm) for name, lm in models.items()}
        self.translators = {pair: tr.prepare() for pair, tr in (translators or {}).items()}
        self.active = active or next(iter(models))
        self.refresh_every = refresh_every
        self.max_context = max_context
        if sink is not None and sink < 0:
            raise ValueError("sink must be 0 or more")
        if recompute is not None and recompute < 0:
            raise ValueError("recompute must be 0 or more")
        self.recompute = recompute
        self.gate_tokens, self.sink = gate_tokens, sink
        self.reread = reread
        self.fidelity = fidelity
        self.escalate = escalate
        self.switches: list[SwitchStatus] = []
        self.ahead: dict[str, SwitchStatus] = {}  # target -> its switch made ahead
        self.ahead_from: dict[str, int] = {}  # target -> where that switch began
        # target -> (status, began) of a switch made ahead that fell back and is being
        # re-read in the caller's time: the switch re-reads on instead of translating again
        self.refused: dict[str, tuple[SwitchStatus, int]] = {}
        self._turn = None  # weak reference to a generation not yet finished
        for name, line in self.lines.items():  # what each keeps, for the translators from it
            line.recording = Recording(frozenset(self.selection(name)),
                                       tuple(self.switch_marks(name)), self.keeps_states(name),
                                       gate_tokens)

    # -- the conversation's tokens ------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """The conversation as the active model reads it (the list it appends to)."""
        return self.view(self.active)

    @property
    def settings(self) -> Settings:
        """How this session switches, as values (`switching.Settings`)."""
        return Settings(self.strategy, self.refresh_every, self.max_context, self.gate_tokens,
                        self.reread, self.fidelity, self.escalate, self.recompute, self.sink)

    @property
    def conversation(self) -> Conversation:
        """What a switch reads of this session (`switching.Conversation`)."""
        return Conversation(self.views, self.groups, self.settings)

    def view(self, name: str) -> list[int]:
        """The conversation as model `name` reads it: its tokenizer's tokens."""
        return self.conversation.view(name)

    def sink_for(self, translator) -> int:
        """The first tokens a target handed the conversation from its start reads itself: the
        session's `sink`, else what the translator's fit measured of its target."""
        return self.settings.sink_for(translator)

    def across(self, source: str, target: str) -> bool:
        """Whether `source` and `target` read different tokens of the conversation."""
        return self.conversation.across(source, target)

    def mapped(self, source: str, position: int, target: str) -> int:
        """`target`'s tokens of what `source`'s first `position` tokens cover (`Views.mapped`;
        `position` itself when they share a tokenizer)."""
        return self.conversation.mapped(source, position, target)

    def common(self, name: str, position: int) -> int:
        """The most of `name`'s first `position` tokens that every model's tokens end with
        (`Views.common`; `position` itself when the models share a tokenizer)."""
        return self.views.common(self.groups[name], position)

    def cut(self, name: str, position: int) -> None:
        """Drop the conversation after `name`'s first `position` tokens (a place `common`
        gives), in every model's tokens; the lines are the caller's to rewind."""
        self.views.cut(self.groups[name], position)

    # -- what is recorded ---------------------------------------------------------------------
    def receivers(self, name: str) -> list[str]:
        """The models `name` has a translator to."""
        return [t for (s, t) in self.translators if s == name and t != name and t in self.lines]

    def selection(self, name: str) -> set[tuple[int, str, int]]:
        """(layer, object, capture point) that `name` records per token: the union of what its
        outgoing translators read."""
        layout = self.lines[name].layout
        return set().union(*(self.translators[(name, t)].reads(layout)
                             for t in self.receivers(name)))

    def switch_marks(self, name: str) -> list[int]:
        """How many tokens before a span's end a translation from `name` may stop (largest
        first): r and each R its translators may switch with (`dial`)."""
        marks = {self.gate_tokens}
        for t in self.receivers(name):
            translator = self.translators[(name, t)]
            frontier = getattr(translator, "frontier", None)
            if self.reread is not None:
                rereads = {self.reread}
            elif self.fidelity is not None and frontier is not None:
                rereads = {r.setting.reread for r in frontier.rows}
            else:
                rereads = {dial.default_reread(translator)[0]}
            marks |= {max(r, self.gate_tokens) for r in rereads}
        if self.gate_tokens and self.escalate:  # where a switch whose gate fired stops
            marks |= {dial.ESCALATION * m for m in marks}
        return sorted((m for m in marks if m > 0), reverse=True)

    def keeps_states(self, name: str) -> bool:
        """Whether `name` keeps snapshots of its fixed-size caches: a translator from it reads
        its state, which it needs where the translation stops, a few tokens back."""
        return bool(self.switch_marks(name)) and any(
            CapturePoint.ENGINE in self.translators[(name, t)].source_points()
            for t in self.receivers(name))

    @property
    def tail_rows(self) -> int:
        """Final-norm rows a line keeps: a translation that stops at a state snapshot leaves up
        to 2r tokens to the target."""
        return 2 * self.gate_tokens

    def _drop_received(self) -> None:
        """Segment-wise transfer sends a span once: when every model a line has a translator to
        has read a span, the line's recorded objects of it go (`naive` keeps everything). Whole
        spans go: every model's `seen` is where some span ends."""
        if self.strategy == "naive":
            return
        for name, line in self.lines.items():
            receivers = self.receivers(name)
            if not receivers:
                line.recorded = []
                continue
            cut = min(self.mapped(t, self.lines[t].seen, name) for t in receivers)
            while line.recorded and line.recorded_from + line.recorded[0].length <= cut:
                line.recorded_from += line.recorded.pop(0).length

    def recorded_bytes(self) -> dict[str, int]:
        """Per model: bytes of per-token objects held now."""
        return {name: line.recorded_bytes() for name, line in self.lines.items()}

    # -- the conversation ---------------------------------------------------------------------
    def read(self, line: CacheLine, upto: int, whole: bool = False,
             split_at: int | None = None, generated: range | None = None):
        """Let `line`'s model read conversation tokens [seen, upto) (see `decode.read`)."""
        return self.conversation.read(line, upto, whole, split_at, generated)

    def _finish_turn(self) -> None:
        """End a generation whose iterator is still open (as closing it would)."""
        turn = self._turn() if self._turn is not None else None
        if turn is not None:
            turn.close()
        self._turn = None

    def add(self, token_ids: list[int], model: str | None = None) -> None:
        """Append tokens to the conversation (a user turn, a generation prompt): ids of the
        tokenizer of `model` (default: the active one); across tokenizers the other models
        read their text. An added id outside the vocabulary of a model that reads it is refused
        (MLX does not bound a lookup: it would read past the embedding)."""
        name = model or self.active
        ids = [int(t) for t in token_ids]
        if ids:
            rows = self._vocabulary(name)
            bad = next((t for t in ids if not 0 <= t < rows), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside {name}'s vocabulary "
                                 f"(0..{rows - 1})")
        self._finish_turn()
        self.view(name).extend(ids)

    def _vocabulary(self, name: str) -> int:
        """The smallest vocabulary among the models that read `name`'s tokens."""
        group = self.groups[name]
        return min(vocabulary_rows(line.lm.model)
                   for other, line in self.lines.items() if self.groups[other] == group)

    def add_text(self, text: str) -> None:
        """Append text to the conversation, each model reading its own tokens of it."""
        self._finish_turn()
        self.views.add_text(text)

    def generate(self, max_tokens: int = 256, temperature: float = 0.0,
                 stop: set[int] | None = None, top_p: float = 1.0) -> Iterator[int]:
        """The active model continues the conversation, token by token (appended as it goes).

        mlx-lm's `generate_step` decodes (temperature > 0: mlx-lm's sampler, nucleus-filtered
        when `top_p` < 1); a stop token ends the turn. The turn ends when the iterator is
        exhausted or closed, or when the session is next used (add, generate, switch)."""
        self._finish_turn()
        line = self.lines[self.active]
        if len(self.view(line.name)) <= line.seen and line.next_logits is None:
            raise ValueError("nothing new to respond to: add tokens first")
        turn = decode.decode(line, self.view(line.name), max_tokens, temperature,
                             set(stop or ()), top_p)
        self._turn = weakref.ref(turn)
        return turn

    def translate_ahead(self, target: str, read_fallback: bool = True) -> SwitchStatus:
        """Translate ahead: give `target` what the active model has read, as a switch would
        (translated, judged by the gate, or re-read), without making it active; for the idle
        time between turns, when the next model is known or likely. A later `switch(target)`
        gives only what came since. `read_fallback=False`: a switch that falls back reads
        nothing and is not kept; the caller may read the target's line on (`read`) in its own
        time and keep the status then (`keep_ahead`)."""
        if target not in self.lines:
            raise ValueError(f"unknown model {target!r}")
        self._finish_turn()
        # the source's recorded spans stay until a switch: a line filled ahead may be evicted
        began = self.lines[target].seen
        status = self._receive(target, read_fallback=read_fallback)
        if read_fallback or status.status != Outcome.FALLBACK:
            self.keep_ahead(target, status, began)
        else:
            self.refuse(target, status, began)
        return status

    def refuse(self, target: str, status: SwitchStatus, began: int) -> None:
        """Hold `status`, a switch to `target` made ahead from `began` tokens that fell back
        and that the caller re-reads in its own time (`read`, then `keep_reread`); a switch
        before that is done re-reads the rest instead of translating again."""
        # a full fallback may have reset the line below where it began
        self.refused[target] = (status, min(began, self.lines[target].seen))

    def keep_reread(self, target: str) -> None:
        """Keep what the caller re-read of `target`'s refused switch (its line from where
        that began, less the sink it read) as the switch made ahead (`keep_ahead`)."""
        status, began = self.refused.pop(target)
        status.tokens_fallback = self.lines[target].seen - began - status.tokens_sink
        self.keep_ahead(target, status, began)

    def keep_ahead(self, target: str, status: SwitchStatus, began: int) -> None:
        """Keep `status`, a switch to `target` made ahead from `began` tokens, for the
        switch to report (`joined`)."""
        self.refused.pop(target, None)
        if status.tokens_translated or status.tokens_fallback or status.tokens_tail:
            earlier = self.ahead.get(target)
            if earlier is not None:  # ahead twice: one switch, made in two parts
                status.tokens_translated += earlier.tokens_translated
                status.tokens_tail += earlier.tokens_tail
                status.tokens_sink += earlier.tokens_sink
                status.tokens_fallback += earlier.tokens_fallback
                status.translate_seconds += earlier.translate_seconds
            else:
                self.ahead_from[target] = began
            self.ahead[target] = status

    def forget_ahead(self, target: str, translated: bool = True) -> None:
        """What was handed to `target` ahead no longer holds (its line was cut, reset or moved
        past it): the re-read being made ahead is dropped, and with `translated` the switch
        made ahead too."""
        if translated:
            self.ahead.pop(target, None)
        self.refused.pop(target, None)

    def forgets_ahead_at(self, target: str, keep: int) -> bool:
        """Whether cutting `target`'s line to `keep` tokens cuts into its switch made
        ahead."""
        return keep <= self.ahead_from.get(target, 0)

    def handed_ahead(self, target: str) -> bool:
        """Whether `target`'s line holds a switch made ahead, not yet switched to."""
        return target in self.ahead

    def re_reading_ahead(self, target: str) -> SwitchStatus | None:
        """The refused switch to `target` whose re-read the caller is making ahead."""
        return self.refused[target][0] if target in self.refused else None

    def copy_conversation(self, other: "Session") -> None:
        """Hold `other`'s conversation (each tokenizer's tokens, copied) and its active model;
        the lines are each model's to copy (`CacheLine.copy_from`)."""
        self.views = other.views.copy()
        self.activate(other.active)

    def set_strategy(self, name: str) -> None:
        """Switch by `name` (`STRATEGIES`) from the next switch on."""
        if name not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}")
        self.strategy = name

    def activate(self, name: str) -> None:
        """Make `name` the model that reads and answers next, as it stands (no switch)."""
        if name not in self.lines:
            raise ValueError(f"unknown model {name!r}")
        self.active = name

    def adopt_ahead(self, other: "Session", target: str) -> None:
        """Take `other`'s switches to `target` made ahead, as a copy of its lines does (the
        re-read's status copied: each copy counts its own)."""
        from dataclasses import replace

        if target in other.ahead:
            self.ahead[target] = other.ahead[target]
            self.ahead_from[target] = other.ahead_from.get(target, 0)
        if target in other.refused:
            status, began = other.refused[target]
            self.refused[target] = (replace(status), began)

    def given_ahead(self, target: str) -> int:
        """Tokens of `target`'s line that switches made ahead gave it (translated, read or
        re-read): what a switch reports as switched, not as the line's own."""
        if target in self.ahead:
            s = self.ahead[target]
            return s.tokens_translated + s.tokens_tail + s.tokens_fallback + s.tokens_sink
        if target in self.refused:
            return self.lines[target].seen - self.refused[target][1]
        return 0

    def plan(self, target: str) -> SwitchPlan:
        """What `switch(target)` would do now, decided before anything is read (`SwitchPlan`):
        give nothing, re-read and why, or translate a span at the dial's setting (whose gate
        may still turn it into a re-read)."""
        if target not in self.lines:
            raise ValueError(f"unknown model {target!r}")
        return self._plan(target, self._refused_reason(target))

    def _plan(self, target: str, refused: str | None = None) -> SwitchPlan:
        number = sum(1 for s in self.switches if s.target == target) + 1
        return plan_switch(self.conversation, self.lines[self.active], self.lines[target],
                           self.translators.get((self.active, target)), number, refused)

    def _refused_reason(self, target: str) -> str | None:
        """Why a switch to `target` made ahead from the active model fell back, if one did."""
        refused = self.refused.get(target)
        if refused is not None and refused[0].source == self.active:  # judged for this cache
            return refused[0].reason
        return None

    def _receive(self, target: str, read_fallback: bool = True,
                 refused: str | None = None) -> SwitchStatus:
        """`target` receives from the active model what it has not seen: the session plans the
        switch and carries it out (`switching`)."""
        return carry_out(self._plan(target, refused), self.conversation,
                         self.lines[self.active], self.lines[target],
                         self.translators.get((self.active, target)), read_fallback)

    def switch(self, target: str) -> SwitchStatus:
        """Make `target` the active model, giving it what it has not seen (`receive_span`). After
        `translate_ahead(target)` the status is the whole switch, made ahead and now (`joined`)."""
        if target not in self.lines:
            raise ValueError(f"unknown model {target!r}")
        self._finish_turn()
        reason = self._refused_reason(target)
        if reason is not None:
            self.keep_reread(target)  # what was re-read of it ahead is part of this switch
        self.refused.pop(target, None)
        status = self.joined(target, self._receive(target, refused=reason))
        self.active = target
        self._drop_received()
        status.recorded_bytes = sum(self.recorded_bytes().values())
        self.switches.append(status)
        return status

    def joined(self, target: str, now: SwitchStatus | None = None) -> SwitchStatus | None:
        """The switch to `target` made ahead (taken: reported once) joined with the one made
        now: the tokens of both; the outcome, gate and setting of the one that gave the most
        recent span; `translate_seconds` now's and `ahead_seconds` the earlier one's, with the
        tokens it translated in `tokens_translated_ahead`. None when nothing was made ahead
        and nothing now."""
        ahead = self.ahead.pop(target, None)
        if ahead is None:
            return now
        if now is None or not (now.tokens_translated or now.tokens_fallback or now.tokens_tail):
            return replace(ahead, translate_seconds=now.translate_seconds if now else 0.0,
                           gate_seconds=0.0, ahead_seconds=ahead.translate_seconds,
                           tokens_translated_ahead=ahead.tokens_translated)
        now.tokens_translated += ahead.tokens_translated
        now.tokens_tail += ahead.tokens_tail
        now.tokens_sink += ahead.tokens_sink
        now.tokens_fallback += ahead.tokens_fallback
        now.tokens_translated_ahead = ahead.tokens_translated
        now.ahead_seconds = ahead.translate_seconds
        return now

    def refresh(self, name: str | None = None) -> None:
        """Re-reading a model's cache line from the conversation (on request)."""
        self._finish_turn()
        line = self.lines[name or self.active]
        self.forget_ahead(line.name)
        line.reset()
        active = self.lines[self.active]
        self.read(line, self.mapped(active.name, active.seen, line.name)
                  if line.name != self.active else len(self.tokens))
        self._drop_received()
