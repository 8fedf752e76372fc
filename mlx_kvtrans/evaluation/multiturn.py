"""Multi-turn evaluation: held-out dialogues that alternate models at every turn.

Each dialogue (`evaluation.tasks.dialogue`, seeds never used in training) states numbers in early
user turns and asks for them later. The active model answers every turn greedily; a question turn
counts as right when the reply contains the asked number. The same dialogues run under each
switching strategy (segment-wise, naive, refresh; each with the fidelity gate), segment-wise
without the gate (what the translators alone give) and under re-reading (no translators), so the
per-turn accuracies sit side by side with how often the gate sent a switch back to re-reading.
"""

from __future__ import annotations

import re

from ..session import Session
from . import tasks

HELD_OUT_DIALOGUES = 950_000_000


UNGATED = "segment, no gate"
STRATEGIES = ("segment", UNGATED, "naive", "refresh", "reread")


def run_dialogue(models: dict, translators: dict, strategy: str, seed: int, turns: int,
                 max_tokens: int = 24) -> list[dict]:
    """Per assistant turn: which model answered, whether it was a question, whether right, and
    the gate's verdict on the switch into the turn ("" on the first turn)."""
    names = list(models)
    sample = tasks.dialogue(seed, turns=turns)
    messages = sample.messages + [{"role": "assistant", "content": sample.answer}]
    plain = {"reread": "segment", UNGATED: "segment"}.get(strategy, strategy)
    options = {"gate_tokens": 0} if strategy == UNGATED else {}
    session = Session(models, translators, active=names[0], strategy=plain, **options)
    results = []
    turn = 0
    gate = ""
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
                        "right": right, "gate": gate})
        session.add(tok.encode("\n")[-1:])
        turn += 1
        gate = session.switch(names[turn % len(names)]).gate
    return results


def evaluate(models: dict, translators: dict, dialogues: int = 20, turns: int = 10,
             strategies=STRATEGIES, progress=None) -> dict:
    """Per strategy and turn: accuracy on question turns, over `dialogues` held-out dialogues
    (keys: turn index, "all", "questions", how many were asked in all, and "gate_fired", the
    share of gated switches the gate sent back to re-reading).
    `progress(done, total, what)` follows the dialogues."""
    table = {}
    for n, strategy in enumerate(strategies):
        pairs = {} if strategy == "reread" else translators
        per_turn: dict[int, list[bool]] = {}
        verdicts = []
        for d in range(dialogues):
            if progress:
                progress(n * dialogues + d, len(strategies) * dialogues, strategy)
            for r in run_dialogue(models, pairs, strategy, HELD_OUT_DIALOGUES + d, turns):
                if r["question"]:
                    per_turn.setdefault(r["turn"], []).append(r["right"])
                if r["gate"] in ("passed", "fired"):
                    verdicts.append(r["gate"] == "fired")
        table[strategy] = {str(t): sum(v) / len(v) for t, v in sorted(per_turn.items())}
        answered = [x for v in per_turn.values() for x in v]
        table[strategy]["all"] = sum(answered) / max(1, len(answered))
        table[strategy]["questions"] = len(answered)
        table[strategy]["gate_fired"] = sum(verdicts) / len(verdicts) if verdicts else None
    return table
