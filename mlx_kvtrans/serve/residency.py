"""Which served models hold their weights, under a memory budget.

A 48B and a 16B model together are most of a Mac's memory, and a server may list more models
than fit. Each served model keeps its module, tokenizer and config for the server's life; only
its weights come and go. The models are loaded lazily: at start, those that fit the budget in
the order given read their weights, the others none. A request loads what it needs (the model
it asks for, and the one its conversation is switched from), unloading the least recently
used others until the weights fit the budget; a model unused for `idle_unload` seconds is
unloaded too. Weights go by
replacing every parameter with an empty array in place (the module objects, which cache
layouts and hooks refer to, stay), then `mx.clear_cache()`; they come back by loading the
checkpoint again and updating the same module. Conversation caches are not weights: a
conversation whose model was unloaded keeps its cache line (under `--cache-bytes`) and goes on
from it when the model is back.

All of it runs on the engine's compute thread.
"""

from __future__ import annotations

import gc
from collections import Counter
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from ..errors import KvtransError


def resident_bytes(model) -> int:
    """Bytes the model's parameters hold now."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@dataclass
class Residency:
    """`models`: name -> LoadedModel (loaded); `budget_bytes`: what their weights may hold
    together (None: no limit); `idle_unload`: seconds unused before a model is unloaded
    (None: never)."""

    models: dict
    budget_bytes: int | None = None
    idle_unload: float | None = None
    sizes: dict = field(default_factory=dict)  # name -> its weights' bytes when loaded
    resident: dict = field(default_factory=dict)  # name -> time of its last use
    loads: int = 0
    unloads: int = 0
    held: Counter = field(default_factory=Counter)  # name -> requests using it now
    loading: str | None = None  # the model whose weights are being read now
    load_rate: float = 1e9  # bytes a second the last load read (a first guess before one)

    def __post_init__(self):
        # sizes from shapes: lazily loaded weights are not read for it
        self.sizes = {name: resident_bytes(lm.model) for name, lm in self.models.items()}
        largest = sorted(self.sizes.values(), reverse=True)[:2]
        if self.budget_bytes is not None and self.budget_bytes < sum(largest):
            raise KvtransError(f"--memory-budget {self.budget_bytes / 2**30:.2f} GiB holds fewer "
                               f"than the two largest models' weights "
                               f"({sum(largest) / 2**30:.2f} GiB), which a switch needs")
        now, held = time.monotonic(), 0
        for name in self.models:  # the first that fit, in the order given
            if self.budget_bytes is None or held + self.sizes[name] <= self.budget_bytes:
                self.resident[name] = now
                held += self.sizes[name]
            else:
                _empty(self.models[name].model)  # never read
        mx.eval([self.models[name].model.parameters() for name in self.resident])

    def expected_load_seconds(self, name: str) -> float:
        """How long loading `name` should take, at the rate the last load read."""
        return self.sizes[name] / self.load_rate

    def is_resident(self, name: str) -> bool:
        return name in self.resident

    def ensure(self, *names: str) -> float:
        """Load `names` where they are not resident (unloading others to fit the budget) and
        mark them used; returns the seconds spent loading."""
        started, loading = time.perf_counter(), 0.0
        for name in names:
            if name not in self.resident:
                self.fit_budget(keep=set(names), adding=self.sizes[name])
                self._load(name)
                loading = time.perf_counter() - started
            self.resident[name] = time.monotonic()
        return loading

    def hold(self, name: str) -> None:
        """A request uses `name` from now until `release`: it is not unloaded meanwhile."""
        self.held[name] += 1

    def release(self, name: str) -> None:
        self.held[name] -= 1
        if self.held[name] <= 0:
            del self.held[name]
        if name in self.resident:
            self.resident[name] = time.monotonic()

    def fit_budget(self, keep: set[str], adding: int = 0) -> None:
        """Unload the least recently used models outside `keep` until the resident weights
        and `adding` more fit the budget."""
        if self.budget_bytes is None:
            return
        while sum(self.sizes[n] for n in self.resident) + adding > self.budget_bytes:
            others = [n for n in self.resident if n not in keep and n not in self.held]
            if not others:
                return
            self.unload(min(others, key=self.resident.get))

    def unload_idle(self) -> list[str]:
        """Unload the models unused for `idle_unload` seconds; returns their names."""
        if self.idle_unload is None:
            return []
        now = time.monotonic()
        idle = [n for n, used in self.resident.items()
                if now - used >= self.idle_unload and n not in self.held]
        for name in idle:
            self.unload(name)
        return idle

    def unload(self, name: str) -> None:
        _empty(self.models[name].model)
        del self.resident[name]
        gc.collect()
        mx.clear_cache()
        self.unloads += 1

    def _load(self, name: str) -> None:
        from ..models import load

        self.loading, started = name, time.perf_counter()
        try:
            fresh = load(self.models[name].name)
            self.models[name].model.update(fresh.model.parameters())
            mx.eval(self.models[name].model.parameters())
            del fresh
        finally:
            self.loading = None
        self.load_rate = self.sizes[name] / max(time.perf_counter() - started, 1e-3)
        self.loads += 1


def _empty(model) -> None:
    """Replace every parameter of `model` by an empty array, in place (evaluated: an array
    left lazy on one thread cannot be computed on another)."""
    model.update(tree_map(lambda v: mx.zeros((0,), v.dtype), model.parameters()))
    mx.eval(model.parameters())
