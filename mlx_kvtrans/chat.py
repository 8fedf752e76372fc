"""The chat behind `kvtrans chat`: turns, in-chat commands, and a transcript that survives.

The transcript (every user turn, every reply with the model that gave it and its time to first
token, every switch with its status) is written atomically after each event: a crash or Ctrl-C
never loses what was typed or generated.

The conversation is what the chat template renders for its messages, token for token: a user turn
adds what the template adds for it (with the assistant's opening), and a reply is closed as the
template closes it, whether it ended on a stop token, at `max_tokens` or at Ctrl-C. Ctrl-C during
a reply stops it at the next token: what it had said stays, in the conversation and in the
transcript, marked interrupted.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from .errors import KvtransError
from .files import write_private
from .session import STRATEGIES, Session, SwitchStatus

COMMANDS = {
    "/switch": "move the conversation to the other model (or /switch NAME)",
    "/who": "which model is answering, what each has read and what it records per token",
    "/strategy": "switching strategy: segment, naive or refresh (/strategy NAME)",
    "/save": "save the conversation as the active model's mlx-lm prompt-cache file (/save PATH, "
             "a .safetensors file or a folder to hold conversation.safetensors; /save --force PATH "
             "replaces a file)",
    "/help": "this list (or /help COMMAND)",
    "/quit": "leave (the transcript is already saved)",
}
def counted(n: int, word: str) -> str:
    """"1 token", "2 tokens"."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


SAVED_NAME = "conversation.safetensors"  # what /save writes into a folder it is given
PLACEHOLDER = "YOUR MESSAGE"  # where the user's text goes in the printed mlx-lm command


@contextlib.contextmanager
def interrupts_held(second_raises: bool = False) -> Iterator[list[int]]:
    """Within the block Ctrl-C (SIGINT) is noted in the list yielded instead of raised, so that
    the code in it can stop where the session is consistent. With `second_raises`, a second
    press raises KeyboardInterrupt as usual (a way out of a long prefill). Outside the main
    thread, where Python cannot catch signals, nothing is held."""
    pressed: list[int] = []

    def note(signum, frame):
        if second_raises and pressed:
            raise KeyboardInterrupt
        pressed.append(signum)

    try:
        previous = signal.signal(signal.SIGINT, note)
    except ValueError:  # not the main thread
        yield pressed
        return
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None
                      else signal.default_int_handler)


@dataclass
class Transcript:
    path: Path
    models: dict[str, str]
    events: list[dict] = field(default_factory=list)
    translators: dict[str, str] = field(default_factory=dict)  # "a -> b": what switching uses

    def add(self, kind: str, **data) -> None:
        self.events.append({"kind": kind, "time": round(time.time(), 3), **data})
        self.save()

    def save(self) -> None:
        """Write atomically and readable by its owner only (it is the conversation). Its
        directory must exist: as for /save, a mistyped one is not created."""
        write_private(self.path, json.dumps({"models": self.models,
                                             "translators": self.translators,
                                             "events": self.events}, indent=2))


@dataclass
class Reply:
    model: str
    text: str
    tokens: int
    first_token_seconds: float
    seconds: float
    interrupted: bool = False  # stopped by Ctrl-C; `text` is what it had said


@dataclass
class Saved:
    """A prompt-cache file written by /save, and the mlx-lm command that continues from it."""
    path: Path
    model: str
    tokens: int
    command: list[str]


def dial_summary(s: SwitchStatus) -> str:
    """The fidelity dial's setting of an applied switch and what its frontier expects."""
    if s.status != "applied" or not (s.tokens_translated or s.tokens_tail):
        return ""
    expect = []
    if s.expected_agreement is not None:
        expect.append(f"held-out agreement {s.expected_agreement:.2f}")
    if s.expected_speedup is not None:
        expect.append(f"x{s.expected_speedup:.1f} over re-reading")
    how = "; ".join(x for x in (s.setting_note, ", ".join(expect)) if x)
    return f"; R={s.reread}" + (f" ({how})" if how else "")


