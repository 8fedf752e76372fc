"""Seeded synthetic tasks that make recall and multi-turn behaviour measurable.

- needle: a six-digit code stated once inside long filler, asked for at the end (several phrasings);
- key-value recall: a list of `key: value` pairs, one key asked for;
- dialogue: multi-turn question/answer in the chat template, facts given in early turns, asked later.

Every generator draws from its own `random.Random(seed)`: the same seed gives the same instances,
so evaluation draws held-out instances from seeds that training never used.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

DEFAULT_FILLER = [
    "The morning was grey and the harbour lay quiet under a low sky.",
    "A cart rolled past the bakery, and the smell of bread followed it down the street.",
    "Nobody in the village remembered when the old bridge had last been painted.",
    "The teacher wrote the date on the board and waited for the room to settle.",
    "Rain came in the afternoon, steady and warm, and the gutters filled quickly.",
    "On the hill the wind turned the blades of the mill with a slow creak.",
    "The letters were sorted by hand and tied into bundles with brown string.",
    "A dog slept in the doorway of the shop, indifferent to the customers.",
]

NEEDLE_STATEMENTS = [
    "The secret code is {code}.",
    "Remember this: the access code is {code}.",
    "Note that the pass number is {code}.",
]
NEEDLE_QUESTIONS = [
    "What is the secret code?",
    "Which code was mentioned in the text?",
    "Tell me the code that was stated above.",
]
ANSWER_PREFIX = "The code is "

KEYS = ["apple", "river", "candle", "violin", "harbor", "pepper", "meadow", "lantern", "copper",
        "falcon", "garden", "marble", "saddle", "thistle", "walnut", "anchor"]


@dataclass
class Sample:
    prompt: str  # what the model reads (plain text, or chat-template messages rendered later)
    answer: str  # the exact continuation that counts as correct
    messages: list[dict] = field(default_factory=list)  # chat turns, for dialogue samples
    meta: dict = field(default_factory=dict)


def six_digits(rng: random.Random) -> str:
    return f"{rng.randrange(100000, 1000000)}"


def _filler(rng: random.Random, n_chars: int, sentences: list[str]) -> list[str]:
    out, size = [], 0
    while size < n_chars:
        s = rng.choice(sentences)
        out.append(s)
        size += len(s) + 1
    return out


def needle(seed: int, n_chars: int = 1000, filler: list[str] | None = None,
           depth: float | None = None) -> Sample:
    """A code stated once at relative `depth` (random if None) of about `n_chars` of filler."""
    rng = random.Random(seed)
    code = six_digits(rng)
    text = _filler(rng, n_chars, filler or DEFAULT_FILLER)
    depth = rng.random() if depth is None else depth
    text.insert(int(depth * len(text)), rng.choice(NEEDLE_STATEMENTS).format(code=code))
    prompt = " ".join(text) + "\n" + rng.choice(NEEDLE_QUESTIONS) + "\n" + ANSWER_PREFIX
    return Sample(prompt, code + ".", meta={"code": code, "depth": depth})


def key_value(seed: int, n_pairs: int = 8) -> Sample:
    """`key: value` pairs (six-digit values); the question asks for one key's value."""
    rng = random.Random(seed)
    keys = rng.sample(KEYS, min(n_pairs, len(KEYS)))
    values = {k: six_digits(rng) for k in keys}
    asked = rng.choice(keys)
    lines = [f"{k}: {values[k]}" for k in keys]
    prompt = "\n".join(lines) + f"\nWhat is the value of {asked}?\nThe value of {asked} is "
    return Sample(prompt, values[asked] + ".", meta={"key": asked})


def dialogue(seed: int, turns: int = 10, filler: list[str] | None = None) -> Sample:
    """A multi-turn chat: the user states facts in some turns and asks for earlier ones later.

    `messages` holds every turn up to the last user question; `answer` is the assistant's reply.
    """
    if turns < 2:
        raise ValueError("a dialogue needs at least 2 turns: a fact, then a question")
    rng = random.Random(seed)
    facts: dict[str, str] = {}
    messages = [{"role": "system", "content": "You are a helpful assistant with a good memory."}]
    for turn in range(turns):
        last = turn == turns - 1
        if facts and (last or rng.random() < 0.4):
            key = rng.choice(sorted(facts))
            messages.append({"role": "user", "content": f"What was the number for {key}?"})
            reply = f"The number for {key} is {facts[key]}."
            if last:
                return Sample("", reply, messages=messages, meta={"turns": turns, "key": key})
        else:
            key = rng.choice([k for k in KEYS if k not in facts] or KEYS)
            facts[key] = six_digits(rng)
            chatter = " ".join(_filler(rng, rng.randrange(40, 200), filler or DEFAULT_FILLER))
            messages.append({"role": "user",
                             "content": f"{chatter} The number for {key} is {facts[key]}."})
            reply = f"Noted: {key} is {facts[key]}."
        messages.append({"role": "assistant", "content": reply})
    raise AssertionError("unreachable: the first turn states a fact and the last one asks")
