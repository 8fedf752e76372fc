"""What the server's compute thread and its HTTP side tell each other: a validated request
(`Generation`), the events of its answer (`Started`, `Text`, `Finished`, `Failed`), what happened to
its history (`Switch`), and OpenAI's `stop` sequences (`StopText`)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ..session import Outcome, SwitchStatus
from ..session.status import Word
from .protocol import RequestError
from .store import Entry


# -- what a response reports ------------------------------------------------------------------
class HistoryStatus(Word):
    """What happened to a request's history."""

    APPLIED = Outcome.APPLIED.value  # another model's cache, translated
    FALLBACK = Outcome.FALLBACK.value  # another model's, re-read: see the switch's reason
    REUSED = "reused"  # this model's own cache
    NONE = "none"  # nothing cached


@dataclass
class RequestHistory:
    """What happened to a request's history, and what it cost: where another model held it, the
    session's record of the switch (`switch`, the one record a session, the chat and the server
    write); the request's own tokens and times beside it. Times in seconds."""

    status: HistoryStatus = HistoryStatus.NONE
    switch: SwitchStatus | None = None
    tokens_reused: int = 0
    tokens_new: int = 0  # prompt tokens no cache held
    queue_seconds: float = 0.0
    load_seconds: float = 0.0  # loading the weights of a model that was not resident
    ttft_seconds: float = 0.0  # from the request's arrival to its first token
    conversation: str = ""

    def __post_init__(self):
        self.status = HistoryStatus(self.status)  # a word, too

    @property
    def tokens_translated(self) -> int:
        return self.switch.tokens_translated if self.switch else 0

    @property
    def tokens_reread(self) -> int:
        return self.switch.tokens_reread if self.switch else 0

    def fields(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "switch"}
        for key in ("queue_seconds", "load_seconds", "ttft_seconds"):
            out[key] = round(out[key], 6)
        return {**out, "switch": self.switch.to_json() if self.switch else None}

    def headers(self) -> dict[str, str]:
        s = self.switch or SwitchStatus("", "")
        out = {"x-kvtrans-history": self.status.value,
               "x-kvtrans-tokens-reused": str(self.tokens_reused),
               "x-kvtrans-tokens-translated": str(s.tokens_translated),
               "x-kvtrans-tokens-reread": str(s.tokens_reread),
               "x-kvtrans-tokens-new": str(self.tokens_new),
               "x-kvtrans-tokens-translated-ahead": str(s.tokens_translated_ahead),
               "x-kvtrans-translate-seconds": f"{s.translate_seconds:.6f}",
               "x-kvtrans-ttft-seconds": f"{self.ttft_seconds:.6f}",
               "x-kvtrans-load-seconds": f"{self.load_seconds:.6f}",
               "x-kvtrans-conversation": self.conversation}
        if self.switch:
            out["x-kvtrans-source-model"] = s.source
        if self.status == HistoryStatus.APPLIED:
            out["x-kvtrans-reread"] = str(s.reread)
            if s.expected_agreement is not None:
                out["x-kvtrans-expected-agreement"] = f"{s.expected_agreement:.3f}"
        if s.gate:
            out["x-kvtrans-gate"] = s.gate.value
        if s.gate_gap is not None:
            out["x-kvtrans-gate-gap"] = f"{s.gate_gap:.4f}"
        if s.copy_gap is not None:
            out["x-kvtrans-copy-gap"] = f"{s.copy_gap:.4f}"
        if s.reason:  # header values are one line of latin-1
            out["x-kvtrans-reason"] = " ".join(s.reason.split()).encode(
                "latin-1", "replace").decode("latin-1")
        return out


# -- events the worker sends the HTTP side ----------------------------------------------------
@dataclass
class Started:
    history: RequestHistory  # known once the first token is out


@dataclass
class Text:
    text: str


@dataclass
class Finished:
    reason: str  # stop, length, cancelled
    prompt_tokens: int
    completion_tokens: int
    history: RequestHistory
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
            out = self.pending[:min(hits)]
            self.pending = ""
            self.stopped = True
            return out
        held = 0 if final else max((k for s in self.stops for k in range(1, len(s))
                                    if self.pending.endswith(s[:k])), default=0)
        out = self.pending[:len(self.pending) - held]
        self.pending = self.pending[len(out):]
        return out
