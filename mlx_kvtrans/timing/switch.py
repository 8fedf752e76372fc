"""Time to first token after a switch: translation versus re-reading, side by side in one run.

For each prompt length, with medians over repeats:
- warm switch: the source's cache exists (and its per-token objects were recorded while it read);
  translate + install + the target's first decode step;
- cold switch: a user's first switch: the source has read the prompt, the translator is loaded
  (from its directory, when it has one) and prepared, and the warm switch runs on it for the
  first time (allocating, and compiling kernels where the device does);
- source prefill + switch: the source's prefill (recording) + the warm switch. The source reads
  the prompt with the fastest recurrence the device has (`fastest_recurrence`: mlx-lm's Metal
  kernel on a Mac, the chunkwise-parallel form elsewhere), so the figure measures translation,
  not mlx-lm's token loop off Metal;
- gated switch: what a `Session` does, by the same code (`session.receive_span`): all but the last
  r tokens translated and installed, the target reading those r and the prompt's last token in
  one forward (whose last logits give the first token), the fidelity gate's NLL comparison;
- re-reading: the target reads the whole prompt and produces its first token, in plain mlx-lm
  (what a user of mlx-lm gets: the token loop off Metal). When the target has linear-attention
  layers, `reread_chunked_s` is the same prefill under the chunkwise form, so both
  comparisons are visible: source prefill + switch vs re-reading (what switching saves a user
  today) and vs chunked re-reading (same recurrence on both sides);
- bound: the least a warm switch could cost here, measured beside it: (a) the target's first
  decode step on the installed cache alone, (b) the translation's arithmetic (and its relay's
  layers', `relay`) at the matmul peak measured in the bench's dtype, (c) the installed cache's
  bytes at the measured memory bandwidth. `warm_over_bound` = warm switch / bound.
Peak memory of each path, the translation's arithmetic rate, the BLAS in use and the dtype are
recorded with the timings.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from ..backend.blas import matmul_gflops, memory_bandwidth_gbs
from ..capture import PREFILL_CHUNK, Capture, capture
from ..translators.gate import GATE_TOKENS
from ..capture.instrument import chunked_recurrence, fastest_recurrence, language_model
from ..translators.cross_tokenizer import realigned
from ..translators.install import translate_into
from ..translators.relay import relay_of
from ..layouts import ObjectKind, layout_of
from ..models import LoadedModel
from ..session import Session, SwitchStatus, receive_span
from ..session.status import Outcome
from ..translators.translator import Translator


@dataclass
class BenchRow:
    length: int
    warm_switch_s: float
    cold_switch_s: float  # a user's first switch: translator loaded, first translation
    reread_s: float
    translate_s: float
    translate_gflops: float
    peak_mb_switch: float
    peak_mb_reread: float
    # the bound = first_step_s + flops_at_peak_s + bytes_at_bandwidth_s
    first_step_s: float  # (a) the target's first decode step on the installed cache
    flops_at_peak_s: float  # (b) translation flops / matmul peak
    bytes_at_bandwidth_s: float  # (c) install bytes / memory bandwidth
    install_bytes: int
    matmul_peak_gflops: float  # measured in this row, in the bench's dtype
    bandwidth_gbs: float  # measured in this row (bytes read + written)
    reread_chunked_s: float | None = None  # target prefill, chunkwise recurrence
    # the switch a Session makes: translate all but the last `gated_read` tokens (the gate's
    # `gate_tokens`, or the dial's R where longer), the target reads those itself, the
    # fidelity gate compares its NLL on the last `gate_tokens` with the source's, first token
    gated_switch_s: float | None = None
    gate_tokens: int = 0
    gated_read: int = 0  # tokens its target read itself: the gate's or the dial's R, if more
    # what the gated switch did: "applied" (its gate's verdict after a colon) or why it fell
    # back; a fallback times a full re-read, not a switch
    gated_outcome: str | None = None
    # of the gated switch: the target's one forward of the tokens it read (and of the first
    # token) and the gate's comparison, what it spends beyond translating; the warm switch
    # spends `first_step_s` there
    gated_read_s: float | None = None
    prefill_and_switch_s: float | None = None  # the source's recording prefill + warm switch
    prompt: str = "random ids"  # or "held-out text"

    @property
    def bound_s(self) -> float:
        return self.first_step_s + self.flops_at_peak_s + self.bytes_at_bandwidth_s

    @property
    def warm_over_bound(self) -> float:
        return self.warm_switch_s / self.bound_s

    @property
    def speedup_warm(self) -> float:
        return self.reread_s / self.warm_switch_s

    @property
    def speedup_cold(self) -> float:
        return self.reread_s / self.cold_switch_s

    @property
    def speedup_prefill_and_switch(self) -> float | None:
        return self.reread_s / self.prefill_and_switch_s if self.prefill_and_switch_s \
            else None

    @property
    def speedup_gated(self) -> float | None:
        return self.reread_s / self.gated_switch_s if self.gated_switch_s else None

    def to_json(self) -> dict:
        return {**asdict(self), "bound_s": self.bound_s, "warm_over_bound": self.warm_over_bound,
                "speedup_warm": self.speedup_warm, "speedup_cold": self.speedup_cold,
                "speedup_gated": self.speedup_gated,
                "speedup_prefill_and_switch": self.speedup_prefill_and_switch}


def translation_flops(translator: Translator, length: int, target_layout, target=None
                      ) -> float:
    """Arithmetic (2 x multiply-adds) of the translator over a `length`-token prompt (a conv
    history maps only the K-1 rows it keeps), and of its relay's layers of `target` reading
    the prompt (their weights once a token, their attention's scores and sums)."""
    flops = translator.flops(length, target_layout)
    chosen = relay_of(translator)
    if chosen is None or target is None:
        return flops
    stack = language_model(target).model.layers
    for i in chosen.layers:
        weights = sum(v.size for _, v in tree_flatten(stack[i].parameters()))
        width = stack[i].self_attn.q_proj.weight.shape[0]  # heads x head dim
        flops += 2.0 * weights * length + 2.0 * length * length * width
    return flops


def cache_nbytes(cache: list) -> int:
    """Bytes of every array an mlx-lm cache holds (each object's `state`: the valid rows)."""
    return sum(x.nbytes for _, x in tree_flatten([c.state for c in cache])
               if isinstance(x, mx.array))


def source_prefill(translator: Translator, source, prompt: mx.array, source_layout=None,
                   fast: bool = True) -> Capture:
    """The source reads `prompt`, recording what `translator` reads (with `fast`, under
    `fastest_recurrence`)."""
    with fastest_recurrence() if fast else contextlib.nullcontext():
        return capture(source, prompt, points=translator.source_points(),
                       layout=source_layout or layout_of(source), chunk_size=PREFILL_CHUNK,
                       residuals=translator.residuals())


def gated_session(translator: Translator, source, target, prompt: list[int], last: int,
                  gate_tokens: int = GATE_TOKENS, fast: bool = True) -> Session:
    """A `Session` over mlx-lm models `source` -> `target` whose source has read `prompt`, with
    `last` after it unread, as a conversation's source has when a switch comes (with `fast`,
    under `fastest_recurrence`). Across tokenizers `prompt` and `last` are the target's tokens
    and the source reads its own tokens of their text."""
    tokenizers = translator.tokenizers if translator.across_tokenizers else (None, None)
    session = Session({"source": LoadedModel("source", None, source, tokenizers[0], {}),
                       "target": LoadedModel("target", None, target, tokenizers[1], {})},
                      {("source", "target"): translator}, active="source",
                      gate_tokens=gate_tokens)
    session.add(prompt, model="target")
    with fastest_recurrence() if fast else contextlib.nullcontext():
        list(session.generate(0))
    session.add([last], model="target")
    return session


def gated_switch(session: Session) -> tuple[SwitchStatus, mx.array]:
    """The switch `session` makes (`receive_span` itself) into a target that holds nothing, then
    the target's greedy first token (from the logits the switch's one forward kept, else a
    decode step): (the switch's status, the token). The source's line is left as it was, so
    the switch can be timed again."""
    target = session.lines["target"]
    target.reset()
    conversation = session.conversation
    status = receive_span(conversation, session.lines["source"], target,
                          session.translators.get(("source", "target")), number=1)
    tokens = conversation.view("target")
    if target.next_logits is not None and target.seen == len(tokens):
        token = mx.argmax(target.next_logits, axis=-1)
        mx.eval(token)
        return status, token
    last = mx.array([tokens[target.seen:]])
    return status, first_token(target.lm.model, last, target.cache)


def switch_cache(translator: Translator, recorded: Capture, target, target_layout,
                 prompt: mx.array) -> list:
    """Translate the recorded source objects and install them (and run the translator's relay):
    the target's cache, evaluated."""
    cache = translate_into(translator, recorded, target, prompt)[2]
    mx.eval([c.state for c in cache])
    return cache


def first_token(target, last: mx.array, cache: list) -> mx.array:
    """The target's first decode step on `cache`: the greedy next token, evaluated."""
    token = mx.argmax(target(last, cache=cache)[:, -1], axis=-1)
    mx.eval(token)
    return token


QUICK_S, QUICK_RUNS = 1.0, 25  # a timing of milliseconds repeats up to this long, this often


def _median(fn, repeats: int, setup=None, quick: bool = True) -> tuple[float, float]:
    """(median seconds, peak MB above what was resident before: the weights and any source
    cache) of `fn` (of `setup()`'s result, built untimed, when given), each run evaluated.
    At least `repeats` runs, and more while the runs (setups included) have taken under
    `QUICK_S` (up to `QUICK_RUNS`, unless not `quick`): a median of three runs of a few
    milliseconds moves by tens of percent."""
    return _medians({"": fn}, repeats, setup, quick)[""]


def _medians(runs: dict[str, Callable], repeats: int, setup=None, quick: bool = True
             ) -> dict[str, tuple[float, float]]:
    """`_median` of each of `runs`, taken in turn while more than one wants more runs, so that
    the runs compared see the same load; each stops at its own count."""
    times = {name: [] for name in runs}
    peaks = {name: [] for name in runs}
    began = {name: time.perf_counter() for name in runs}

    def more(name: str) -> bool:
        done = len(times[name])
        return done < repeats or (quick and done < QUICK_RUNS
                                  and time.perf_counter() - began[name] < QUICK_S)
    while any(more(name) for name in runs):
        for name, fn in runs.items():
            if not more(name):
                continue
            args = (setup(),) if setup else ()
            mx.reset_peak_memory()
            resident = mx.get_active_memory()
            start = time.perf_counter()
            fn(*args)
            times[name].append(time.perf_counter() - start)
            peaks[name].append((mx.get_peak_memory() - resident) / 2**20)
    return {name: (statistics.median(times[name]), max(peaks[name])) for name in runs}


def _main_dtype(model) -> mx.Dtype:
    """The dtype holding most of `model`'s parameter bytes."""
    sizes = Counter()
    for _, p in tree_flatten(model.parameters()):
        sizes[p.dtype] += p.nbytes
    return sizes.most_common(1)[0][0]


@dataclass(frozen=True)
class BenchConfig:
    """What a switch bench times and how, apart from the models: `bench_switch` and
    `switch_report` (a `kvtrans bench` run) read the same value. Where None, `vocab` is the
    source tokenizer's in a report and 256 in a bare bench; `dtype` is float32 in a report
    (which casts the pair to it) and the target's own in a bare bench."""
    lengths: list[int]  # prompt lengths, in tokens
    repeats: int = 3  # timed runs per measurement, at least (the median)
    vocab: int | None = None  # random prompts' ids lie below it
    seed: int = 0  # random prompts' key
    dtype: str | None = None  # "float32", "bfloat16" or "float16": the matmul peak's
    gate_tokens: int = GATE_TOKENS  # the gated switch's tail, 0 for none
    label: str | None = None  # the pair's name in a report; None: the models' names


def _bench_prompt(text_ids: list[int] | None, length: int, vocab: int, seed: int,
                  across: bool) -> tuple[mx.array, bool]:
    """(the `length` tokens a row times, whether they are held-out text): a window of `text_ids`
    where it is long enough, else random ids; across tokenizers only text will do, since the
    source must read the same words in its own tokens."""
    from_text = text_ids is not None and len(text_ids) >= length
    if across and not from_text:
        raise ValueError(f"across tokenizers prompts are text: the held-out text holds "
                         f"fewer than {length:,} of the target's tokens")
    tokens = (mx.array([text_ids[:length]]) if from_text else
              mx.random.randint(0, vocab, (1, length), key=mx.random.key(seed + length)))
    return tokens, from_text


@dataclass(frozen=True)
class _SwitchPaths:
    """The paths a row times, each a closure over one source recording (`_switch_paths`)."""
    translate: Callable[[], list]  # translate + install: the target's cache
    warm: Callable[[], None]  # translate + install + the target's first decode step
    cold: Callable[[], None]  # a user's first switch: a fresh translator, then warm's work
    prefill_and_switch: Callable[[], None]  # the source records anew, then a warm switch
    reread: Callable[[], None]  # plain mlx-lm prefill of the prompt + first token
    reread_chunked: Callable[[], None]  # the same under the chunkwise recurrence


def _switch_paths(translator: Translator, source, target, source_layout, target_layout,
                  prompt: mx.array, last: mx.array, across: bool,
                  fresh: Callable[[], Translator] | None) -> _SwitchPaths:
    """The source reads `prompt` (untimed), and the paths a row times close over what it
    recorded; `prefill_and_switch` replaces that recording, so later switches translate the
    new one. Closures, not methods, so each timed region runs exactly the calls it names."""
    text = translator.aligned(prompt[0].tolist()) if across else None
    source_ids = text.source if across else prompt  # the source's tokens of the prompt
    recorded = source_prefill(translator, source, source_ids, source_layout)

    def at_target(capture: Capture) -> Capture:  # the source's capture at the target's tokens
        return realigned(capture, text) if across else capture

    def translate_only():
        return switch_cache(translator, at_target(recorded), target, target_layout, prompt)

    def warm():
        first_token(target, last, translate_only())

    def cold():  # once, before anything else translates at this length
        first = (fresh or (lambda: replace(translator)))().prepare()
        first_token(target, last, switch_cache(first, at_target(recorded), target,
                                               target_layout, prompt))

    def prefill_and_switch():
        nonlocal recorded
        recorded = source_prefill(translator, source, source_ids, source_layout)
        warm()

    def full_reread():  # plain mlx-lm prefill, in the chunks its generation uses
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(target)
        for start in range(0, prompt.shape[1], PREFILL_CHUNK):
            target(prompt[:, start:start + PREFILL_CHUNK], cache=cache)
            mx.eval([c.state for c in cache])
        first_token(target, last, cache)

    def reread_chunked():
        with chunked_recurrence():
            full_reread()

    return _SwitchPaths(translate=translate_only, warm=warm, cold=cold,
                        prefill_and_switch=prefill_and_switch, reread=full_reread,
                        reread_chunked=reread_chunked)


@dataclass(frozen=True)
class _BoundParts:
    """What the bound on a warm switch is made of, measured before the flops are known."""
    install_bytes: int
    matmul_peak_gflops: float
    bandwidth_gbs: float
    translate_s: float
    first_step_s: float

    def row_fields(self, flops: float) -> dict:
        """The `BenchRow` fields of the bound, its arithmetic at the measured peak included."""
        return dict(translate_s=self.translate_s,
                    translate_gflops=flops / self.translate_s / 1e9,
                    first_step_s=self.first_step_s,
                    flops_at_peak_s=flops / (self.matmul_peak_gflops * 1e9),
                    bytes_at_bandwidth_s=self.install_bytes / (self.bandwidth_gbs * 1e9),
                    install_bytes=self.install_bytes,
                    matmul_peak_gflops=self.matmul_peak_gflops,
                    bandwidth_gbs=self.bandwidth_gbs)


def _measure_bound(paths: _SwitchPaths, target, last: mx.array, dtype: mx.Dtype,
                   repeats: int) -> _BoundParts:
    """The bound's parts, after one warm switch compiles and allocates: the installed bytes,
    the matmul peak and memory bandwidth here, translation alone and the first decode step
    alone (on a cache installed untimed)."""
    paths.warm()  # compile and allocate once
    install_bytes = cache_nbytes(paths.translate())
    peak = matmul_gflops(dtype=dtype)
    bandwidth = memory_bandwidth_gbs()
    t_translate, _ = _median(paths.translate, repeats)
    t_step, _ = _median(lambda cache: first_token(target, last, cache), repeats,
                        setup=paths.translate)
    return _BoundParts(install_bytes=install_bytes, matmul_peak_gflops=peak,
                       bandwidth_gbs=bandwidth, translate_s=t_translate, first_step_s=t_step)


def _outcome_word(status: SwitchStatus) -> str:
    """What a gated switch did, for `BenchRow.gated_outcome`."""
    return (f"applied: gate {status.gate.value}" if status.status == Outcome.APPLIED else
            f"{status.status.value}: {status.reason}")


def _time_warm_and_gated(warm: Callable[[], None], session: Session | None,
                         repeats: int) -> dict:
    """The warm switch and, given a `session`, the switch it makes, timed in turn so both see
    the same load: their `BenchRow` fields. A gated switch that fell back times a full
    re-read, so its read time is left out."""
    runs = {"warm": warm}
    t_gated = outcome = t_gate_read = None
    read = 0
    if session is not None:
        status, _ = gated_switch(session)  # compile and allocate once
        outcome = _outcome_word(status)
        statuses = []
        runs["gated"] = lambda: statuses.append(gated_switch(session)[0])
    timed = _medians(runs, repeats)
    t_warm, peak_switch = timed["warm"]
    if session is not None:
        t_gated = timed["gated"][0]
        read = status.tokens_tail
        if status.status == Outcome.APPLIED:  # else the time is a full re-read's
            t_gate_read = statistics.median(s.gate_seconds for s in statuses)
    return dict(warm_switch_s=t_warm, peak_mb_switch=peak_switch, gated_switch_s=t_gated,
                gated_read=read, gated_outcome=outcome, gated_read_s=t_gate_read)


def bench_switch(translator: Translator, source, target, config: BenchConfig, progress=None,
                 text_ids: list[int] | None = None,
                 fresh: Callable[[], Translator] | None = None) -> list[BenchRow]:
    """TTFT rows for mlx-lm models `source` -> `target` at each of `config.lengths` (`dtype`,
    for the matmul peak: default the target's). Prompts are windows of `text_ids` (held-out
    text: the gate judges a conversation as users have them) where it is long enough, else
    random ids below `config.vocab` (default 256). `fresh()` gives the translator as a user's
    first switch has it (loaded from its directory; default: a new object of the same
    weights, with nothing built or evaluated on first use).
    `progress(done, total, what)` follows each measurement. Across tokenizers prompts are the
    target's tokens of `text_ids`, the source reads its own tokens of their text, and a switch
    includes pooling the source's capture onto the target's tokens (`cross_tokenizer`)."""
    source_layout, target_layout = layout_of(source), layout_of(target)
    across = translator.across_tokenizers
    target_is_hybrid = ObjectKind.RECURRENT_STATE in target_layout.kinds()
    dtype = getattr(mx, config.dtype) if config.dtype else _main_dtype(target)
    translator.prepare()
    lengths, repeats = config.lengths, config.repeats
    vocab, seed = config.vocab or 256, config.seed
    rows = []
    phases = 8 if target_is_hybrid else 7
    done = 0

    def step(what: str, length: int):
        nonlocal done
        if progress:
            progress(done, phases * len(lengths), f"{what} at {length:,} tokens")
        done += 1

    for length in lengths:
        step("source prefill", length)
        tokens, from_text = _bench_prompt(text_ids, length, vocab, seed, across)
        prompt, last = tokens[:, :-1], tokens[:, -1:]
        paths = _switch_paths(translator, source, target, source_layout, target_layout,
                              prompt, last, across, fresh)
        step("cold switch", length)
        t_cold, _ = _median(paths.cold, 1, quick=False)  # a user's first switch happens once
        step("bound", length)
        bound = _measure_bound(paths, target, last, dtype, repeats)
        step("warm switch", length)
        tail = min(config.gate_tokens, prompt.shape[1] - 1)
        # what a session does; held here, resident through the re-reads, till the next length
        session = gated_session(translator, source, target, prompt[0].tolist(),
                                int(last.item()), tail) if tail else None
        switched = _time_warm_and_gated(paths.warm, session, repeats)
        step("source prefill + switch", length)
        t_prefill_switch, _ = _median(paths.prefill_and_switch, repeats)
        step("re-reading", length)
        t_full, peak_full = _median(paths.reread, repeats)
        if target_is_hybrid:
            step("chunked re-reading", length)
        t_chunked = _median(paths.reread_chunked, repeats)[0] if target_is_hybrid else None
        flops = translation_flops(translator, length, target_layout, target)
        rows.append(BenchRow(
            length=length, cold_switch_s=t_cold, reread_s=t_full, peak_mb_reread=peak_full,
            reread_chunked_s=t_chunked, gate_tokens=tail,
            prompt="held-out text" if from_text else "random ids",
            prefill_and_switch_s=t_prefill_switch, **switched, **bound.row_fields(flops)))
        step("done", length)
    if progress:
        progress(done, done, "done")
    return rows
