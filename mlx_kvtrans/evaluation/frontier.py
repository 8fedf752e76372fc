"""The fidelity frontier: how close a switched cache stays to native, and what it saves, per
setting of every fidelity knob, at 1x-8x a translator's fitting length, on held-out data.

A switch at a prompt of L tokens gives the target a cache of the first L - 1 (the target then
reads the last token itself, which yields the first continuation token). One knob so far:

    R (`Setting.reread`): the translator translates the first L - 1 - R tokens, and the target
    reads the R after them itself over that translated prefix. R >= L - 1 is re-reading.

Per (length, setting), over held-out prose windows and held-out needles:
- agreement: the native target generates G = 32 tokens greedily from its own cache; the switched
  cache is fed the same tokens (teacher forcing) and its argmax compared at each position;
- agreement_last16: the same for the target reading only the last 16 prompt tokens: the floor
  (the zoo's tiny targets predict 70-85% of next tokens from those alone), and
  history_recovered = (agreement - agreement_last16) / (1 - agreement_last16);
- greedy_match (mean tokens of the G generated from the switched cache equal to native's),
  greedy_exact (share with all G equal), first_token agreement;
- kl: mean KL(native || switched) per continuation token, nats;
- recall_native / recall_translated: exact six-digit needle recall (evaluation/needles.py);
- speedup = time(target re-reads L tokens) / time(translate the first L - 1 - R, the target
  reads the remaining R + 1), measured side by side in one process, medians of a few repeats,
  the source having read the prompt already (a warm switch);
- near_ties: of the positions whose argmax parts from native's, the share where native's own
  two likeliest tokens lie within TIE_NATS: how much of what agreement misses is a near tie;
- intervals: 95% intervals of the recovered share, agreement, greedy match, first token, recall
  and applied, from the per-window values, which rows keep for paired comparisons
  (evaluation/intervals.py).

`cheapest` picks from a frontier the setting a session should switch with; `save` / `load` keep
a frontier as frontier.json in a translator directory.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..capture import capture
from ..files import sha256_file
from ..translators.gate import GATE_TOKENS
from ..translators.install import recompute_first_layers, translate_into
from ..layouts import CapturePoint, ObjectKind, layout_of
from ..translators.fidelity import greedy, kl_per_token
# the record this module measures: re-exported, so one import serves a frontier's users
from ..translators.frontier import (  # noqa: F401
    FILE, FLOOR_TOKENS, GENERATED, Frontier, Row, Setting, cheapest, cheapest_row,
    fitting_length, history_recovered, load, save)
from .intervals import window_intervals
from .needles import HELD_OUT_SEED, NeedleConfig, held_out_filler, needle_report

NEEDLE_DRAW = 1_000_000  # needle seeds per frontier seed: another seed, other needles

MULTIPLES = (1, 2, 4, 8)  # lengths measured: these multiples of the fitting length
GATE_READS = (f"a session's gate reads the prompt's last {GATE_TOKENS} tokens itself, so a "
              f"switch re-reads at least R = {GATE_TOKENS} (`eval fidelity` and `eval needle` "
              "measure the bare translation)")


def default_rereads(length: int) -> list[int]:
    """R = 8 (the gate's own tail: a session switch reads no fewer), 32, 128, ... while a
    translation remains at `length`."""
    out, r = [], GATE_TOKENS
    while Setting(r).applies(length):
        out.append(r)
        r *= 4
    return out


# -- one switch ----------------------------------------------------------------------------------
@dataclass
class Switch:
    """A translator between two mlx-lm models, and their layouts (read once). `tokenizers`:
    (source's, target's) when the two tokenize differently; the prompts are the target's
    tokens, and the source reads its own tokens of their text."""
    translator: object
    source: object
    target: object
    source_layout: object = None
    target_layout: object = None
    tokenizers: tuple | None = None

    def __post_init__(self):
        self.source_layout = self.source_layout or layout_of(self.source)
        self.target_layout = self.target_layout or layout_of(self.target)

    def native(self, ids: list[int]) -> list:
        """The target's own cache of `ids`."""
        return capture(self.target, mx.array(ids)[None], points=(CapturePoint.ENGINE,),
                       layout=self.target_layout).engine

    def read(self, setting: Setting, prefix: list[int]):
        """What the source recorded of the part of `prefix` the setting translates (None when
        it translates nothing). A warm switch has this already: it is never timed."""
        n = setting.translated(len(prefix))
        if n == 0:
            return None
        if self.tokenizers is not None:
            return self._read_across(prefix[:n])
        return capture(self.source, mx.array(prefix[:n])[None],
                       points=self.translator.source_points(), layout=self.source_layout,
                       residuals=self.translator.residuals())

    def _read_across(self, head: list[int]):
        """(the source's capture of its own tokens of `head`'s text, the groups that pool it
        onto `head`): a switch pools it (`translated`)."""
        from ..translators.cross_tokenizer import aligned_ids

        text = aligned_ids(*self.tokenizers, head, self.translator.info["alignment"]["pooling"])
        return capture(self.source, text.source, points=self.translator.source_points(),
                       layout=self.source_layout), text

    def translated(self, recorded, head: list[int]) -> list:
        """The target's cache of `head` translated from `recorded` and installed."""
        if self.tokenizers is not None:
            from ..translators.cross_tokenizer import realigned

            recorded = realigned(*recorded)
        return translate_into(self.translator, recorded, self.target, mx.array(head)[None])[2]

    def cache(self, setting: Setting, prefix: list[int], recorded=None) -> list:
        """The target's cache of `prefix` after a switch at `setting`, evaluated."""
        n = setting.translated(len(prefix))
        if n == 0:
            return self.native(prefix)
        recorded = recorded if recorded is not None else self.read(setting, prefix)
        cache = self.translated(recorded, prefix[:n])
        k = min(setting.recompute, len(self.target_layout.layers))
        if k:
            recompute_first_layers(self.target, cache, make_prompt_cache(self.target)[:k],
                                   mx.array(prefix[:n])[None], k)
        if n < len(prefix):
            self.target(mx.array(prefix[n:])[None], cache=cache)
        mx.eval([c.state for c in cache])
        return cache


class SessionSwitch(Switch):
    """The switch a user's session makes: the source reads the prefix in a `Session`, which
    hands it over to the target at the setting's R with the fidelity gate judging (a fired
    gate: the target re-reads). `statuses` keeps every switch's status."""

    def __init__(self, translator, source, target, gate_tokens: int | None = None,
                 sink: int | None = None, escalate: bool = False):
        from ..translators.alignment import tokenizer_groups

        across = len(set(tokenizer_groups({"s": source, "t": target}).values())) > 1
        super().__init__(translator, source.model, target.model,
                         tokenizers=(source.tokenizer, target.tokenizer) if across else None)
        self.lms = (source, target)
        self.gate_tokens = gate_tokens
        self.sink = sink
        self.escalate = escalate
        self.statuses: dict[Setting, list] = {}
        self._last = None  # (setting, prefix) -> its evaluated cache: one session per window

    def read(self, setting: Setting, prefix: list[int]):
        return None  # the session's source records what it reads

    def cache(self, setting: Setting, prefix: list[int], recorded=None) -> list:
        from ..session import Session

        key = (setting, tuple(prefix))
        if self._last is None or self._last[0] != key:
            options = {} if self.gate_tokens is None else {"gate_tokens": self.gate_tokens}
            session = Session({"source": self.lms[0], "target": self.lms[1]},
                              {("source", "target"): self.translator}, active="source",
                              reread=setting.reread, sink=self.sink,
                              escalate=self.escalate, recompute=setting.recompute, **options)
            session.add(prefix, model="target")  # the target's tokens (and their text)
            list(session.generate(0))  # the source reads the prefix
            self.statuses.setdefault(setting, []).append(session.switch("target"))
            cache = session.lines["target"].cache
            mx.eval([c.state for c in cache])
            self._last = (key, cache)
        return copy.deepcopy(self._last[1])  # the caller's forward must not grow ours


class QuantizedOwnCache(Switch):
    """No translation: the target's own cache quantized as mlx-lm's `--kv-bits B
    --quantized-kv-start 0` quantizes it (groups of 64). Scored like a switch, it is the
    fidelity users already trade for memory, to read a translation's figures beside."""

    def __init__(self, target, bits: int):
        super().__init__(None, target, target)
        self.bits = bits

    def read(self, setting: Setting, prefix: list[int]):
        return None

    def cache(self, setting: Setting, prefix: list[int], recorded=None) -> list:
        from mlx_lm.generate import maybe_quantize_kv_cache
        from mlx_lm.models.cache import ArraysCache, QuantizedKVCache

        if ObjectKind.MLA_LATENT in self.target_layout.kinds():
            raise ValueError("mlx-lm's quantized cache does not serve MLA attention")
        cache = make_prompt_cache(self.target)
        self.target(mx.array(prefix)[None], cache=cache)
        maybe_quantize_kv_cache(cache, 0, KV_GROUP, self.bits)
        if not all(isinstance(c, (QuantizedKVCache, ArraysCache)) for c in cache):
            raise ValueError("mlx-lm cannot quantize every cache of this model")
        mx.eval([c.state for c in cache])
        return cache


KV_GROUP = 64  # mlx-lm's default `--kv-group-size`


def quantized_reference(target, text_ids: list[int], lengths: list[int], bits: int,
                        prompts: int, seed: int = 0) -> dict[int, dict]:
    """Per length, the target continuing from its own cache at `bits` (`QuantizedOwnCache`)
    on the windows a frontier of the same `prompts` and `seed` reads: history recovered,
    agreement, greedy match, first token and KL, averaged as `measure` averages them."""
    switch = QuantizedOwnCache(target, bits)
    out = {}
    for length in lengths:
        rows, floors = [], []
        for start in window_starts(text_ids, length, prompts, seed):
            ref = reference(switch, list(text_ids[start:start + length]))
            rows.append(score(switch, Setting(), ref))
            floors.append(ref.floor)
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("agree", "match", "first", "kl")}
        out[length] = {"history_recovered": history_recovered(mean["agree"],
                                                              sum(floors) / len(floors)),
                       "agreement": mean["agree"], "greedy_match": mean["match"],
                       "first_token": mean["first"], "kl": mean["kl"]}
    return out


