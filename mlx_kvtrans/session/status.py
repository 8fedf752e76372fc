"""What a switch reports: the record the chat, the benchmark, the server and the tests all read.

The enums are `str`-valued: a status compares equal to its word and is written to JSON as it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum


class Word(str, Enum):
    """A str-valued enum (Python 3.10's stand-in for 3.11's StrEnum): equal to its word,
    printed and written to JSON as it."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class Outcome(Word):
    """How the target came to hold the span it had not seen."""

    APPLIED = "applied"  # translated (or nothing to give)
    FALLBACK = "fallback"  # the target re-read it; `reason` says why


class Verdict(Word):
    """The fidelity gate's verdict on a translated span."""

    NONE = ""  # nothing translated
    PASSED = "passed"
    FIRED = "fired"  # over the threshold: the target re-read the span instead
    UNCALIBRATED = "uncalibrated"  # the translator has no threshold for this span
    UNCHECKED = "unchecked"  # the gate could not judge (`gate_note` says why)
    OFF = "off"  # gate_tokens 0


@dataclass
class SwitchStatus:
    source: str
    target: str
    status: Outcome = Outcome.APPLIED
    reason: str = ""
    strategy: str = "segment"
    tokens_translated: int = 0
    tokens_fallback: int = 0  # the span, re-read by the target when the switch fell back
    translate_seconds: float = 0.0  # the whole switch: translation, read tail, gate, fallback
    recorded_bytes: int = 0  # per-token objects every model holds after the switch
    tokens_tail: int = 0  # the span's last tokens, read by the target on the translated cache
    tokens_sink: int = 0  # the conversation's first tokens, read by the target before it
    layers_recomputed: int = 0  # the target's first layers that read the translated span
    layers_relayed: int = 0  # its layers that read it again from the source's hidden state
    gate: Verdict = Verdict.NONE
    gate_note: str = ""  # why the gate did not judge (uncalibrated, unchecked)
    gate_gap: float | None = None  # nats/token: target's mean NLL on the tail - the source's
    gate_threshold: float | None = None
    gate_tokens: int = 0  # tokens the gap is taken over
    gate_agreement: float | None = None  # share of them both models predict alike (argmax)
    gate_seconds: float = 0.0  # the read tail, the comparison and the copy probe
    copy_gap: float | None = None  # nats/token: target's NLL of the history's repeats - source's
    copy_threshold: float | None = None
    copy_tokens: int = 0  # repeated tokens the copy gap is taken over
    reread: int = 0  # the fidelity dial's setting R (`tokens_tail` is what was read)
    expected_agreement: float | None = None  # R's held-out agreement, from the frontier
    expected_speedup: float | None = None  # R's measured speed-up over re-reading
    setting_note: str = ""  # how R was chosen
    translator_note: str = ""  # a model is a quantization of the one the translator was fitted on
    tokens_translated_ahead: int = 0  # of tokens_translated, those translated ahead
    ahead_seconds: float = 0.0  # what the switch made ahead took, before the switch

    def __post_init__(self):
        self.status, self.gate = Outcome(self.status), Verdict(self.gate)  # words, too

    @property
    def tokens_reread(self) -> int:
        """Every token the target read itself at this switch: the sink, the tail and a
        fallback's span."""
        return self.tokens_sink + self.tokens_tail + self.tokens_fallback

    def to_json(self) -> dict:
        """The record as JSON: the session's, the chat's and the server's one form."""
        out = {**asdict(self), "tokens_reread": self.tokens_reread}
        for key in ("translate_seconds", "gate_seconds", "ahead_seconds"):
            out[key] = round(out[key], 6)
        return out
