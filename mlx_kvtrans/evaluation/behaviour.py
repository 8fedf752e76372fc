"""Behaviour: does the target answer the same way from a translated cache as from its own?

KL and greedy agreement (`translators.fidelity`) say how far two continuations are apart; they
do not say how answers change. Here the target answers held-out prompts twice, greedily: reading
the prompt itself (native) and continuing from a cache of the prompt built by `cache_for`
(translated). Each answer is scored on habits a user notices: its first token, its length, a
leading space, refusal and "I don't know" phrases, copying a number from the prompt, repeated
n-grams. Every translated-minus-native difference gets a paired bootstrap confidence interval,
resampled within each prompt kind; a difference whose interval excludes zero is flagged.

Prompts (none drawn in training): chat-template dialogues (`tasks.dialogue`), needles with the
held-out filler, and windows of held-out prose. An answer ends at an end-of-sequence token, at
its first line break after some text, or after `max_tokens` tokens; a leading space or line break
counts as leading space.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from ..capture import capture
from ..layouts import CapturePoint, layout_of
from . import tasks
from .needles import HELD_OUT_SEED, held_out_filler, needle_prompt_tokens

KINDS = ("dialogue", "needle", "prose")
HELD_OUT_BEHAVIOUR_DIALOGUES = 960_000_000  # in the held-out range, apart from multiturn's
DIALOGUE_TURNS = 4  # a few facts and a question: within the zoo's training length
REPEAT_N = 3  # repetition: the share of an answer's token 3-grams seen earlier in it

# lower-case, straight apostrophes
REFUSALS = ("i can't help", "i cannot help", "i can't assist", "i cannot assist", "i'm sorry",
            "i am sorry", "i apologize", "i won't", "i will not", "i'm unable", "i am unable",
            "as an ai")
DONT_KNOW = ("i don't know", "i do not know", "i dont know", "not sure", "no idea",
             "i don't remember", "i do not remember", "can't recall", "cannot recall",
             "don't recall")
NUMBER = re.compile(r"\d{2,}")  # single digits are too common to count as copied


@dataclass(frozen=True)
class Prompt:
    kind: str  # one of KINDS
    ids: list[int]
    text: str  # decoded, for the digit-copy check


@dataclass(frozen=True)
class Answer:
    first: int | None  # the first generated token, a stop token included (None: none asked)
    tokens: list[int]  # the answer, its stop token excluded
    text: str


@dataclass(frozen=True)
class Pair:
    prompt: Prompt
    native: Answer
    translated: Answer


def held_out_prompts(tokenizer, count: int, length: int, text_ids: list[int],
                     seed: int = 0) -> list[Prompt]:
    """`count` prompts of each kind: dialogues, needles of about `length` tokens and `length`-
    token windows of `text_ids` (held-out prose; window starts drawn from `seed`)."""
    if len(text_ids) < length + 1:
        raise ValueError(f"held-out text has {len(text_ids)} tokens, fewer than {length + 1}")
    prompts = []
    for i in range(count):
        sample = tasks.dialogue(HELD_OUT_BEHAVIOUR_DIALOGUES + i, turns=DIALOGUE_TURNS)
        prompts.append(list(tokenizer.apply_chat_template(sample.messages,
                                                          add_generation_prompt=True)))
    filler = held_out_filler()
    prompts += [needle_prompt_tokens(tokenizer.encode, HELD_OUT_SEED + i, length, filler)[0]
                for i in range(count)]
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(text_ids) - length) for _ in range(count)]
    prompts += [list(text_ids[s:s + length]) for s in starts]
    kinds = [k for k in KINDS for _ in range(count)]
    return [Prompt(k, ids, tokenizer.decode(ids)) for k, ids in zip(kinds, prompts)]


def native_cache(model):
    """`cache_for` that builds the model's own cache: the native reference."""
    layout = layout_of(model)
    return lambda ids: capture(model, mx.array(ids)[None], points=(CapturePoint.ENGINE,),
                               layout=layout).engine


def answer(model, tokenizer, prompt_ids: list[int], cache, max_tokens: int) -> Answer:
    """The greedy answer to `prompt_ids` from `cache`, which holds all but the last prompt
    token (the model reads that one first)."""
    from mlx_lm.generate import generate_step

    stops = set(tokenizer.eos_token_ids)
    first = None
    tokens = []
    for token, _ in generate_step(mx.array(prompt_ids[-1:]), model, prompt_cache=cache,
                                  max_tokens=max_tokens):
        token = int(token)
        first = token if first is None else first
        if token in stops or ("\n" in tokenizer.decode([token])
                              and tokenizer.decode(tokens).strip()):
            break  # leading line breaks belong to the answer: a habit worth counting
        tokens.append(token)
    return Answer(first, tokens, tokenizer.decode(tokens))