def gate_summary(s: SwitchStatus) -> str:
    """The fidelity gate's verdict on a switch, for a person (empty when it had none)."""
    if not s.gate:
        return ""
    gap = f"gap {s.gate_gap:+.2f} nats/token" if s.gate_gap is not None else ""
    if s.gate_threshold is not None:
        gap += f", threshold {s.gate_threshold:.2f}"
    copied = (f"copy gap {s.copy_gap:+.2f}, threshold {s.copy_threshold:.2f}"
              if s.copy_gap is not None else "")
    why = "; ".join(x for x in (gap, copied, s.gate_note) if x)
    return f"; gate {s.gate}" + (f" ({why})" if why else "")


class Chat:
    """Session + tokenizer + transcript; `say` and `command` are what a front end calls. Bad
    input (an empty turn, an unknown command, model or strategy) raises KvtransError and leaves
    the chat as it was."""

    def __init__(self, session: Session, transcript: Transcript, max_tokens: int = 200,
                 system: str | None = None, translate_ahead: bool = False):
        self.session = session
        self.transcript = transcript
        self.max_tokens = max_tokens
        self.system = system
        self.ahead_after_replies = translate_ahead  # see `translate_ahead`
        self.messages: list[dict] = []  # what the conversation holds, as chat messages

    @property
    def tokenizer(self):
        return self.session.lines[self.session.active].lm.tokenizer

    # -- the template ---------------------------------------------------------------------------
    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _new_messages(self, text: str) -> list[dict]:
        """The messages a user turn `text` adds: the system prompt goes with the first."""
        turn = [{"role": "user", "content": text}]
        return [{"role": "system", "content": self.system}] + turn \
            if self.system and not self.messages else turn

    def _opening(self, text: str) -> str:
        """What the template adds to the conversation for a user turn `text`, up to where the
        assistant starts to write."""
        new = self._new_messages(text)
        before = self._render(self.messages, False)
        after = self._render(self.messages + new, True)
        if after.startswith(before):
            return after[len(before):]
        # a template that renders earlier turns differently once more follow: the turn alone
        return self._render(new, True)

    def _closing(self) -> str:
        """What the template writes after an assistant message ("<|im_end|>\\n" in ChatML)."""
        mark = "\x00reply\x00"
        text = self._render([{"role": "user", "content": "?"},
                             {"role": "assistant", "content": mark}], False)
        return text[text.rindex(mark) + len(mark):] if mark in text else ""

    # -- turns ------------------------------------------------------------------------------------
    def say(self, text: str, on_token: Callable[[str], None] | None = None) -> Reply:
        """A user turn and the active model's streamed reply.

        Ctrl-C while it generates, or a KeyboardInterrupt raised by `on_token`, stops the reply
        where the session is consistent (a second Ctrl-C stops at once, and the model re-reads
        the conversation next turn); the reply returned is marked interrupted. Ctrl-C once the
        reply is whole (the turn closing, translating ahead) waits for that to finish, then
        raises KeyboardInterrupt, as a press between turns does."""
        if not text.strip():
            raise KvtransError("an empty line is not a turn")
        opening = self._opening(text)
        self.session.add(self._encode(opening))  # first: an id it refuses leaves no turn behind
        self.transcript.add("user", text=text)
        self.messages += self._new_messages(text)
        tok, model = self.tokenizer, self.session.active
        stops = set(tok.eos_token_ids)
        reply_from = len(self.session.tokens)
        detok = tok.detokenizer
        detok.reset()
        start = time.perf_counter()
        first = None
        interrupted = False
        turn = None
        with interrupts_held(second_raises=True) as pressed:
            try:
                turn = self.session.generate(self.max_tokens, stop=stops)
                for token in turn:
                    if first is None:
                        first = time.perf_counter() - start
                    if token in stops:
                        break
                    detok.add_token(token)
                    if on_token:
                        on_token(detok.last_segment)
                    if pressed:
                        interrupted = True
                        break
            except KeyboardInterrupt:
                interrupted = True
        # closing the turn records what was read, and translates ahead: not to be cut short
        with interrupts_held() as late:
            if turn is not None:
                turn.close()
            seconds = time.perf_counter() - start
            detok.finalize()
            if on_token and detok.last_segment:
                on_token(detok.last_segment)
            generated = self.session.tokens[reply_from:]
            stopped = bool(generated) and generated[-1] in stops
            said = generated[:-1] if stopped else generated
            reply = Reply(model, tok.decode(said), len(generated), first or 0.0, seconds,
                          interrupted)
            closing = self._encode(self._closing())
            if stopped and closing[:1] == generated[-1:]:
                closing = closing[1:]  # the model wrote the template's closing token itself
            self.session.add(closing)
            self.messages.append({"role": "assistant", "content": reply.text})
            self.transcript.add("reply", **asdict(reply))
            if self.ahead_after_replies and not interrupted:
                self.translate_ahead()
        if (late or pressed) and not interrupted:  # Ctrl-C once the reply was whole
            raise KeyboardInterrupt
        return reply

    def translate_ahead(self) -> list[SwitchStatus]:
        """Translate ahead (`Session.translate_ahead`): give every other model a translator
        reaches what the active model has read, while the user reads the reply, so a /switch
        has only the last turn's few tokens left to give. A translation the gate refuses is not re-read
        ahead: the prompt comes back at once, and only a /switch pays for the re-read."""
        active = self.session.active
        done = [self.session.translate_ahead(t, read_fallback=False) for t in self.session.lines
                if t != active and (active, t) in self.session.translators]
        for status in done:
            self.transcript.add("ahead", **status.to_json())
        return done

    # -- commands ---------------------------------------------------------------------------------
    def switch(self, target: str | None = None) -> SwitchStatus:
        names = list(self.session.lines)
        if target is None:
            others = [n for n in names if n != self.session.active]
            target = others[0] if others else self.session.active
        if target not in self.session.lines:
            raise KvtransError(f"unknown model {target!r}: this chat has {', '.join(names)}")
        status = self.session.switch(target)
        self.transcript.add("switch", **status.to_json())
        return status

    def set_strategy(self, name: str) -> None:
        if name not in STRATEGIES:
            raise KvtransError(f"unknown strategy {name!r}: the strategies are "
                               f"{', '.join(STRATEGIES)} (now {self.session.strategy})")
        self.session.set_strategy(name)
        self.transcript.add("strategy", strategy=name)

    def save(self, path: str | Path, force: bool = False) -> Saved:
        """The whole conversation, read by the active model, as an mlx-lm prompt-cache file
        (an existing file only with `force`)."""
        from .prompt_cache import write_prompt_cache

        given = path
        path = Path(path).expanduser()
        if path.is_dir():  # a folder to save into
            path = path / SAVED_NAME
        elif path.suffix and path.suffix != ".safetensors":
            raise KvtransError(f"/save {given}: a prompt-cache file's name ends in .safetensors "
                               f"(/save {path.with_suffix('.safetensors')})")
        elif not path.suffix:  # mlx adds it anyway; say where the file really is
            path = path.with_name(path.name + ".safetensors")
        if path.is_dir():
            raise KvtransError(f"/save {given}: {path} is a directory")
        if not path.parent.is_dir():
            raise KvtransError(f"/save {given}: no directory {path.parent}")
        if path.exists() and not force:
            raise KvtransError(f"/save {given}: {path} already exists (/save --force {given} "
                               "replaces it)")
        if not self.session.tokens:
            raise KvtransError("nothing to save yet: the conversation is empty")
        line = self.session.lines[self.session.active]
        if line.seen < len(self.session.tokens):
            # A turn leaves its last tokens (the reply's closing) for the next turn to read;
            # generating no tokens reads them now, so the file holds the whole conversation.
            for _ in self.session.generate(max_tokens=0):
                pass
        # mlx-lm compares --model with this string and loads it from any directory: an
        # absolute path
        model = str(Path(line.lm.path).resolve())
        path = path.resolve()
        try:
            path = write_prompt_cache(path, line.cache, model)
        except (OSError, RuntimeError) as e:  # mlx reports an unwritable file as RuntimeError
            raise KvtransError(f"/save {given}: cannot write {path} ({e})") from None
        saved = Saved(path, line.name, line.seen, self.continue_command(path))
        self.transcript.add("save", path=str(path), model=line.name, tokens=line.seen)
        return saved

    def continue_command(self, path: Path, message: str = PLACEHOLDER) -> list[str]:
        """The `mlx_lm.generate` command line that continues a saved conversation with a user
        turn `message`. mlx-lm's own chat-template path assumes a cache that stops inside a
        user message (as `mlx_lm.cache_prompt` leaves it); this one is closed, so the prompt is
        the template's next turn, given raw. mlx-lm turns a written "\\n" into a newline."""
        prompt = self._opening(message).replace("\n", "\\n").replace("\t", "\\t")
        return ["mlx_lm.generate", "--prompt-cache-file", str(path), "--ignore-chat-template",
                "--prompt", prompt]

    def command(self, line: str) -> str:
        """Run an in-chat command; returns what to show."""
        word, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if word == "/switch":
            if arg == self.session.active:
                return f"already talking to {arg}"
            s = self.switch(arg or None)
            detail = f" ({s.reason})" if s.reason else ""
            own = ([f"the first {s.tokens_sink}"] if s.tokens_sink else []) + (
                [f"the last {s.tokens_tail}"] if s.tokens_tail else [])
            read = f", {' and '.join(own)} read by {s.target}" if own else ""
            if s.layers_recomputed:
                read += f", its first {counted(s.layers_recomputed, 'layer')} on the span too"
            if s.layers_relayed:
                read += f", {counted(s.layers_relayed, 'layer')} relayed"
            ahead = (f" ({s.tokens_translated_ahead} of them ahead, "
                     f"{s.ahead_seconds * 1000:.1f} ms)" if s.tokens_translated_ahead else "")
            fallback = (f", {counted(s.tokens_fallback, 'token')} re-read in its place"
                        if s.tokens_fallback else "")
            return (f"switched {s.source} -> {s.target}: {s.status}{detail}; "
                    f"{counted(s.tokens_translated, 'token')} translated{ahead}{read}"
                    f"{fallback}, {s.translate_seconds * 1000:.1f} ms"
                    f"{dial_summary(s)}{gate_summary(s)}")
        if word == "/who":
            if arg:
                raise KvtransError("/who takes no argument")
            rows = [f"{'*' if n == self.session.active else ' '} {n}: read {l.seen} of "
                    f"{counted(len(self.session.view(n)), 'token')}; records {l.bytes_per_token:,.0f} bytes "
                    f"a token, holds {l.recorded_bytes() / 1024:,.1f} KiB"
                    for n, l in self.session.lines.items()]
            return "\n".join(rows)
        if word == "/strategy":
            if not arg:
                return f"strategy: {self.session.strategy} (of {', '.join(STRATEGIES)})"
            self.set_strategy(arg)
            return f"strategy: {arg}"
        if word == "/save":
            force = arg == "--force" or arg.startswith("--force ")
            arg = arg.removeprefix("--force").strip() if force else arg
            if not arg:
                raise KvtransError("usage: /save [--force] PATH (an mlx-lm prompt-cache file)")
            import shlex

            saved = self.save(arg, force)
            return (f"saved {saved.model}'s cache of the whole conversation ({saved.tokens} "
                    f"tokens) to {saved.path}\ncontinue it in mlx-lm (put your text for "
                    f"{PLACEHOLDER}):\n  {shlex.join(saved.command)}")
        if word == "/help":
            if arg:
                name = arg if arg.startswith("/") else "/" + arg
                if name not in COMMANDS:
                    raise KvtransError(f"no command {name}; /help lists them")
                return f"{name:10s} {COMMANDS[name]}"
            return "\n".join(f"{k:10s} {v}" for k, v in COMMANDS.items())
        raise KvtransError(f"unknown command {word}; /help lists them")