def window_starts(text_ids: list[int], length: int, count: int, seed: int) -> list[int]:
    """Where the `count` prose windows of `length` tokens start: the same for a seed and
    length whatever else is measured."""
    if len(text_ids) < length + 1:
        raise ValueError(f"held-out text has {len(text_ids)} tokens, fewer than {length + 1}")
    rng = random.Random(seed * 1_000_003 + length)
    return [rng.randrange(0, len(text_ids) - length) for _ in range(count)]


def time_switch(switch: Switch, setting: Setting, tokens: list[int],
                repeats: int = 3) -> tuple[float, float]:
    """(re-reading seconds, switch seconds) to the first token of the `tokens` prompt: the
    target reading every token, beside the warm switch (translate, install, the target reads
    the rest); each ends with the first token's argmax evaluated. The two alternate, so both
    see the same load; medians of `repeats` after one untimed run each."""
    # the compute of the switch itself, without a session's bookkeeping or its gate
    switch = Switch(switch.translator, switch.source, switch.target, switch.source_layout,
                    switch.target_layout, switch.tokenizers)
    target, prefix = switch.target, tokens[:-1]
    n = setting.translated(len(prefix))

    def first_token(cache, ids):
        mx.eval(mx.argmax(target(mx.array(ids)[None], cache=cache)[:, -1], axis=-1))

    runs = {"reread": lambda: first_token(make_prompt_cache(target), tokens)}
    if n:  # else it is the re-reading
        recorded = switch.read(setting, prefix)
        runs["switch"] = lambda: first_token(switch.translated(recorded, prefix[:n]), tokens[n:])
    times = {name: [] for name in runs}
    for run in runs.values():
        run()  # compile and allocate once
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    full_reread = statistics.median(times["reread"])
    return full_reread, statistics.median(times.get("switch", times["reread"]))


