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

import math
import statistics
import time
from dataclasses import asdict, dataclass

import mlx.core as mx

from .capture import capture
from .install import install
from .layouts import ObjectKind, layout_of
from .translators.translator import Translator


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
    """Multiply-adds x 2 of the translator's maps over a `length`-token prompt (a conv history
    maps only the K-1 rows it keeps)."""
    total = 0.0
    for spec in translator.specs:
        key = f"{spec.key}.weight"
        if key in translator.params:
            dout, din = translator.params[key].shape
            obj = target_layout.layers[spec.layer].cache.object(spec.name)
            rows = (min(length, obj.engine_shape[1]) if obj.kind == ObjectKind.CONV_HISTORY
                    else length)
            total += 2.0 * din * dout * rows
        for name in ("k", "v", "a", "b"):
            w = translator.params.get(f"{spec.key}.{name}.weight")
            if w is not None:
                total += 2.0 * w.shape[0] * w.shape[1] * length
    return total


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
                 vocab: int | None = None, codebook=None, seed: int = 0) -> list[BenchRow]:
    """TTFT rows for mlx-lm models `source` -> `target` at each prompt length."""
    source_layout, target_layout = layout_of(source), layout_of(target)
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
            objects, pts = translator.translate(recorded, target, target_layout, prompt, codebook)
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


def shaped_translator(source_model, target_model, specs, source_point: int = 1) -> Translator:
    """A translator with the shapes `fit` would give `specs`, and random weights: for timing
    models of real checkpoints' sizes, where time depends on shapes only and a closed-form fit
    would hold a (features x features) moment matrix per map (a KDA layer alone reads 12,288)."""
    from .translators.fit import per_token_target
    from .translators.translator import REPLAY_INPUTS

    tokens = mx.zeros((1, 8), dtype=mx.int32)
    shell = Translator(source_point, "off", specs, {}, {"replay_shapes": {}})
    features = shell.features(capture(source_model, tokens, points=shell.source_points()))
    points = {s.point for s in specs if s.recipe in ("map", "replay")} | {3}
    target = capture(target_model, tokens, points=points)
    key = mx.random.key(0)

    def random(shape):
        return mx.random.normal(shape, key=key) * shape[-1] ** -0.5

    for spec in specs:
        if spec.recipe == "map":
            din = spec.features(features, None).shape[-1]
            dout = per_token_target(target.objects[spec.layer][(spec.name, spec.point)]).shape[-1]
            shell.params[f"{spec.key}.weight"] = random((dout, din))
            shell.params[f"{spec.key}.bias"] = mx.zeros((dout,))
        elif spec.recipe == "replay":
            din = spec.features(features, None).shape[-1]
            inputs = target.objects[spec.layer][(spec.name, 2)]
            shapes = {name: list(getattr(inputs, name).shape[2:]) for name in REPLAY_INPUTS}
            shell.info["replay_shapes"][spec.key] = shapes
            for name, shape in shapes.items():
                dout = math.prod(shape)
                shell.params[f"{spec.key}.{name}.weight"] = random((dout, din))
                shell.params[f"{spec.key}.{name}.bias"] = mx.zeros((dout,))
        elif spec.recipe == "bilinear":
            _, heads, dv, dk = target.objects[spec.layer][(spec.name, 3)].shape
            shell.params[f"{spec.key}.A"] = mx.broadcast_to(mx.eye(dv), (heads, dv, dv))
            shell.params[f"{spec.key}.B"] = mx.broadcast_to(mx.eye(dk), (heads, dk, dk))
    mx.eval(shell.params)
    return shell
