"""The chat behind `kvtrans chat`: turns, in-chat commands, and a transcript that survives.

The transcript (every user turn, every reply with the model that gave it and its time to first
token, every switch with its status) is written atomically after each event: a crash or Ctrl-C
never loses what was typed or generated.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .session import STRATEGIES, Session, SwitchStatus

COMMANDS = {
    "/switch": "move the conversation to the other model (or /switch NAME)",
    "/who": "which model is answering, what each has read and what it records per token",
    "/strategy": "switching strategy: segment, naive or refresh (/strategy NAME)",
    "/save": "save the active model's cache as an mlx-lm prompt-cache file (/save PATH)",
    "/help": "this list",
    "/quit": "leave (the transcript is already saved)",
}


@dataclass
class Transcript:
    path: Path
    models: dict[str, str]
    events: list[dict] = field(default_factory=list)

    def add(self, kind: str, **data) -> None:
        self.events.append({"kind": kind, "time": round(time.time(), 3), **data})
        self.save()

    def save(self) -> None:
        """Write atomically: a temporary file renamed over the transcript."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps({"models": self.models, "events": self.events}, indent=2)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".transcript-")
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


@dataclass
class Reply:
    model: str
    text: str
    tokens: int
    first_token_seconds: float
    seconds: float


class Chat:
    """Session + tokenizer + transcript; `say` and `command` are what a front end calls."""

    def __init__(self, session: Session, transcript: Transcript, max_tokens: int = 200,
                 system: str | None = None):
        self.session, self.transcript, self.max_tokens = session, transcript, max_tokens
        self.system = system
        self.started = False

    @property
    def tokenizer(self):
        return self.session.lines[self.session.active].lm.tokenizer

    def _turn_tokens(self, text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        if not self.started and self.system:
            messages.insert(0, {"role": "system", "content": self.system})
        self.started = True
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def say(self, text: str, on_token: Callable[[str], None] | None = None) -> Reply:
        """A user turn and the active model's streamed reply."""
        self.transcript.add("user", text=text)
        self.session.add(self._turn_tokens(text))
        tok = self.tokenizer
        detok = tok.detokenizer
        detok.reset()
        start = time.perf_counter()
        first, count = None, 0
        for token in self.session.generate(self.max_tokens, stop=set(tok.eos_token_ids)):
            if first is None:
                first = time.perf_counter() - start
            count += 1
            if token in tok.eos_token_ids:
                break
            detok.add_token(token)
            if on_token:
                on_token(detok.last_segment)
        detok.finalize()
        if on_token:
            on_token(detok.last_segment)
        newline = tok.encode("\n")  # ChatML closes a turn with "<|im_end|>\n"
        self.session.add(newline[-1:] if newline else [])
        reply = Reply(self.session.active, detok.text, count, first or 0.0,
                      time.perf_counter() - start)
        self.transcript.add("reply", **asdict(reply))
        return reply

    def switch(self, target: str | None = None) -> SwitchStatus:
        names = list(self.session.lines)
        if target is None:
            others = [n for n in names if n != self.session.active]
            target = others[0] if others else self.session.active
        status = self.session.switch(target)
        self.transcript.add("switch", **asdict(status))
        return status

    def command(self, line: str) -> str:
        """Run an in-chat command; returns what to show."""
        word, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if word == "/switch":
            s = self.switch(arg or None)
            detail = f" ({s.reason})" if s.reason else ""
            return (f"switched {s.source} -> {s.target}: {s.status}{detail}; "
                    f"{s.tokens_translated} tokens translated, {s.tokens_reprefilled} re-read, "
                    f"{s.translate_seconds * 1000:.1f} ms")
        if word == "/who":
            rows = [f"{'*' if n == self.session.active else ' '} {n}: read {l.seen} of "
                    f"{len(self.session.tokens)} tokens; records {l.bytes_per_token:,.0f} bytes "
                    f"a token, holds {l.recorded_bytes() / 1024:,.1f} KiB"
                    for n, l in self.session.lines.items()]
            return "\n".join(rows)
        if word == "/strategy":
            if arg not in STRATEGIES:
                return f"strategies: {', '.join(STRATEGIES)} (now {self.session.strategy})"
            self.session.strategy = arg
            self.transcript.add("strategy", strategy=arg)
            return f"strategy: {arg}"
        if word == "/save":
            if not arg:
                return "usage: /save PATH"
            from .prompt_cache import write_prompt_cache

            line_ = self.session.lines[self.session.active]
            if line_.cache is None:
                return "nothing to save yet"
            path = write_prompt_cache(arg, line_.cache, str(line_.lm.path))
            self.transcript.add("save", path=str(path), model=line_.name)
            return f"saved {line_.name}'s cache ({line_.seen} tokens) to {path}"
        if word == "/help":
            return "\n".join(f"{k:10s} {v}" for k, v in COMMANDS.items())
        return f"unknown command {word}; /help lists them"
