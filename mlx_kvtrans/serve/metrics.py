"""Counters and histograms of `kvtrans serve`, in Prometheus' text exposition format.

A few dozen lines instead of a client library: the server needs labelled counters, two
histograms and gauges read at scrape time, nothing else.
"""

from __future__ import annotations

import threading
from collections import defaultdict

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

HELP = {
    "kvtrans_requests_total": ("counter", "HTTP requests by path and status code."),
    "kvtrans_histories_total": ("counter", "Generations by model and what became of their "
                                           "history (applied, fallback, reused, none)."),
    "kvtrans_tokens_total": ("counter", "Tokens by model and what happened to them: reused "
                                        "(own cache), translated, reread (by the target: the "
                                        "gate's tail after every applied switch, the whole "
                                        "conversation after a fallback), new (read for the "
                                        "first time), generated."),
    "kvtrans_generations_total": ("counter", "Generations by model and finish reason."),
    "kvtrans_generation_failures_total": ("counter", "Generations that failed inside the "
                                                     "model worker."),
    "kvtrans_time_to_first_token_seconds": ("histogram", "From the request's arrival to its "
                                                         "first generated token."),
    "kvtrans_gate_total": ("counter", "Translated switches by target model and the fidelity "
                                      "gate's verdict (passed, fired: re-read instead, "
                                      "uncalibrated, unchecked, off)."),
    "kvtrans_switch_seconds": ("histogram", "Handing a conversation to another model: "
                                            "translation, or the re-read of a fallback."),
    "kvtrans_cache_bytes": ("gauge", "Bytes held by the conversation cache (caches, recorded "
                                     "objects, checkpoints)."),
    "kvtrans_cache_budget_bytes": ("gauge", "The cache's byte budget (--cache-bytes)."),
    "kvtrans_cache_conversations": ("gauge", "Conversations in the cache."),
    "kvtrans_cache_lines": ("gauge", "Cache lines in the cache, by model."),
    "kvtrans_cache_evictions_total": ("counter", "Cache lines evicted to stay under budget."),
    "kvtrans_queue_depth": ("gauge", "Requests waiting for the model worker."),
    "kvtrans_model_resident": ("gauge", "1 where the model's weights are loaded, by model."),
    "kvtrans_model_loads_total": ("counter", "Models loaded again after an unload."),
    "kvtrans_model_unloads_total": ("counter", "Models unloaded: the memory budget or "
                                               "--idle-unload."),
}


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: tuple) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()  # the worker and the HTTP side both count
        self._counters: dict[str, dict[tuple, float]] = defaultdict(dict)
        self._histograms: dict[str, dict[tuple, list]] = defaultdict(dict)

    def inc(self, name: str, amount: float = 1.0, **labels) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            values = self._counters[name]
            values[key] = values.get(key, 0.0) + amount

    def observe(self, name: str, value: float, **labels) -> None:
        """One observation: per bucket counts, then sum and count."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            slot = self._histograms[name].setdefault(key, [0] * len(BUCKETS) + [0.0, 0])
            for i, bound in enumerate(BUCKETS):
                if value <= bound:
                    slot[i] += 1
            slot[-2] += value
            slot[-1] += 1

    def count_generation(self, model: str, done) -> None:
        """A finished generation (`records.Finished`): its switch, tokens and first token."""
        h = done.history
        self.inc("kvtrans_histories_total", model=model, status=h.status)
        self.inc("kvtrans_generations_total", model=model, finish=done.reason)
        for kind, n in (("reused", h.tokens_reused), ("translated", h.tokens_translated),
                        ("reread", h.tokens_reread), ("new", h.tokens_new),
                        ("generated", done.completion_tokens)):
            self.inc("kvtrans_tokens_total", n, model=model, kind=kind)
        self.observe("kvtrans_time_to_first_token_seconds", h.ttft_seconds, model=model)
        if h.switch:
            self.observe("kvtrans_switch_seconds", h.switch.translate_seconds, status=h.status)
            if h.switch.gate:
                self.inc("kvtrans_gate_total", model=model, verdict=h.switch.gate)

    def value(self, name: str, **labels) -> float:
        with self._lock:
            return self._counters[name].get(tuple(sorted(labels.items())), 0.0)

    def render(self, gauges: dict[str, dict[tuple, float]]) -> str:
        """Every metric with its HELP and TYPE; `gauges`: name -> labels -> value, read now."""
        lines = []
        with self._lock:
            series = {**{n: dict(v) for n, v in self._counters.items()}, **gauges}
            histograms = {n: {k: list(s) for k, s in v.items()}
                          for n, v in self._histograms.items()}
        for name, (kind, text) in HELP.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            if kind == "histogram":
                for key, slot in histograms.get(name, {}).items():
                    for bound, count in zip(BUCKETS, slot):
                        lines.append(f"{name}_bucket{_labels(key + (('le', bound),))} {count}")
                    lines.append(f"{name}_bucket{_labels(key + (('le', '+Inf'),))} {slot[-1]}")
                    lines.append(f"{name}_sum{_labels(key)} {slot[-2]:.6f}")
                    lines.append(f"{name}_count{_labels(key)} {slot[-1]}")
                continue
            for key, value in series.get(name, {}).items():
                lines.append(f"{name}{_labels(key)} {_number(value)}")
        return "\n".join(lines) + "\n"


def engine_gauges(engine) -> dict[str, dict[tuple, float]]:
    """The gauges of an `Engine`, read at scrape time."""
    stats = engine.store.stats()
    models = engine.models
    return {"kvtrans_cache_bytes": {(): stats["bytes"]},
            "kvtrans_cache_budget_bytes": {(): engine.store.budget_bytes},
            "kvtrans_cache_conversations": {(): stats["conversations"]},
            "kvtrans_cache_lines": {(("model", n),): stats["lines"].get(n, 0) for n in models},
            "kvtrans_cache_evictions_total": {(): stats["evictions"]},
            "kvtrans_queue_depth": {(): engine.queue_depth},
            "kvtrans_decoding": {(("model", n),): float(k)
                                 for n, k in engine.batches.sizes.items()},
            "kvtrans_model_resident": {(("model", n),): float(engine.residency.is_resident(n))
                                       for n in models},
            "kvtrans_model_loads_total": {(): engine.residency.loads},
            "kvtrans_model_unloads_total": {(): engine.residency.unloads}}