@dataclass
class Reference:
    """One window as the native target continues it: `GENERATED` greedy tokens after the
    prompt, its logits on them, and the floor (the target reading only the last tokens)."""
    prefix: list[int]
    last: int
    tokens: list[int]  # the greedy continuation
    inputs: mx.array  # (1, GENERATED): what teacher forcing feeds, the last prompt token first
    logits: mx.array  # (GENERATED, V): native, teacher-forced on `tokens`
    floor: float  # agreement of the target reading the last FLOOR_TOKENS prompt tokens only
    own: float  # agreement of native with itself (1 but for ties): the ceiling


def reference(switch: Switch, prompt: list[int]) -> Reference:
    target = switch.target
    prefix = prompt[:-1]
    last = prompt[-1]
    tokens = greedy(target, last, switch.native(prefix), GENERATED)
    truth = mx.array(tokens)
    inputs = mx.array([last] + tokens[:-1])[None]
    native = target(inputs, cache=switch.native(prefix))[0]
    own = float((mx.argmax(native, -1) == truth).mean())
    floor = floor_agreement(target, prompt, tokens)
    return Reference(prefix, last, tokens, inputs, native, floor, own)


def floor_agreement(target, prompt: list[int], tokens: list[int]) -> float:
    """The agreement with `tokens` (a continuation of `prompt`) of `target` reading only the
    last FLOOR_TOKENS prompt tokens, teacher-forced: what needs no history at all."""
    tail = mx.array(prompt[-FLOOR_TOKENS:] + tokens[:-1])[None]
    predicted = mx.argmax(target(tail)[0, FLOOR_TOKENS - 1:], -1)
    return float((predicted == mx.array(tokens)).mean())


