"""Multi-turn evaluation: held-out dialogues that alternate models at every turn.

Each dialogue (`evaluation.tasks.dialogue`, seeds never used in training) states numbers in early
user turns and asks for them later. The active model answers every turn greedily; a question turn
counts as right when the reply contains the asked number. The same dialogues run under each
switching strategy (segment-wise, naive, refresh) and under re-prefill (no translators), so the
per-turn accuracies sit side by side.
"""

from __future__ import annotations

import re

from ..session import Session
from . import tasks

HELD_OUT_DIALOGUES = 950_000_000


def run_dialogue(models: dict, translators: dict, strategy: str, seed: int, turns: int,
                 max_tokens: int = 24) -> list[dict]:
    """Per assistant turn: which model answered, whether it was a question, whether right."""
    names = list(models)
    sample = tasks.dialogue(seed, turns=turns)
    messages = sample.messages + [{"role": "assistant", "content": sample.answer}]
    session = Session(models, translators, active=names[0],
                      strategy="segment" if strategy == "reprefill" else strategy)
    results, turn = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "user":
            continue
        tok = session.lines[session.active].lm.tokenizer
        chat = [message] if i > 1 else messages[:i + 1]  # the system prompt goes with turn 1
        session.add(tok.apply_chat_template(chat, add_generation_prompt=True))
        reply = list(session.generate(max_tokens, stop=set(tok.eos_token_ids)))
        text = tok.decode([t for t in reply if t not in tok.eos_token_ids])
        asked = re.match(r"What was the number for (\w+)\?", message["content"])
        right = None
        if asked:
            gold = re.search(r"is (\d{6})", messages[i + 1]["content"]).group(1)
            right = gold in text
        results.append({"turn": turn, "model": session.active, "question": bool(asked),
                        "right": right})
        session.add(tok.encode("\n")[-1:])
        turn += 1
        session.switch(names[turn % len(names)])
    return results


def evaluate(models: dict, translators: dict, dialogues: int = 20, turns: int = 10,
             strategies=("segment", "naive", "refresh", "reprefill"), progress=None) -> dict:
    """Per strategy and turn: accuracy on question turns, over `dialogues` held-out dialogues
    (keys: turn index, "all", and "questions", how many were asked in all).
    `progress(done, total, what)` follows the dialogues."""
    table = {}
    for n, strategy in enumerate(strategies):
        pairs = {} if strategy == "reprefill" else translators
        per_turn: dict[int, list[bool]] = {}
        for d in range(dialogues):
            if progress:
                progress(n * dialogues + d, len(strategies) * dialogues, strategy)
            for r in run_dialogue(models, pairs, strategy, HELD_OUT_DIALOGUES + d, turns):
                if r["question"]:
                    per_turn.setdefault(r["turn"], []).append(r["right"])
        table[strategy] = {str(t): sum(v) / len(v) for t, v in sorted(per_turn.items())}
        answered = [x for v in per_turn.values() for x in v]
        table[strategy]["all"] = sum(answered) / max(1, len(answered))
        table[strategy]["questions"] = len(answered)
    return table
