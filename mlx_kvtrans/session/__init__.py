"""Switch sessions: one conversation, several models, one cache line per model.

The active model reads and writes the conversation; while it does, the per-token objects it
caches are recorded, so that on a switch the target receives only the spans it has not seen,
translated and appended to its own cache line. Every switch yields a `SwitchStatus` record
that the chat, the benchmark, the server and the tests all read.

- `line.py`: `CacheLine`, one model's cache and what it recorded, and recorded-span arithmetic;
- `decode.py`: reading and decoding through mlx-lm, recording as the model goes;
- `switching.py`: the switch, planned from values (`plan_switch` -> `SwitchPlan`) and carried out
  (`carry_out`: translation, the fidelity gate, visible fallbacks); `receive_span` does both;
- `status.py`: `SwitchStatus` and its str-valued enums;
- `conversation.py`: `Session`, which holds the conversation and decides what is recorded
  (across tokenizers, as each tokenizer reads it: `alignment.Views`).
"""

from .conversation import STRATEGIES, Session
from .decode import RECORD_POINTS
from .switching import SwitchPlan, receive_span
from .line import CacheLine
from .status import Outcome, SwitchStatus, Verdict

__all__ = ["RECORD_POINTS", "STRATEGIES", "CacheLine", "Outcome", "Session", "SwitchPlan",
           "SwitchStatus", "Verdict", "receive_span"]
