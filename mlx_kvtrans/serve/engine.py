"""The model side of `kvtrans serve`: resident models, the translators between them, the
conversation store, and one worker thread that runs every request's compute.

MLX work stays on that one thread (one stream, no two forwards at once); the HTTP side only
renders prompts and waits for events. A request's compute: take the entry holding the longest
prefix of its prompt (`store`), hand it to the requested model when another model holds more
(`Session.switch`, which runs `session.receive_span`: segment-wise translation, or a visible
re-read), read the rest of the prompt but its last token in parts (a hybrid takes checkpoints),
put the entry back, then decode in the model's batch with every other request decoding on it
(`batching`), streaming text events. Reading parts and decoding steps take turns on the worker.
After a reply the model reads it into the entry (while other requests are busy, in idle time:
a follow-up that comes first reads it with its own turn), then idle time translates ahead.
A fault fails that request only: its entry is not put back, every other stays as it was.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import mlx.core as mx

from ..errors import KvtransError
from ..models import vocabulary_rows
from ..session import Outcome, Session, SwitchStatus
from ..translators.alignment import conversation_groups, tokenizer_groups
from .config import ServeConfig, context_length, find_translators, load_models
from .batching import Batches, Decoding
from .compute import ComputeThread
from .lockstep import Lockstep
from .metrics import Metrics
from .residency import Residency
from .protocol import RequestError
from .records import Failed, Finished, Generation, RequestHistory, HistoryStatus
from .store import ConversationStore, Entry, Match, trimmable


SNAPSHOT_EVERY = 1024  # tokens of a long read between a hybrid's snapshots
READ_PART = 512  # tokens of a prompt read between two decoding steps
# a re-read in idle time goes in parts of about this long (a request that comes waits for one):
# a part of READ_PART tokens deep in a long conversation takes most of a second
IDLE_PART_SECONDS = 0.25
FIRST_IDLE_PART = 128  # tokens, until a part has measured the pace
SMALLEST_IDLE_PART = 16  # tokens: below, a part's fixed cost outweighs its reading


class Engine:
    """Models, translators, the conversation store and the worker thread.

    `models`: name -> LoadedModel; `translators`: (source, target) -> Translator (all of them;
    with `config.translate` off, none is used and every switch re-reads)."""

    def __init__(self, models: dict, translators: dict, config: ServeConfig | None = None,
                 notes: list[str] | None = None, lockstep: Lockstep | None = None):
        from mlx_lm.models.cache import make_prompt_cache

        self.config = config or ServeConfig(models=list(models))
        self.models = models
        self.translators = {pair: tr.prepare() for pair, tr in translators.items()}
        self._lockstep = lockstep
        budget = self.config.memory_budget
        if lockstep is not None:  # in step, every model stays resident: no process unloads alone
            budget = None
        elif budget is None:  # what the machine holds, less the conversation caches' budget
            from ..backend.blas import machine_memory

            budget = max(machine_memory() - self.config.cache_bytes, 1)
        # the models that fit read their weights now, the others on their first request
        self.residency = Residency(models, budget, self.config.idle_unload)
        # MLX streams belong to threads: a lazy array left by loading here could not be
        # evaluated on the worker
        mx.eval([tr.params for tr in self.translators.values()],
                [tr.identity.codebook for tr in self.translators.values()
                 if tr.identity.codebook is not None])
        self.notes = list(notes or [])
        self.tokenizers = tokenizer_groups(models)
        self.groups = conversation_groups(models, self.translators if self.config.translate
                                          else {}, self.tokenizers)
        self.context = {name: context_length(lm) for name, lm in models.items()}
        self.trimmable = {name: trimmable(make_prompt_cache(lm.model))
                          for name, lm in models.items()}
        self.metrics = Metrics()
        self.store = ConversationStore(self._new_session, self.groups, self.config.cache_bytes,
                                       None if lockstep is None else lockstep.mean)
        # HF tokenizers may refuse concurrent use from two threads ("Already borrowed"): the
        # HTTP side renders prompts while the worker detokenises
        self._tokenizer_locks = {name: threading.Lock() for name in models}
        self._worker = ComputeThread(named={"generate": self._generate_in_step,
                                            "load": self.residency.ensure},
                                     lockstep=lockstep)
        if self.config.idle_unload:
            self._worker.every(min(1.0, self.config.idle_unload / 2), self.residency.unload_idle)
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        self.batches = Batches()
        self._stepping = False  # a decoding step is queued

    @classmethod
    def from_config(cls, config: ServeConfig) -> "Engine":
        """The engine `config` describes. With `config.shard`, under `mlx.launch`: the models
        sharded across its processes, whose engines run in step (`lockstep.py`); process 0
        answers HTTP, the others `follow`."""
        config.check()
        lockstep = group = None
        if config.shard:
            group = mx.distributed.init()
            if group.size() < 2:
                raise KvtransError(f"--shard {config.shard}: run under mlx.launch with 2 or "
                                   f"more processes (this is 1)")
            lockstep = Lockstep(group)
        models = load_models(config.models, config.shard, group)
        translators, notes = find_translators(models, config.translators)
        return cls(models, translators, config, notes, lockstep)

    @property
    def broken(self) -> str | None:
        """Sharded: why the group can no longer compute (a process is gone); else None."""
        return self._worker.broken

    def follow(self) -> str | None:
        """On a sharded process other than 0: run process 0's jobs in step until it closes;
        returns why the group broke instead, if it did (a process is gone)."""
        self._worker.wait_ended()
        return self.broken

    def _new_session(self, model: str) -> Session:
        group = self.groups[model]
        names = [n for n in self.models if self.groups[n] == group]
        used = {pair: tr for pair, tr in self.translators.items()
                if pair[0] in names and pair[1] in names} if self.config.translate else {}
        return Session({n: self.models[n] for n in names}, used, active=model,
                       reread=self.config.reread, fidelity=self.config.fidelity,
                       sink=self.config.sink, groups=self.tokenizers,
                       recompute=self.config.recompute)

    def waits_for_load(self, model: str) -> bool:
        """Whether a request for `model` now would wait for its weights to be read."""
        return not self.residency.is_resident(model)

    def load_soon(self, model: str) -> float:
        """Queue the loading of `model` (a request gave up waiting for it); returns the seconds
        it should take from its start."""
        self._worker.share("load", model)
        return self.residency.expected_load_seconds(model)

    def close(self) -> None:
        """Finish the queued requests, then stop the worker."""
        self._worker.close()

    def settle(self) -> None:
        """Wait until the queued requests and the idle work after them (translating ahead)
        are done."""
        self._worker.settle()

    @property
    def queue_depth(self) -> int:
        return self._waiting

    # -- the HTTP side: prompts and validation ------------------------------------------------
    def check_model(self, model: str) -> None:
        if model not in self.models:
            raise RequestError(f"the model {model!r} is not served here (served: "
                               f"{', '.join(self.models)})", status=404, param="model",
                               code="model_not_found")

    def chat_prompt(self, model: str, messages: list[dict]) -> list[int]:
        """The prompt tokens of `messages`, through the model's own chat template (as mlx-lm's
        server renders them), ending with the assistant's generation prompt."""
        self.check_model(model)
        tok = self.models[model].tokenizer
        with self._tokenizer_locks[model]:
            try:
                if tok.has_chat_template:
                    return list(tok.apply_chat_template(messages, add_generation_prompt=True))
                # mlx-lm's fallback for a tokenizer without a template
                text = "".join(f"{m['role'].upper()}: {m['content']}\n" for m in messages)
                return list(tok.encode(text + "ASSISTANT: "))
            except Exception as e:  # a template that rejects the conversation (roles, order)
                raise RequestError(f"the chat template of {model} rejects these messages: {e}",
                                   param="messages") from None

    def last_message_start(self, model: str, messages: list[dict], prompt: list[int]) -> list[int]:
        """Where the last message begins in `prompt` (the earlier messages rendered alone),
        where that rendering is a prefix of the prompt: a hybrid keeps a snapshot there, so an
        edited last turn re-reads only itself."""
        tok = self.models[model].tokenizer
        if len(messages) < 2 or not tok.has_chat_template:
            return []
        with self._tokenizer_locks[model]:
            try:
                earlier = list(tok.apply_chat_template(messages[:-1],
                                                       add_generation_prompt=False))
            except Exception:  # a template that wants the conversation to end otherwise
                return []
        return [len(earlier)] if 0 < len(earlier) < len(prompt) \
            and prompt[:len(earlier)] == earlier else []

    def text_prompt(self, model: str, prompt: str | list) -> list[int]:
        self.check_model(model)
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            lm = self.models[model]
            vocab = min(len(lm.tokenizer), vocabulary_rows(lm.model))
            if any(not 0 <= t < vocab for t in prompt):
                raise RequestError(f"token ids must be in 0..{vocab - 1}", param="prompt")
            return list(prompt)
        text = prompt[0] if isinstance(prompt, list) else prompt
        with self._tokenizer_locks[model]:
            return list(self.models[model].tokenizer.encode(text))

    def generation(self, model: str, prompt: list[int], max_tokens: int | None,
                   **options) -> Generation:
        """A validated request for a served model (`Generation.checked`); one that gives no
        temperature samples at the server's."""
        self.check_model(model)
        if options.get("temperature") is None:
            options["temperature"] = self.config.temperature
        return Generation.checked(model, prompt, max_tokens, self.context[model],
                                  self.config.default_max_tokens, list(self.models), **options)

    def submit(self, job: Generation, emit: Callable[[object], None],
               cancelled: threading.Event) -> None:
        """Queue `job` on the worker; `emit` receives Started, Text..., then Finished or Failed
        (on the worker thread). Setting `cancelled` stops it at its next token."""
        if self._lockstep is not None:  # every process starts it at the same round
            self._worker.share("generate", self._lockstep.watch(cancelled, emit), job)
            return
        with self._waiting_lock:
            self._waiting += 1
        try:
            self._worker.submit(self._advance, self._start(job, emit, cancelled), job, emit)
        except RuntimeError:  # closed: the server is stopping
            with self._waiting_lock:
                self._waiting -= 1
            raise

    # -- the worker ---------------------------------------------------------------------------
    def _generate_in_step(self, rid: int, job: Generation) -> None:
        """A request shared in step, on every process: queued as `submit` queues it."""
        cancelled, emit = self._lockstep.request(rid)
        with self._waiting_lock:
            self._waiting += 1
        self._worker.later(self._advance, self._start(job, emit, cancelled), job, emit)

    def _advance(self, reading, job: Generation, emit) -> None:
        """Run the next part of a request's reading (`_start`); the part after it goes to the
        back of the queue, behind the decoding step, so a long prompt does not stall the
        replies being decoded."""
        try:
            next(reading)
        except StopIteration:
            return
        except Exception as e:
            self.residency.release(job.model)
            self.metrics.inc("kvtrans_generation_failures_total", model=job.model)
            emit(Failed(e))
            return
        self._worker.later(self._advance, reading, job, emit)

    def _start(self, job: Generation, emit, cancelled: threading.Event):
        """A request up to its first token, in parts (a generator: each `next` is one part):
        take its conversation, hand it to the model, read the prompt but its last token, put
        the conversation back, and join the model's decoding batch.
        A failure leaves the entry out of the store: its lines may be half-written."""
        with self._waiting_lock:
            self._waiting -= 1
        if cancelled.is_set():  # the client left while it waited
            return
        # held from here, so that every way out (`_advance` on a failure) releases its own hold
        self.residency.hold(job.model)
        history = RequestHistory(queue_seconds=time.perf_counter() - job.arrived)
        match = self.store.checkout(job.model, job.prompt, job.conversation)
        entry = match.entry
        history.conversation = entry.conversation or entry.id
        history.load_seconds = self.residency.ensure(job.model, match.holder)
        if cancelled.is_set():  # given up while its model loaded (a 503): nothing changed
            self.store.checkin(entry, set())
            self.residency.release(job.model)
            return
        self._take_history(match, job.model, history)
        history.tokens_new = len(job.prompt) - match.position
        yield from self._read_prompt(entry, job, cancelled)
        line = entry.session.lines[job.model]
        if line.cache is None:  # a one-token prompt: nothing read yet
            from mlx_lm.models.cache import make_prompt_cache

            line.cache = make_prompt_cache(line.lm.model)
        self.residency.ensure(job.model, match.holder)
        self.store.checkin(entry, {job.model, match.holder})
        if cancelled.is_set():
            self.residency.release(job.model)
            return
        tok = self.models[job.model].tokenizer
        decoding = Decoding(job, history, emit, cancelled, tok, self._tokenizer_locks[job.model],
                            entry)
        self.batches.join(line.lm.model, job.model, line.cache, job.prompt[-1], decoding)
        if not self._stepping:
            self._stepping = True
            self._worker.later(self._step)

    def _step(self) -> None:
        """One token for every request decoding, on every model; again, after whatever came
        meanwhile, while any request decodes."""
        for model, size in self.batches.sizes.items():
            self.metrics.inc("kvtrans_decode_steps_total", model=model)
            self.metrics.inc("kvtrans_decode_step_tokens_total", size, model=model)
        ended, failed = self.batches.step()
        for decoding, error in failed:
            self.residency.release(decoding.job.model)
            self.metrics.inc("kvtrans_generation_failures_total", model=decoding.job.model)
            decoding.emit(Failed(error))
        for decoding in ended:
            self._finish(decoding)
        self._stepping = len(self.batches) > 0
        if self._stepping:
            self._worker.later(self._step)

    def _finish(self, decoding: Decoding) -> None:
        job = decoding.job
        self.residency.release(job.model)
        finished = Finished(decoding.reason, len(job.prompt), len(decoding.tokens),
                            decoding.history, decoding.entry)
        self.metrics.count_generation(job.model, finished)
        decoding.entry.reply = (job.model, len(job.prompt), decoding.tokens)
        if len(self.batches) or self.queue_depth:
            # busy: in idle time, which the follow-up usually beats, reading the reply with
            # its own turn in one forward
            self._worker.submit_idle(self._read_reply, decoding.entry, job, decoding.tokens)
        else:  # queued before the reply goes out: a follow-up finds it read in
            self._worker.later(self._read_reply, decoding.entry, job, decoding.tokens)
        decoding.emit(finished)

    def _read_reply(self, entry: Entry, job: Generation, reply: list[int]) -> None:
        """After a reply (in idle time when other requests are busy): the model reads it into
        the conversation's cache (the batch decoded on a copy), recording what its translators
        need at prefill speed, so a follow-up that sends the reply back reads only what is new;
        then, in idle time, the conversation is translated ahead. Skipped when a request has
        taken the conversation or moved it on (its prompt read the reply)."""
        if not self.store.take(entry):
            return
        session, line = entry.session, entry.session.lines[job.model]
        if (session.view(job.model) == job.prompt and line.seen == len(job.prompt) - 1
                and self.residency.is_resident(job.model)):
            try:
                session.activate(job.model)
                session.add(reply)
                session.read(line, len(session.tokens) - 1, generated=entry.sampled(job.model))
            except Exception:  # the entry, half-written, is not put back
                logging.getLogger(__name__).exception("reading a reply in failed")
                return
        self.store.checkin(entry, set())
        if self.config.translate and self.config.translate_ahead:
            self._worker.submit_idle(self._translate_ahead, entry, job)

    def _take_history(self, match: Match, model: str, history: RequestHistory) -> None:
        """Make `model` the active model of the entry, holding `match.position` tokens."""
        session = match.entry.session
        # what was given to this model's line ahead, between turns, came from the switch
        history.tokens_reused = max(0, match.own - session.given_ahead(model))
        if match.holder == model or match.position <= match.own:
            came_from = session.active
            session.activate(model)
            # a conversation translated to this model ahead, between turns: its switch
            ahead = session.joined(model) if came_from != model and match.own else None
            if ahead is None:
                session.forget_ahead(model)
                history.status = HistoryStatus.REUSED if match.own else HistoryStatus.NONE
                return
            status = ahead
        else:
            session.activate(match.holder)
            try:
                status = session.switch(model)
            except Exception as e:  # the translator itself failed: re-read instead, visibly
                status = self._reread(match.entry, model, f"translation failed: "
                                                          f"{type(e).__name__}: {e}")
        if status.status == Outcome.FALLBACK and not self.config.translate:
            status.reason = "translation is off (--no-translate)"
        history.status, history.switch = HistoryStatus(status.status), status

    def _translate_ahead(self, entry: Entry, job: Generation) -> None:
        """Idle time after `job`'s reply: hand its conversation to the models it may go to next
        (the one the request named, else every other model of its group a translator
        reaches), so that the switch finds the translation made. A switch that falls back
        (the gate fired, the translator failed) is re-read in parts (`_read_ahead`). Stops for
        any request that comes; the lines it fills are the store's first to go."""
        session = entry.session
        targets = [job.next_model] if job.next_model else [
            t for t in session.lines if (job.model, t) in session.translators]
        targets = [t for t in targets if t != job.model and t in session.lines
                   and self.residency.is_resident(t)]  # never loaded for a guess
        if (not targets or not self.residency.is_resident(job.model)
                or not self.store.take(entry)):  # in use again, or evicted
            return
        try:
            for target in targets:
                if self.queue_depth:  # a request waits: it goes first
                    break
                try:
                    status = session.translate_ahead(target, read_fallback=False)
                except Exception as e:  # as a failed switch: re-read (ahead), and say why
                    logging.getLogger(__name__).exception("translating ahead failed")
                    entry.drop(target)  # the failed switch may have written part of it
                    status = SwitchStatus(session.active, target, Outcome.FALLBACK,
                                          f"translation failed: {type(e).__name__}: {e}")
                    session.refuse(target, status, 0)
                if status.status == Outcome.FALLBACK:
                    self._worker.submit_idle(self._read_ahead, entry, target,
                                             (session.active, len(session.tokens)))
                elif not self.trimmable[target]:
                    entry.checkpoint(target)
        finally:
            self.store.checkin(entry, set())

    def _read_ahead(self, entry: Entry, target: str, moment: tuple,
                    part: int = FIRST_IDLE_PART) -> None:
        """One part of a re-read that translating ahead fell back to (`Session.refuse`), then
        the next part in later idle time: a request that comes waits for one part at most, and
        its switch re-reads what is left. A part is `part` tokens (at most READ_PART), the next
        one sized from this one's pace to take about IDLE_PART_SECONDS. Stops once the
        conversation moved on from `moment` (its active model and length)."""
        session = entry.session
        if (self.queue_depth or not self.residency.is_resident(target)
                or not self.store.take(entry)):
            return
        try:
            refused = session.re_reading_ahead(target)
            if (session.active, len(session.tokens)) != moment or refused is None:
                return
            line = session.lines[target]
            end = session.mapped(session.active, session.lines[session.active].seen, target)
            started, part = time.perf_counter(), min(part, READ_PART)
            if line.seen < end:
                session.read(line, min(end, line.seen + part))
            took = time.perf_counter() - started
            refused.translate_seconds += took
            if line.seen < end:
                paced = int(part * IDLE_PART_SECONDS / max(took, 1e-3))
                self._worker.submit_idle(self._read_ahead, entry, target, moment,
                                         max(SMALLEST_IDLE_PART, paced))
                return
            session.keep_reread(target)
            if not self.trimmable[target]:
                entry.checkpoint(target)
        finally:
            self.store.checkin(entry, set())

    def _reread(self, entry: Entry, model: str, reason: str) -> SwitchStatus:
        started = time.perf_counter()
        session = entry.session
        source = session.active
        entry.drop(model)  # the failed switch may have written part of it
        session.activate(model)
        session.refresh(model)
        return SwitchStatus(source, model, Outcome.FALLBACK, reason,
                            tokens_fallback=len(session.tokens),
                            translate_seconds=time.perf_counter() - started)

    def _read_prompt(self, entry: Entry, job: Generation, cancelled: threading.Event):
        """Read the prompt's unread tokens but the last (the batch reads it first), in parts
        of READ_PART tokens (a generator: it yields between them). A model with fixed-size
        caches takes a snapshot where the last message begins (an edited turn re-reads only
        itself), every SNAPSHOT_EVERY tokens of a long read, and at the end (the reply that
        follows comes back as text, and may not tokenise to what was generated)."""
        session = entry.session
        line = session.lines[job.model]
        end = len(job.prompt) - 1
        session.add(job.prompt[len(session.tokens):])
        seen = line.seen
        snapshots = set()
        if not self.trimmable[job.model] and seen < end:
            every = range((seen // SNAPSHOT_EVERY + 1) * SNAPSHOT_EVERY, end, SNAPSHOT_EVERY)
            snapshots = {*every, *(b for b in job.boundaries if seen < b < end), end}
        for stop in sorted({*snapshots, *range(seen + READ_PART, end, READ_PART), end}):
            if stop <= line.seen:
                continue
            session.read(line, stop, generated=entry.sampled(job.model))
            if stop in snapshots:
                entry.checkpoint(job.model)
            if stop < end:
                yield
                if cancelled.is_set():
                    return
