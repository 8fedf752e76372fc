"""Needles in a conversation, the way users hand an instruct model a fact: rendered in the model's
own chat template.

A needle is a fact ("The number for pepper is 552190.") inside a user turn among turns of prose
(each answered with a short acknowledgement), and a question for it in the last user turn. The
assistant's answer starts "The number for pepper is" and the model must give the number: recall
is exact (every digit, with the full stop, is the greedy choice given the earlier ones), one
forward pass per needle as `needles.needle_report` scores it. With `facts` > 1 several numbers
stand in different turns and one of them is asked for (multi-fact recall).

The prose comes from a held-out text of another domain than the fitting corpus by default:
Python's own reference documentation (`pydoc_data.topics`, shipped with every Python), so that a
figure does not depend on the corpus the translators were fitted on.
"""

from __future__ import annotations

import random
from functools import lru_cache

from .needles import filler_sentences
from .tasks import KEYS, six_digits

ACKNOWLEDGEMENTS = ("Understood.", "I see.", "Thanks, noted.", "Got it.", "Okay.",
                    "Interesting, go on.")
TURN_SENTENCES = (2, 4)  # prose sentences per filler turn


@lru_cache(maxsize=1)
def other_domain_prose() -> tuple[str, ...]:
    """Sentences of Python's reference documentation: prose, no digits (`filler_sentences`)."""
    import pydoc_data.topics

    docs = [" ".join(text.split()) for _, text in sorted(pydoc_data.topics.topics.items())]
    return tuple(filler_sentences(docs, limit=100_000, seed=0))


class ChatNeedles:
    """`needles(seed, length)` -> (prompt ids, answer ids): a chat needle of about `length`
    tokens (prompt and answer) in `tokenizer`'s chat template."""

    def __init__(self, tokenizer, facts: int = 1, prose: list[str] | None = None):
        if facts < 1 or facts > len(KEYS):
            raise ValueError(f"facts: 1 to {len(KEYS)}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template: use text needles")
        self.tokenizer, self.facts = tokenizer, facts
        self.prose = list(prose or other_domain_prose())

    def _turns(self, rng: random.Random, count: int) -> list[str]:
        return [" ".join(rng.choice(self.prose) for _ in range(rng.randint(*TURN_SENTENCES)))
                for _ in range(count)]

    def _render(self, rng_seed: int, filler_turns: int):
        rng = random.Random(rng_seed)
        keys = rng.sample(KEYS, self.facts)
        codes = {k: six_digits(rng) for k in keys}
        turns = self._turns(rng, filler_turns)
        # each fact joins its own user turn, at a random depth of the conversation
        slots = sorted(rng.sample(range(filler_turns + self.facts), self.facts))
        users, facts = [], iter(keys)
        for slot in range(filler_turns + self.facts):
            if slot in slots:
                key = next(facts)
                lead = rng.choice(self.prose) if filler_turns and rng.random() < 0.5 else ""
                users.append(f"{lead} The number for {key} is {codes[key]}.".strip())
            else:
                users.append(turns.pop())
        asked = rng.choice(keys)
        messages = []
        for text in users:
            messages += [{"role": "user", "content": text},
                         {"role": "assistant", "content": rng.choice(ACKNOWLEDGEMENTS)}]
        messages.append({"role": "user", "content": f"What was the number for {asked}?"})
        prompt = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        lead = f"The number for {asked} is"
        head = self.tokenizer.encode(lead)
        whole = self.tokenizer.encode(f"{lead} {codes[asked]}.")
        if whole[:len(head)] != head:  # the number's first token took the space: ask with it
            raise ValueError("the tokenizer merges the answer's first digit into the lead")
        return prompt + head, whole[len(head):]

    def __call__(self, seed: int, length: int) -> tuple[list[int], list[int]]:
        """The needle of `seed` with the most filler turns whose total stays within `length`
        (none where even the fact and the question alone are longer)."""
        turns = 0
        prompt, answer = self._render(seed, turns)
        while True:
            longer = self._render(seed, turns + 1)
            if len(longer[0]) + len(longer[1]) > length:
                return prompt, answer
            turns, (prompt, answer) = turns + 1, longer
