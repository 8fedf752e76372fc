"""Training batches for the zoo: corpus windows mixed with synthetic recall tasks.

Every row is exactly `length + 1` tokens: a corpus window, or a synthetic sample (needle,
key-value, dialogue, passage copy, digit-string copy) of a random length up to the row's with
digit-free prose in front, so recall is trained at every depth and at every prompt length up to
the row length. The batch of step `s` depends only on (seed, s): training resumes from a
checkpoint without storing any random state.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..evaluation import tasks
from ..evaluation.needles import filler_sentences
from .corpus import read_split


def render_chat(messages: list[dict]) -> str:
    """The zoo chat template (`tokenizer.CHAT_TEMPLATE`), rendered + the generation prompt."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


class TokenStream:
    """The corpus split as one array of token ids, tokenized once and cached beside the corpus."""

    def __init__(self, corpus_dir: Path, split: str, tokenizer):
        text = (Path(corpus_dir) / f"{split}.txt").read_bytes()
        key = hashlib.sha256(text + tokenizer.to_str().encode()).hexdigest()[:16]
        cache = Path(corpus_dir) / f"{split}.{key}.npy"
        if cache.exists():
            self.ids = np.load(cache)
        else:
            docs = read_split(corpus_dir, split)
            eot = tokenizer.token_to_id("<|endoftext|>")
            parts = []
            for enc in tokenizer.encode_batch(docs):
                parts.append(np.asarray(enc.ids + [eot], dtype=np.int32))
            self.ids = np.concatenate(parts)
            np.save(cache, self.ids)

    def window(self, rng: random.Random, n: int) -> np.ndarray:
        start = rng.randrange(0, len(self.ids) - n)
        return self.ids[start:start + n]


@dataclass
class Mix:
    text: float = 0.25
    needle: float = 0.35
    kv: float = 0.1
    dialogue: float = 0.1
    copy: float = 0.1  # a passage then the same passage again: grows induction heads early
    digits: float = 0.1  # a random digit string then the same string again: copying, purest
    answer_weight: float = 4.0  # loss weight on answer tokens (the copied digits)

    KINDS = ("text", "needle", "kv", "dialogue", "copy", "digits")

    def draw(self, rng: random.Random) -> str:
        return rng.choices(self.KINDS, weights=[getattr(self, k) for k in self.KINDS])[0]


class SampleMaker:
    """Tokenized synthetic samples that fit a token budget."""

    def __init__(self, tokenizer, filler: list[str]):
        self.tok = tokenizer
        self.filler = filler
        self._prose = np.asarray(tokenizer.encode(" ".join(filler)).ids, dtype=np.int32)
        self.digit_ids = [tokenizer.token_to_id(str(d)) for d in range(10)]

    def prose(self, rng: random.Random, n: int) -> np.ndarray:
        """`n` tokens of the digit-free filler prose, from a random place."""
        if n <= 0:
            return self._prose[:0]
        reps = -(-(n + 1) // len(self._prose)) + 1
        pool = np.tile(self._prose, reps) if reps > 1 else self._prose
        start = rng.randrange(0, len(pool) - n)
        return pool[start:start + n]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def needle(self, seed: int, budget: int) -> tuple[list[int], list[int]]:
        """A needle of at most `budget` tokens: filler shrinks until it fits (never cut, so
        the code and the question always stay in)."""
        n_chars = max(60, int(budget * 3.6))
        while True:
            s = tasks.needle(seed, n_chars=n_chars, filler=self.filler)
            prompt, answer = self.encode(s.prompt), self.encode(s.answer)
            if len(prompt) + len(answer) <= budget or n_chars == 0:
                return prompt, answer
            n_chars = int(n_chars * 0.85 * budget / (len(prompt) + len(answer)))

    def key_value(self, seed: int, budget: int):
        n_pairs = 2
        best = None
        while True:
            s = tasks.key_value(seed, n_pairs=n_pairs)
            prompt, answer = self.encode(s.prompt), self.encode(s.answer)
            if len(prompt) + len(answer) > budget or n_pairs > len(tasks.KEYS):
                return best or (prompt[-(budget - len(answer)):], answer)
            best = (prompt, answer)
            n_pairs += 2

    def dialogue(self, seed: int, budget: int):
        """The longest dialogue (8, 6, 4 or 2 turns) that fits; a 2-turn one is cut in front
        only if it must (its fact is in the last user turn but one)."""
        turns = 8
        while True:
            s = tasks.dialogue(seed, turns=turns, filler=self.filler)
            prompt = self.encode(render_chat(s.messages))
            answer = self.encode(s.answer + "<|im_end|>")
            if len(prompt) + len(answer) <= budget or turns <= 2:
                return prompt[-(budget - len(answer)):], answer
            turns -= 2


def make_batch(step: int, seed: int, batch: int, length: int, stream: TokenStream,
               maker: SampleMaker, mix: Mix) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (batch, length+1) int32, loss weights (batch, length) float32) for step `step`."""
    rng = random.Random(seed * 1_000_003 + step)
    tokens = np.zeros((batch, length + 1), dtype=np.int32)
    weights = np.ones((batch, length), dtype=np.float32)
    eot = maker.tok.token_to_id("<|endoftext|>")
    for row in range(batch):
        kind = mix.draw(rng)
        if kind == "text":
            tokens[row] = stream.window(rng, length + 1)
            continue
        budget = rng.randrange(min(32, length - 1), length)  # mixed prompt lengths
        if kind == "dialogue" and budget < 128:
            kind = "needle"  # too short for a dialogue whose fact survives whole
        sample_seed = rng.randrange(1 << 30)
        if kind == "copy":  # a corpus passage, a separator, the passage again (the "answer")
            passage = list(stream.window(rng, max(4, (budget - 1) // 2)))
            prompt, answer = passage + [eot], passage
        elif kind == "digits":
            string = [maker.digit_ids[rng.randrange(10)] for _ in range(max(6, budget // 3))]
            prompt, answer = string + [eot], string
        else:
            prompt, answer = getattr(maker, {"kv": "key_value"}.get(kind, kind))(sample_seed,
                                                                               budget)
        sample = prompt + answer
        front = length + 1 - len(sample)
        # Digit-free prose in front (not padding: a long run of one pad token kept these models
        # from learning to copy at all; not raw corpus: its numbers would sit beside the code).
        prefix = list(maker.prose(rng, front - 1)) + [eot] if front > 0 else []
        tokens[row] = np.asarray(prefix + sample, dtype=np.int32)[-(length + 1):]
        # targets are tokens[1:]: the answer occupies the last len(answer) targets
        weights[row, length - len(answer):] = mix.answer_weight
    return tokens, weights


def needle_filler(corpus_dir: Path) -> list[str]:
    return filler_sentences(read_split(corpus_dir, "train"), limit=20_000, seed=1)
