"""What `kvtrans serve` serves: its configuration, and the models and translators it loads.

Translation needs shared token ids, so models are grouped by vocabulary; between the models of
a group, each given translator serves the pairs it was fitted on and the shipped ones fill the
rest. A pair left without one re-reads on a switch, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import KvtransError
from ..session import dial
from ..translators.alignment import tokenizer_groups

DEFAULT_MODELS = ("kimi-linear", "kimi-vl")
DEFAULT_CONTEXT = 32768  # for a config that does not say how long its context is


@dataclass
class ServeConfig:
    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    translators: list[str] = field(default_factory=list)  # directories or shipped names
    host: str = "127.0.0.1"
    port: int = 8080
    cache_bytes: int = 4 << 30
    translate: bool = True
    translate_ahead: bool = True  # between turns, hand conversations to the other models ahead
    memory_budget: int | None = None  # the models' weights together (None: the machine's memory
    idle_unload: float | None = None  # less the cache budget); seconds unused before unloading
    # seconds a request waits for its model to load before a 503 with Retry-After (the load
    # goes on, so the retry finds the model)
    load_deadline: float = 30.0
    default_max_tokens: int = 512  # a chat reply's length when the request gives none
    # a request's temperature when it gives none: greedy, as mlx-lm's server (`--temp`), so a
    # reply reads like the text the fidelity gate was calibrated on
    temperature: float = 0.0
    max_body_bytes: int = 8 << 20
    reread: int | None = None  # the fidelity dial (session/dial.py): a fixed R, or
    fidelity: float | None = None  # an agreement each switch meets
    sink: int | None = None  # first tokens a model given a conversation from its start reads
    # itself; None: each translator's measured sink
    recompute: int | None = None  # the target's first layers that read a translated span
    # themselves; None: as the dial's setting has it
    shard: str | None = None  # under mlx.launch: "tensor" or "pipeline" (sharding.py)
    # sharded: seconds process 0, told to stop, lets its request in flight finish before it
    # ends (a process of the group that died can leave it waiting in a collective); the other
    # processes wait twice this for process 0's end
    grace: float = 30.0

    def check(self) -> None:
        if not self.models:
            raise KvtransError("serve at least one --model")
        if len(set(self.models)) != len(self.models):
            raise KvtransError(f"--model names a model twice: {', '.join(self.models)}")
        if not 0 <= self.port <= 65535:
            raise KvtransError(f"--port {self.port}: a port is 0-65535")
        if self.cache_bytes < 0:
            raise KvtransError(f"--cache-bytes {self.cache_bytes}: must be 0 or more")
        if self.default_max_tokens < 1:
            raise KvtransError(f"--max-tokens {self.default_max_tokens}: must be at least 1")
        if self.max_body_bytes < 1:
            raise KvtransError(f"--max-body-bytes {self.max_body_bytes}: must be at least 1")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise KvtransError(f"--memory-budget {self.memory_budget}: must be more than 0")
        if self.idle_unload is not None and not self.idle_unload > 0:
            raise KvtransError(f"--idle-unload {self.idle_unload}: seconds, more than 0")
        if not self.load_deadline >= 0:
            raise KvtransError(f"--load-deadline {self.load_deadline}: seconds, 0 or more")
        if not self.grace > 0:
            raise KvtransError(f"--grace {self.grace}: seconds, more than 0")
        if self.shard not in (None, "tensor", "pipeline"):
            raise KvtransError(f"--shard {self.shard}: tensor or pipeline")
        if self.shard and (self.memory_budget is not None or self.idle_unload is not None):
            raise KvtransError(f"--shard keeps every model resident on every process: "
                               f"--{'memory-budget' if self.memory_budget is not None else 'idle-unload'}"
                               f" cannot go with it")
        if dial.problem(self.reread, self.fidelity):
            raise KvtransError(dial.problem(self.reread, self.fidelity, "--"))


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '2GiB', '1.5G' -> bytes (K/M/G/T, decimal or binary alike: 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    unit = s[-1] if s and s[-1] in units else ""
    try:
        value = float(s[:-1] if unit else s)
    except ValueError:
        raise KvtransError(f"{text!r} is not a size (e.g. 4294967296, 512M, 4GiB)") from None
    return int(value * units[unit])


def load_models(names: list[str], shard: str | None = None, group=None) -> dict:
    """The served models, their weights lazy: read from disk when the server makes them
    resident (`Residency`), so no more than the budget is ever held. With `shard`, each is
    sharded that way across the processes of `group` first, so a process reads only its
    share."""
    from ..models import load
    from ..translators.sharding import shard_model

    models = {name: load(name, lazy=True) for name in names}
    if shard:
        for name, lm in models.items():
            shard_model(lm.model, shard, group, name)
    return models


def find_translators(models: dict, given: list[str]) -> tuple[dict, list[str]]:
    """Translators between the served models: each given one for the pairs it was fitted on,
    the shipped one (distilled first) for the other pairs. Returns them and notes on the pairs
    left without (switching that way re-reads)."""
    from ..translators import artifact

    groups = tokenizer_groups(models)
    pairs = [(a, b) for a in models for b in models if a != b]
    found, notes = {}, []
    for name in given:
        path = artifact.resolve(name)
        manifest = artifact.read_manifest(path)
        fits = []
        for a, b in pairs:
            try:
                artifact.check_pair(manifest, models[a], models[b])
            except KvtransError:
                continue
            fits.append((a, b))
        if not fits:
            raise KvtransError(f"--translator {name} was fitted for {manifest['source']['name']} "
                               f"-> {manifest['target']['name']}, not a pair of the served "
                               f"models ({', '.join(models)})")
        for a, b in fits:  # across tokenizers too: a session reads each model's own tokens
            found[(a, b)] = artifact.load(path, models[a], models[b])
    for a, b in pairs:
        if (a, b) in found:
            continue
        path = artifact.shipped_for(models[a], models[b])
        if path is None:
            notes.append(f"no translator {a} -> {b}: switching that way re-reads"
                         + (" (they have different tokenizers)" if groups[a] != groups[b]
                            else ""))
            continue
        try:
            found[(a, b)] = artifact.load(path, models[a], models[b])
        except KvtransError as e:
            notes.append(f"translator {path.name} not used ({e}): switching {a} -> {b} re-reads")
    notes += [f"translator {a} -> {b}: {t.info['fitted_on']}" for (a, b), t in found.items()
              if t.info.get("fitted_on")]
    return found, notes


def context_length(lm) -> int:
    config = lm.config
    return int(config.get("max_position_embeddings")
               or config.get("text_config", {}).get("max_position_embeddings")
               or DEFAULT_CONTEXT)