def score(switch: Switch, setting: Setting, ref: Reference) -> dict:
    """How the switched cache of one window continues, against native: `against` its
    teacher-forced logits, and of its own greedy tokens the matches, all-equal and the first."""
    target = switch.target
    recorded = switch.read(setting, ref.prefix)
    logits = target(ref.inputs, cache=switch.cache(setting, ref.prefix, recorded))[0]
    generated = greedy(target, ref.last, switch.cache(setting, ref.prefix, recorded), GENERATED)
    same = [a == b for a, b in zip(generated, ref.tokens)]
    return {**against(ref, logits), "match": sum(same), "exact": float(all(same)),
            "first": float(same[0])}


def against(ref: Reference, logits: mx.array) -> dict:
    """Teacher-forced `logits` (GENERATED, V) of a cache against native's: agreement, KL, and of
    the positions whose argmax parts from native's, how many, and how many of those native
    itself nearly ties (`near_tie`)."""
    parted = mx.argmax(logits, -1) != mx.array(ref.tokens)
    return {"agree": 1.0 - float(parted.mean()),
            "kl": float(kl_per_token(ref.logits, logits).mean()),
            "parted": int(parted.sum()), "tied": int((parted & near_tie(ref.logits)).sum())}


TIE_NATS = 0.3  # native's top two log-probabilities this close: a near tie


def near_tie(logits: mx.array) -> mx.array:
    """Per position, whether the two likeliest tokens lie within TIE_NATS of each other."""
    top = mx.topk(logits.astype(mx.float32), 2, axis=-1)  # logits differ as log-probs do
    return mx.abs(top[..., 0] - top[..., 1]) < TIE_NATS


SCORES = ("agree", "kl", "parted", "tied", "match", "exact", "first")  # per window (`score`)


@dataclass(frozen=True)
class FrontierConfig:
    """A frontier measurement's options, apart from the models and data it runs on: one
    value that callers build once and pass along. `measure` reads prompts, needles, repeats,
    seed and make (its plan holds the lengths and settings); `measure_translator` all."""
    lengths: list[int] | None = None  # prompt lengths; None: 1x-8x the fitting length
    rereads: list[int] | None = None  # R; None: `default_rereads` at each length
    prompts: int = 16  # held-out prose windows per length
    needles: int = 16  # held-out needles per length (0: no recall)
    repeats: int = 3  # timed runs of each switch (the median)
    seed: int = 0  # another seed: other windows and another draw of needles
    sink: int | None = None  # the target reads this many first tokens; None: the translator's
    recomputes: list[int] = (0,)  # k, the target's first layers that re-read, with every R
    make: Callable | None = None  # the needles' format (`needles.needle_report`); None: raw text


