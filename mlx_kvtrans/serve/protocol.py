"""The OpenAI wire format: request bodies, replies and stream chunks, error objects.

Bodies are pydantic models, strict where OpenAI is (content is a string or a list of text
parts, never a number); unknown fields are ignored, as clients send many. A reply is the same
for chat and text completions but for where the text goes: `ChatReply` and `TextReply` share
one interface, so the server never asks which endpoint it answers.
"""

from __future__ import annotations

import secrets
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class RequestError(Exception):
    """A request the server refuses, as an OpenAI error object with this HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# -- requests ---------------------------------------------------------------------------------
class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def for_template(self) -> dict:
        """The message as chat templates read it (text parts joined, as mlx-lm's server does)."""
        text = self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content)
        out = {"role": self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class Sampling(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: StrictStr | list[StrictStr] | None = Field(None, max_length=4)
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check(self) -> None:
        if self.n != 1:
            raise RequestError("only n=1 is supported", param="n", code="unsupported_value")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None

    def reply_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class CompletionRequest(Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    max_tokens: StrictInt | None = 16  # OpenAI's default for text completions
    echo: StrictBool = False

    def check(self) -> None:
        super().check()
        if self.echo:
            raise RequestError("echo is not supported", param="echo", code="unsupported_value")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) \
                and len(self.prompt) != 1:
            raise RequestError("one prompt per request", param="prompt",
                               code="unsupported_value")

    def reply_budget(self) -> int | None:
        return self.max_tokens


def validation_error(errors: list[dict]) -> RequestError:
    """A pydantic / FastAPI validation failure as one OpenAI error, with the body field it
    concerns as `param`. Errors sharing a field are the branches of one union (a string or a
    list of text parts): they are reported together, at that field."""
    if not errors:
        return RequestError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return RequestError(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                            .rstrip(": "), code="invalid_json")
    locs = [[str(part) for part in e.get("loc", ()) if part != "body"] for e in errors]
    n = 0
    while all(len(loc) > n for loc in locs) and len({loc[n] for loc in locs}) == 1:
        n += 1
    shared = locs[0][:n]
    branches = len(errors) > 1 and shared
    loc = shared if branches else locs[0]
    param = ".".join(loc) or None
    if first.get("type") == "missing" and not branches:
        return RequestError(f"missing required parameter: {param}", param=param,
                            code="missing_required_parameter")
    reasons = list(dict.fromkeys(e.get("msg", "invalid value") for e in
                                 (errors if branches else [first])))
    return RequestError(f"{param or 'the body'}: {' or '.join(reasons)}", param=param,
                        code="invalid_value")


# -- replies ----------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class _Reply:
    object_full: str
    object_chunk: str
    prefix: str

    def __init__(self, model: str, fingerprint: str):
        self.model, self.fingerprint = model, fingerprint
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    def usage_chunk(self, used: dict, report: dict) -> dict:
        """The stream's last chunk when the client asked for usage (OpenAI: no choices)."""
        return self._envelope(self.object_chunk, [], usage=used, kvtrans=report)


class ChatReply(_Reply):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    prefix = "chatcmpl"

    def full(self, text: str, finish: str, used: dict, report: dict) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish}
        return self._envelope(self.object_full, [choice], usage=used, kvtrans=report)

    def first_chunk(self) -> dict | None:
        return self.chunk(role=True)

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
              **extra) -> dict:
        delta = {"role": "assistant", "content": ""} if role else \
            ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return self._envelope(self.object_chunk, [choice], **extra)


class TextReply(_Reply):
    object_full = object_chunk = "text_completion"
    prefix = "cmpl"

    def full(self, text: str, finish: str, used: dict, report: dict) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._envelope(self.object_full, [choice], usage=used, kvtrans=report)

    def first_chunk(self) -> dict | None:
        return None

    def chunk(self, text: str | None = None, finish: str | None = None, **extra) -> dict:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._envelope(self.object_chunk, [choice], **extra)
