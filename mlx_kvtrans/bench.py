"""Time to first token after a switch: translation versus re-prefill, side by side in one run.

For each prompt length, with medians over repeats:
- warm switch: the source's cache exists (and its per-token objects were recorded while it read);
  translate + install + the target's first decode step;
- cold switch: the source's prefill (recording) + the warm switch;
- re-prefill: the target reads the whole prompt and produces its first token.
Peak memory of each path, the translation's arithmetic rate against the machine's measured
matmul peak, the BLAS in use and the dtype are recorded with the timings.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import mlx.core as mx

from .capture import capture
from .install import install
from .layouts import CapturePoint, layout_of
from .translators.token_identity import TokenIdentity
from .translators.translator import Translator, measure_widths


@dataclass
class BenchRow:
    length: int
    warm_switch_s: float
    cold_switch_s: float
    reprefill_s: float
    translate_s: float
    translate_gflops: float
    peak_mb_switch: float
    peak_mb_reprefill: float

    @property
    def speedup_warm(self) -> float:
        return self.reprefill_s / self.warm_switch_s

    @property
    def speedup_cold(self) -> float:
        return self.reprefill_s / self.cold_switch_s

    def to_json(self) -> dict:
        return {**asdict(self), "speedup_warm": self.speedup_warm,
                "speedup_cold": self.speedup_cold}


def translation_flops(translator: Translator, length: int, target_layout) -> float:
    """Arithmetic (2 x multiply-adds) of the translator over a `length`-token prompt (a conv
    history maps only the K-1 rows it keeps)."""
    return translator.flops(length, target_layout)


def _median(fn, repeats: int) -> tuple[float, float]:
    """(median seconds, peak MB above what was resident before: the weights and any source
    cache) of `fn`, each run evaluated to the end."""
    times, peaks = [], []
    for _ in range(repeats):
        mx.clear_cache()
        mx.reset_peak_memory()
        resident = mx.get_active_memory()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        peaks.append((mx.get_peak_memory() - resident) / 2**20)
    return statistics.median(times), max(peaks)


def bench_switch(translator: Translator, source, target, lengths: list[int], repeats: int = 3,
                 vocab: int | None = None, seed: int = 0) -> list[BenchRow]:
    """TTFT rows for mlx-lm models `source` -> `target` at each prompt length."""
    source_layout, target_layout = layout_of(source), layout_of(target)
    translator.prepare()
    points = translator.source_points()
    vocab = vocab or 256
    rows = []
    for length in lengths:
        tokens = mx.random.randint(0, vocab, (1, length), key=mx.random.key(seed + length))
        prompt, last = tokens[:, :-1], tokens[:, -1:]

        def first_token(cache):
            mx.eval(mx.argmax(target(last, cache=cache)[:, -1], axis=-1))

        recorded = capture(source, prompt, points=points, layout=source_layout, chunk_size=2048)

        def translate_only():
            objects, pts = translator.translate(recorded, target, target_layout, prompt)
            cache = install(target_layout, objects, pts)
            mx.eval([c.state for c in cache])
            return cache

        def warm():
            first_token(translate_only())

        def cold():
            nonlocal recorded
            recorded = capture(source, prompt, points=points, layout=source_layout,
                               chunk_size=2048)
            warm()

        def reprefill():  # plain mlx-lm prefill, in the chunks its generation uses
            from mlx_lm.models.cache import make_prompt_cache

            cache = make_prompt_cache(target)
            for start in range(0, prompt.shape[1], 2048):
                target(prompt[:, start:start + 2048], cache=cache)
                mx.eval([c.state for c in cache])
            first_token(cache)

        warm()  # compile and allocate once
        t_translate, _ = _median(translate_only, repeats)
        t_warm, peak_switch = _median(warm, repeats)
        t_cold, _ = _median(cold, repeats)
        t_full, peak_full = _median(reprefill, repeats)
        rows.append(BenchRow(length, t_warm, t_cold, t_full, t_translate,
                             translation_flops(translator, length, target_layout)
                             / t_translate / 1e9,
                             peak_switch, peak_full))
    return rows


def shaped_translator(source_model, target_model, recipes, source_point=1) -> Translator:
    """A translator with the shapes `fit` would give `recipes`, and random weights: for timing
    models of real checkpoints' sizes, where time depends on shapes only and a closed-form fit
    would hold a (features x features) moment matrix per map (a KDA layer alone reads 12,288)."""
    widths = measure_widths(source_model, target_model, recipes, source_point)
    recipes = [r.shaped(widths) for r in recipes]
    key = mx.random.key(0)
    params = {}
    for recipe in recipes:
        for name, shape in recipe.param_shapes(widths).items():
            if name in ("A", "B"):  # a state correction starts at the identity
                value = mx.broadcast_to(mx.eye(shape[-1]), shape)
            elif len(shape) == 1:
                value = mx.zeros(shape)
            else:
                value = mx.random.normal(shape, key=key) * shape[-1] ** -0.5
            params[f"{recipe.key}.{name}"] = value
    mx.eval(params)
    return Translator(CapturePoint(source_point), TokenIdentity(), recipes, params)