def measure(switch: Switch, encode, text_ids: list[int], plan: dict[int, list[Setting]],
            config: FrontierConfig = FrontierConfig(), progress=None, group=None) -> list[Row]:
    """One row per (length, setting) of `plan` (prompt length -> settings), over
    `config.prompts` held-out windows of `text_ids` (`window_starts`) and `config.needles`
    held-out needles (0: no recall; seed 0: the needles every benchmark reads, another seed
    another draw of them). `encode`: the target tokenizer's.
    `progress(done, total, what)` follows the windows.
    `group`: the processes of `mlx.launch`: each scores its share of the windows and needles,
    the first alone times the switch, and every process returns the same rows."""
    from ..backend.processes import mine, summed

    prompts, needles = config.prompts, config.needles
    target, rows = switch.target, []
    total, done = sum(len(s) for s in plan.values()) * (prompts + 2), 0
    filler = held_out_filler() if needles and config.make is None else None
    timer = group is None or group.rank() == 0
    for length, settings in plan.items():
        starts = window_starts(text_ids, length, prompts, config.seed)
        scores = {s: {k: [] for k in SCORES} for s in settings}
        floor, own = [], []  # per window: the last-16 floor's agreement, native's own
        owned = []  # the windows this process scores, in order
        for w, start in enumerate(starts):
            if not mine(w, group):
                continue
            owned.append(w)
            ref = reference(switch, list(text_ids[start:start + length]))
            floor.append(ref.floor)
            own.append(ref.own)
            for s in settings:
                if progress:
                    progress(done, total, f"{length:,} tokens, window {w + 1}, {s.label()}")
                done += 1
                for key, value in score(switch, s, ref).items():
                    scores[s][key].append(value)
        # seed 0: the held-out needles
        draw = NeedleConfig(needles, HELD_OUT_SEED + config.seed * NEEDLE_DRAW, filler)
        native_recall = needle_report(target, encode, length, draw, group=group,
                                      make=config.make)["recall"] if needles else None
        for s in settings:
            if progress:
                progress(done, total, f"{length:,} tokens, needles and timing, {s.label()}")
            done += 2
            recall = needle_report(target, encode, length, draw,
                                   cache_for=lambda ids, s=s: switch.cache(s, ids),
                                   group=group, make=config.make)["recall"] if needles else None
            made = getattr(switch, "statuses", {}).pop(s, None) or []  # a session's switches
            timed = time_switch(switch, s, list(text_ids[starts[0]:starts[0] + length]),
                                config.repeats) if timer else (0.0, 0.0)
            sums = [sum(scores[s][k]) for k in SCORES] + [
                sum(floor), sum(own), sum(st.status == "applied" for st in made), len(made),
                *timed]
            if group is not None:
                sums = summed(np.array(sums), group).tolist()
            got = {k: v / prompts for k, v in zip(SCORES, sums)}

            def every(key, values=None):  # every window's value, in window order
                whole = np.zeros(prompts)
                whole[owned] = scores[s][key] if values is None else values
                return (whole if group is None else summed(whole, group)).tolist()
            agree, every_floor = every("agree"), every(None, floor)
            floor_sum, own_sum, applied, switches, reread_s, switch_s = sums[len(SCORES):]
            rows.append(Row(
                length=length, setting=s, windows=prompts, agreement=got["agree"],
                agreement_last16=floor_sum / prompts, agreement_native=own_sum / prompts,
                history_recovered=history_recovered(got["agree"], floor_sum / prompts),
                greedy_match=got["match"], greedy_exact=got["exact"],
                first_token=got["first"], kl=got["kl"], needles=needles,
                recall_native=native_recall, recall_translated=recall,
                reread_s=reread_s, switch_s=switch_s,
                applied=applied / switches if switches else None,
                intervals=window_intervals(
                    agree, every_floor, every("match"), every("first"), recall, needles,
                    applied / switches if switches else None, int(switches)),
                window_agreement=agree, window_floor=every_floor,
                near_ties=got["tied"] / got["parted"] if got["parted"] else None))
    if progress:
        progress(total, total, "")
    return rows


def measure_translator(directory, source, target, translator, text_ids: list[int],
                       config: FrontierConfig = FrontierConfig(), progress=None,
                       group=None) -> Frontier:
    """The frontier of a loaded translator (`source`, `target`: LoadedModels) from the
    translator directory `directory`: at `config.lengths` (default 1x-8x its fitting length)
    and R in `config.rereads` (default `default_rereads`); settings that translate nothing are
    left out. A session's switch reads the gate's r tokens whatever R asks, so R below r is
    refused (ValueError); and the target reads the first `config.sink` tokens itself (None:
    the translator's measured sink, as a `Session`'s default). `group`: the
    processes of `mlx.launch`, which share the windows and needles (`measure`).
    `config.recomputes`: k, the target's first layers that read the translated prefix
    themselves, measured with every R."""
    directory = Path(directory)
    fit_length = fitting_length(translator.info)
    lengths = config.lengths or [fit_length * m for m in MULTIPLES]
    rereads = config.rereads

    below = [r for r in rereads or () if r < GATE_TOKENS]
    if below:
        raise ValueError(f"R = {below[0]}: {GATE_READS}")

    def asked(n: int) -> set[int]:
        return set(rereads or default_rereads(n))
    wanted = sorted(set().union(*(asked(n) for n in lengths)))
    plan = {n: [Setting(r, k) for r in wanted for k in config.recomputes
                if Setting(r).applies(n) and r in asked(n)] for n in lengths}
    for n, settings in plan.items():
        if not settings:
            raise ValueError(f"no setting of R in {wanted} translates anything at {n} tokens")
    switch = SessionSwitch(translator.prepare(), source, target, sink=config.sink)
    rows = measure(switch, target.tokenizer.encode, text_ids, plan, config, progress, group)
    weights = directory / "weights.safetensors"
    settings = {"prompts": config.prompts, "needles": config.needles,
                "repeats": config.repeats, "seed": config.seed}
    if group is not None:
        settings["processes"] = group.size()
    return Frontier(directory.name, source.name, target.name, fit_length, rows, settings,
                    sha256_file(weights) if weights.is_file() else None)