def generate_pairs(model, tokenizer, prompts: list[Prompt], cache_for: Callable,
                   max_tokens: int = 32, progress=None) -> list[Pair]:
    """The native and the translated answer to each prompt. `cache_for(ids)` builds the cache
    the translated answer continues from (a translated cache of `ids`).
    `progress(done, total, what)` follows the prompts."""
    own = native_cache(model)
    pairs = []
    for i, prompt in enumerate(prompts):
        if progress:
            progress(i, len(prompts), prompt.kind)
        prefix = prompt.ids[:-1]
        pairs.append(Pair(prompt, answer(model, tokenizer, prompt.ids, own(prefix), max_tokens),
                          answer(model, tokenizer, prompt.ids, cache_for(prefix), max_tokens)))
    if progress:
        progress(len(prompts), len(prompts), "")
    return pairs


# -- what is measured of each answer: a number, or None where it does not apply -------------------
def _has(phrases):
    return lambda prompt, a: float(any(p in a.text.lower().replace("\u2019", "'")
                                       for p in phrases))


def _digit_copy(prompt: Prompt, a: Answer) -> float | None:
    given = set(NUMBER.findall(prompt.text))
    if not given:
        return None
    return float(any(n in given for n in NUMBER.findall(a.text)))


def _repetition(prompt: Prompt, a: Answer) -> float | None:
    grams = [tuple(a.tokens[i:i + REPEAT_N]) for i in range(len(a.tokens) - REPEAT_N + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else None


# name -> (label, measure of one answer); first-token agreement compares the two answers instead
MEASURES = {
    "answer_tokens": ("answer length (tokens)", lambda prompt, a: float(len(a.tokens))),
    "leading_space": ("leading-space rate", lambda prompt, a: float(a.text[:1].isspace())),
    "refusal": ("refusal-phrase rate", _has(REFUSALS)),
    "dont_know": ('"I don\'t know" rate', _has(DONT_KNOW)),
    "digit_copy": ("digit-copy rate", _digit_copy),
    "repetition": (f"repeated {REPEAT_N}-gram share", _repetition),
}
LABELS = {"first_token_agreement": "first-token agreement",
          **{name: label for name, (label, _) in MEASURES.items()}}


def _paired_values(pairs: list[Pair]) -> dict[str, list[tuple[str, float, float]]]:
    """metric -> (kind, native, translated) for each pair the metric applies to."""
    out = {"first_token_agreement": [
        (p.prompt.kind, 1.0, float(p.translated.first == p.native.first)) for p in pairs]}
    for name, (_, measure) in MEASURES.items():
        values = [(p.prompt.kind, measure(p.prompt, p.native), measure(p.prompt, p.translated))
                  for p in pairs]
        out[name] = [(k, n, t) for k, n, t in values if n is not None and t is not None]
    return out


def paired_bootstrap(kinds: list[str], differences: np.ndarray, resamples: int,
                     rng: np.random.Generator, level: float) -> tuple[float, float]:
    """Percentile interval of the mean difference, resampling prompts within each kind (every
    resample keeps the prompt mix)."""
    kind_of, columns = np.array(kinds), []
    for kind in dict.fromkeys(kinds):
        members = np.flatnonzero(kind_of == kind)
        columns.append(members[rng.integers(0, len(members), (resamples, len(members)))])
    means = differences[np.concatenate(columns, axis=1)].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def compare(pairs: list[Pair], resamples: int = 2000, seed: int = 0,
            level: float = 0.95) -> list[dict]:
    """Per metric: native and translated means, their difference with its paired bootstrap
    interval (`level`, `resamples` draws from `seed`), `flagged` when it excludes zero, and the
    means per prompt kind. A metric that applies to no prompt gets no interval."""
    rows = []
    for name, values in _paired_values(pairs).items():
        row = {"metric": name, "label": LABELS[name], "prompts": len(values)}
        if not values:
            rows.append({**row, "native": None, "translated": None, "difference": None,
                         "ci_low": None, "ci_high": None, "flagged": False, "by_kind": {}})
            continue
        kinds = [k for k, _, _ in values]
        native = np.array([n for _, n, _ in values])
        translated = np.array([t for _, _, t in values])
        # drawn afresh from `seed`: an interval does not depend on the metrics before it
        low, high = paired_bootstrap(kinds, translated - native, resamples,
                                     np.random.default_rng(seed), level)
        by_kind = {}
        for kind in dict.fromkeys(kinds):
            members = np.array(kinds) == kind
            by_kind[kind] = {"prompts": int(members.sum()),
                             "native": float(native[members].mean()),
                             "translated": float(translated[members].mean())}
        rows.append({**row, "native": float(native.mean()),
                     "translated": float(translated.mean()),
                     "difference": float((translated - native).mean()),
                     "ci_low": low, "ci_high": high, "flagged": low > 0 or high < 0,
                     "by_kind": by_kind})
    return rows


def behaviour(model, tokenizer, prompts: list[Prompt], cache_for: Callable, max_tokens: int = 32,
              resamples: int = 2000, seed: int = 0, progress=None) -> list[dict]:
    """`compare` over the native and translated answers to `prompts` (see `generate_pairs`)."""
    return compare(generate_pairs(model, tokenizer, prompts, cache_for, max_tokens, progress),
                   resamples, seed)

