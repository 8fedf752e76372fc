"""What the server's compute thread and its HTTP side tell each other: a validated request
(`Generation`), the events of its answer (`Started`, `Text`, `Finished`, `Failed`), what happened to
its history (`Handoff`), and OpenAI's `stop` sequences (`StopText`)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ..session import Outcome
from ..session.status import Verdict, Word
from .protocol import RequestError
from .store import Entry


# -- what a response reports ------------------------------------------------------------------
class HandoffStatus(Word):
    """What happened to a request's history."""

    APPLIED = Outcome.APPLIED.value  # another model's cache, translated
    FALLBACK_REPREFILL = Outcome.FALLBACK_REPREFILL.value  # another model's, re-read: see reason
    REUSED = "reused"  # this model's own cache
    NONE = "none"  # nothing cached


@dataclass
class Handoff:
    """What happened to a request's history (`HandoffStatus`), and what it cost."""

    status: HandoffStatus = HandoffStatus.NONE
    reason: str = ""
    source_model: str | None = None
    tokens_reused: int = 0
    tokens_translated: int = 0
    tokens_reread: int = 0
    tokens_new: int = 0  # prompt tokens no cache held
    tokens_translated_ahead: int = 0  # translated between turns, before this request
    translate_ms: float = 0.0  # the switch: translation and gate, or the fallback's re-read
    ahead_ms: float = 0.0  # what translating ahead took, between turns
    load_ms: float = 0.0  # loading the weights of a model that was not resident
    gate: Verdict = Verdict.NONE  # the fidelity gate's verdict
    gate_gap: float | None = None  # nats/token over the tail the target read itself
    gate_threshold: float | None = None
    reread: int = 0  # the fidelity dial's R (session/dial.py) and what its frontier expects
    expected_agreement: float | None = None
    queue_ms: float = 0.0
    ttft_ms: float = 0.0  # from the request's arrival to its first token
    conversation: str = ""

    def __post_init__(self):
        self.status, self.gate = HandoffStatus(self.status), Verdict(self.gate)  # words, too

    def fields(self) -> dict:
        out = asdict(self)
        for key in ("translate_ms", "ahead_ms", "load_ms", "queue_ms", "ttft_ms"):
            out[key] = round(out[key], 3)
        return out

    def headers(self) -> dict[str, str]:
        out = {"x-kvtrans-handoff": self.status.value,
               "x-kvtrans-tokens-reused": str(self.tokens_reused),
               "x-kvtrans-tokens-translated": str(self.tokens_translated),
               "x-kvtrans-tokens-reread": str(self.tokens_reread),
               "x-kvtrans-tokens-new": str(self.tokens_new),
               "x-kvtrans-tokens-translated-ahead": str(self.tokens_translated_ahead),
               "x-kvtrans-translate-ms": f"{self.translate_ms:.3f}",
               "x-kvtrans-ttft-ms": f"{self.ttft_ms:.3f}",
               "x-kvtrans-load-ms": f"{self.load_ms:.3f}",
               "x-kvtrans-conversation": self.conversation}
        if self.source_model:
            out["x-kvtrans-source-model"] = self.source_model
        if self.status == HandoffStatus.APPLIED:
            out["x-kvtrans-reread"] = str(self.reread)
        if self.expected_agreement is not None:
            out["x-kvtrans-expected-agreement"] = f"{self.expected_agreement:.3f}"
        if self.gate:
            out["x-kvtrans-gate"] = self.gate.value
        if self.gate_gap is not None:
            out["x-kvtrans-gate-gap"] = f"{self.gate_gap:.4f}"
        if self.reason:  # header values are one line of latin-1
            out["x-kvtrans-reason"] = " ".join(self.reason.split()).encode(
                "latin-1", "replace").decode("latin-1")
        return out


# -- events the worker sends the HTTP side ----------------------------------------------------
@dataclass
class Started:
    handoff: Handoff  # known once the first token is out


@dataclass
class Text:
    text: str


@dataclass
class Finished:
    reason: str  # stop, length, cancelled
    prompt_tokens: int
    completion_tokens: int
    handoff: Handoff
    entry: Entry | None = field(default=None, repr=False)  # the conversation, back in the store


@dataclass
class Failed:
    error: BaseException


@dataclass
class Generation:
    """One request's compute, validated."""

    model: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    conversation: str | None = None
    boundaries: list[int] = field(default_factory=list)  # where the prompt's messages begin
    next_model: str | None = None  # the model the conversation goes to next, if known
    arrived: float = field(default_factory=time.perf_counter)

    @classmethod
    def checked(cls, model: str, prompt: list[int], max_tokens: int | None, context: int,
                default_max_tokens: int, served: list[str], **options) -> "Generation":
        """A validated request: a non-empty prompt, 1 <= max_tokens (default: what the
        context leaves, up to `default_max_tokens`), both within the model's `context`, and a
        next model among the `served` ones."""
        if not prompt:
            raise RequestError("the prompt is empty", param="prompt")
        if len(prompt) >= context:
            raise RequestError(f"this model's maximum context length is {context} tokens; the "
                               f"prompt has {len(prompt)}", param="messages",
                               code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max_tokens, context - len(prompt))
        if max_tokens < 1:
            raise RequestError(f"max_tokens is {max_tokens}; it must be at least 1",
                               param="max_tokens", code="invalid_value")
        if max_tokens > context:
            raise RequestError(f"max_tokens is {max_tokens}, more than {model}'s whole context "
                               f"of {context} tokens", param="max_tokens", code="invalid_value")
        if len(prompt) + max_tokens > context:
            raise RequestError(f"this model's maximum context length is {context} tokens; the "
                               f"request needs {len(prompt) + max_tokens} ({len(prompt)} in the "
                               f"prompt, {max_tokens} to generate)", param="max_tokens",
                               code="context_length_exceeded")
        following = options.get("next_model")
        if following is not None and following not in served:
            raise RequestError(f"x-kvtrans-next-model: the model {following!r} is not served "
                               f"here (served: {', '.join(served)})",
                               param="x-kvtrans-next-model", code="model_not_found")
        return cls(model, list(prompt), max_tokens,
                   **{k: v for k, v in options.items() if v is not None})


class StopText:
    """OpenAI's `stop`: the reply ends before the first stop sequence, and text that could be
    the start of one is held back until it is known not to be."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending, self.stopped = "", False

    def feed(self, piece: str, final: bool = False) -> str:
        """The text that can go out now."""
        self.pending += piece
        hits = [i for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        held = 0 if final else max((k for s in self.stops for k in range(1, len(s))
                                    if self.pending.endswith(s[:k])), default=0)
        out = self.pending[:len(self.pending) - held]
        self.pending = self.pending[len(out):]
        return out
