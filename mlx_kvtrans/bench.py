"""Time to first token after a switch: translation versus re-prefill, side by side in one run.

For each prompt length, with medians over repeats:
- warm switch: the source's cache exists (and its per-token objects were recorded while it read);
  translate + install + the target's first decode step;
- cold switch: the source's prefill (recording) + the warm switch. The source reads the prompt
  with the fastest recurrence the device has (`fastest_recurrence`: mlx-lm's Metal kernel on a
  Mac, the chunkwise-parallel form elsewhere), so the figure measures translation, not mlx-lm's
  token loop off Metal;
- gated switch: what a `Session` does (the fidelity gate): all but the last r tokens translated
  and installed, the target reading those r itself, the gate's NLL comparison, first decode step;
- re-prefill: the target reads the whole prompt and produces its first token, in plain mlx-lm
  (what a user of mlx-lm gets: the token loop off Metal). When the target has linear-attention
  layers, `reprefill_chunked_s` is the same prefill under the chunkwise form, so both
  comparisons are visible: cold switch vs re-prefill (what switching saves a user today) and
  cold switch vs chunked re-prefill (same recurrence on both sides);
- bound: the least a warm switch could cost here, measured beside it: (a) the target's first
  decode step on the installed cache alone, (b) the translation's arithmetic at the matmul peak
  measured in the bench's dtype, (c) the installed cache's bytes at the measured memory
  bandwidth. `warm_over_bound` = warm switch / bound.
Peak memory of each path, the translation's arithmetic rate, the BLAS in use and the dtype are
recorded with the timings.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .blas import matmul_gflops, memory_bandwidth_gbs
from .capture import PREFILL_CHUNK, Capture, capture
from .gate import GATE_TOKENS
from .gated_delta import chunked_recurrence, fastest_recurrence
from .install import install
from .instrument import recording_final_rows
from .layouts import CapturePoint, ObjectKind, layout_of
from .translators.token_identity import TokenIdentity
from .translators.cost import layout_widths
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
    # the bound = first_step_s + flops_at_peak_s + bytes_at_bandwidth_s
    first_step_s: float  # (a) the target's first decode step on the installed cache
    flops_at_peak_s: float  # (b) translation flops / matmul peak
    bytes_at_bandwidth_s: float  # (c) install bytes / memory bandwidth
    install_bytes: int
    matmul_peak_gflops: float  # measured in this row, in the bench's dtype
    bandwidth_gbs: float  # measured in this row (bytes read + written)
    reprefill_chunked_s: float | None = None  # target prefill, chunkwise recurrence
    # the switch a Session makes: translate all but the last `gate_tokens`, the target reads
    # those itself, the fidelity gate compares its NLL on them with the source's, first token
    gated_switch_s: float | None = None
    gate_tokens: int = 0

    @property
    def bound_s(self) -> float:
        return self.first_step_s + self.flops_at_peak_s + self.bytes_at_bandwidth_s

    @property
    def warm_over_bound(self) -> float:
        return self.warm_switch_s / self.bound_s

    @property
    def speedup_warm(self) -> float:
        return self.reprefill_s / self.warm_switch_s

    @property
    def speedup_cold(self) -> float:
        return self.reprefill_s / self.cold_switch_s

    @property
    def speedup_gated(self) -> float | None:
        return self.reprefill_s / self.gated_switch_s if self.gated_switch_s else None

    def to_json(self) -> dict:
        return {**asdict(self), "bound_s": self.bound_s, "warm_over_bound": self.warm_over_bound,
                "speedup_warm": self.speedup_warm, "speedup_cold": self.speedup_cold,
                "speedup_gated": self.speedup_gated}


def translation_flops(translator: Translator, length: int, target_layout) -> float:
    """Arithmetic (2 x multiply-adds) of the translator over a `length`-token prompt (a conv
    history maps only the K-1 rows it keeps)."""
    return translator.flops(length, target_layout)


def cache_nbytes(cache: list) -> int:
    """Bytes of every array an mlx-lm cache holds (each object's `state`: the valid rows)."""
    return sum(x.nbytes for _, x in tree_flatten([c.state for c in cache])
               if isinstance(x, mx.array))


def source_prefill(translator: Translator, source, prompt: mx.array, source_layout=None,
                   fast: bool = True) -> Capture:
    """The source reads `prompt`, recording what `translator` reads (with `fast`, under
    `fastest_recurrence`)."""
    with fastest_recurrence() if fast else contextlib.nullcontext():
        return capture(source, prompt, points=translator.source_points(),
                       layout=source_layout or layout_of(source), chunk_size=PREFILL_CHUNK)


def gated_source_prefill(translator: Translator, source, prompt: mx.array, tail: int,
                         source_layout=None) -> tuple[Capture, mx.array]:
    """The source reads `prompt` in two parts, as a Session's source has when a gated switch
    comes: (what it recorded of all but the last `tail` tokens, its state there included; its
    final-norm rows of the last `tail`)."""
    layout = source_layout or layout_of(source)
    head = source_prefill(translator, source, prompt[:, :-tail], layout)
    with fastest_recurrence(), recording_final_rows(source, tail) as rows:
        capture(source, prompt[:, -tail:], points=translator.source_points(), layout=layout,
                cache=head.engine)
    return head, rows.last(tail)


def gated_switch(translator: Translator, head: Capture, source_rows: mx.array, source, target,
                 target_layout, tokens: mx.array) -> float:
    """A Session's switch on `tokens` (1, n + 1), the source having read n: the translation
    of `head`, the target reading the rest of the n itself, the gate's gap, then the first
    token. Returns the gap."""
    from .gate import compare, tail_of

    n, handoff = tokens.shape[1] - 1, head.length
    cache = switch_cache(translator, head, target, target_layout, tokens[:, :handoff])
    with recording_final_rows(target, n - handoff) as rows:
        target(tokens[:, handoff:n], cache=cache)
    ids = tokens[0].tolist()
    reading = compare(source, tail_of(source_rows, n), target, tail_of(rows.last(n - handoff), n),
                      ids, handoff, n)
    first_token(target, tokens[:, n:], cache)
    return reading.gap


def switch_cache(translator: Translator, recorded: Capture, target, target_layout,
                 prompt: mx.array) -> list:
    """Translate the recorded source objects and install them: the target's cache, evaluated."""
    objects, points = translator.translate(recorded, target, target_layout, prompt)
    cache = install(target_layout, objects, points)
    mx.eval([c.state for c in cache])
    return cache


def first_token(target, last: mx.array, cache: list) -> mx.array:
    """The target's first decode step on `cache`: the greedy next token, evaluated."""
    token = mx.argmax(target(last, cache=cache)[:, -1], axis=-1)
    mx.eval(token)
    return token


def _median(fn, repeats: int, setup=None) -> tuple[float, float]:
    """(median seconds, peak MB above what was resident before: the weights and any source
    cache) of `fn` (of `setup()`'s result, built untimed, when given), each run evaluated."""
    times, peaks = [], []
    for _ in range(repeats):
        args = (setup(),) if setup else ()
        mx.clear_cache()
        mx.reset_peak_memory()
        resident = mx.get_active_memory()
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
        peaks.append((mx.get_peak_memory() - resident) / 2**20)
    return statistics.median(times), max(peaks)


def _main_dtype(model) -> mx.Dtype:
    """The dtype holding most of `model`'s parameter bytes."""
    sizes = Counter()
    for _, p in tree_flatten(model.parameters()):
        sizes[p.dtype] += p.nbytes
    return sizes.most_common(1)[0][0]


def bench_switch(translator: Translator, source, target, lengths: list[int], repeats: int = 3,
                 vocab: int | None = None, seed: int = 0, dtype=None,
                 progress=None, gate_tokens: int = GATE_TOKENS) -> list[BenchRow]:
    """TTFT rows for mlx-lm models `source` -> `target` at each prompt length (`dtype`, for the
    matmul peak: default the target's; `gate_tokens`: the gated switch's tail, 0 for none).
    `progress(done, total, what)` follows each measurement."""
    source_layout, target_layout = layout_of(source), layout_of(target)
    target_is_hybrid = ObjectKind.RECURRENT_STATE in target_layout.kinds()
    dtype = dtype or _main_dtype(target)
    translator.prepare()
    vocab = vocab or 256
    rows = []
    phases = (7 if target_is_hybrid else 6) + bool(gate_tokens)
    done = 0

    def step(what: str, length: int):
        nonlocal done
        if progress:
            progress(done, phases * len(lengths), f"{what} at {length:,} tokens")
        done += 1

    for length in lengths:
        step("source prefill", length)
        tokens = mx.random.randint(0, vocab, (1, length), key=mx.random.key(seed + length))
        prompt, last = tokens[:, :-1], tokens[:, -1:]
        recorded = source_prefill(translator, source, prompt, source_layout)

        def translate_only():
            return switch_cache(translator, recorded, target, target_layout, prompt)

        def warm():
            first_token(target, last, translate_only())

        def cold():
            nonlocal recorded
            recorded = source_prefill(translator, source, prompt, source_layout)
            warm()

        def reprefill():  # plain mlx-lm prefill, in the chunks its generation uses
            from mlx_lm.models.cache import make_prompt_cache

            cache = make_prompt_cache(target)
            for start in range(0, prompt.shape[1], PREFILL_CHUNK):
                target(prompt[:, start:start + PREFILL_CHUNK], cache=cache)
                mx.eval([c.state for c in cache])
            first_token(target, last, cache)

        def reprefill_chunked():
            with chunked_recurrence():
                reprefill()

        step("bound", length)
        warm()  # compile and allocate once
        install_bytes = cache_nbytes(translate_only())
        peak = matmul_gflops(dtype=dtype)
        bandwidth = memory_bandwidth_gbs()
        t_translate, _ = _median(translate_only, repeats)
        t_step, _ = _median(lambda cache: first_token(target, last, cache), repeats,
                            setup=translate_only)
        step("warm switch", length)
        t_warm, peak_switch = _median(warm, repeats)
        step("cold switch", length)
        t_cold, _ = _median(cold, repeats)
        tail = min(gate_tokens, prompt.shape[1] - 1)
        t_gated = None
        if tail:
            step("gated switch", length)
            head, source_rows = gated_source_prefill(translator, source, prompt, tail,
                                                     source_layout)

            def gated():
                gated_switch(translator, head, source_rows, source, target, target_layout,
                             tokens)

            gated()  # compile and allocate once
            t_gated, _ = _median(gated, repeats)
        step("re-prefill", length)
        t_full, peak_full = _median(reprefill, repeats)
        if target_is_hybrid:
            step("chunked re-prefill", length)
        t_chunked = _median(reprefill_chunked, repeats)[0] if target_is_hybrid else None
        flops = translation_flops(translator, length, target_layout)
        rows.append(BenchRow(
            length=length, warm_switch_s=t_warm, cold_switch_s=t_cold, reprefill_s=t_full,
            translate_s=t_translate, translate_gflops=flops / t_translate / 1e9,
            peak_mb_switch=peak_switch, peak_mb_reprefill=peak_full,
            first_step_s=t_step, flops_at_peak_s=flops / (peak * 1e9),
            bytes_at_bandwidth_s=install_bytes / (bandwidth * 1e9),
            install_bytes=install_bytes, matmul_peak_gflops=peak, bandwidth_gbs=bandwidth,
            reprefill_chunked_s=t_chunked, gated_switch_s=t_gated, gate_tokens=tail))
        step("done", length)
    if progress:
        progress(done, done, "done")
    return rows


def shaped_translator(source_model, target_model, recipes, source_point=1) -> Translator:
    """A translator with the shapes `fit` would give `recipes`, and random weights: for timing
    models of real checkpoints' sizes, where time depends on shapes only and a closed-form fit
    would hold a (features x features) moment matrix per map (a KDA layer alone reads 12,288).
    Shapes come from the layouts alone: nothing is prefilled."""
    widths = layout_widths(layout_of(source_model), layout_of(target_model), recipes,
                           source_point)
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


def realistic_fit(source_lm, target_lm, config, full_names: tuple[str, str] | None = None,
                  windows: int = 8, length: int = 256, seed: int = 0, progress=None):
    """Fit a translator in closed form on random-weight models of real per-layer sizes (its
    values are meaningless, its cost is real) and project the cost to the full checkpoints'
    layer counts (`full_names`: keys of `zoo.families.FULL`).

    The projection scales `translators.cost.plan_cost`'s model of the fit by how this fit
    measured against that model here. Returns (translator, record)."""
    from .blas import matmul_gflops, memory_bandwidth_gbs
    from .translators.cost import plan_cost
    from .translators.features import input_embedding
    from .translators.fit import fit

    from .errors import KvtransError
    from .translators.cost import fits, gib

    gflops, bandwidth = matmul_gflops(), memory_bandwidth_gbs()
    identity = (input_embedding(target_lm.model).weight.shape[-1]
                if config.token_identity != "off" else 0)
    recipes = config.plan(layout_of(source_lm.model), layout_of(target_lm.model))
    here = plan_cost(source_lm, target_lm, recipes, config.point, identity, gflops, bandwidth)
    if not fits(here):  # refused before any work, not killed by the OS half-way
        raise KvtransError(f"fitting this realistic pair would need about "
                           f"{gib(here.fit_peak_bytes)} of this machine's "
                           f"{gib(here.machine_bytes)} (weights {gib(here.weights_bytes)}, "
                           f"moments {gib(here.moments_bytes)})"
                           + ("; try --token-identity off" if identity else ""))
    vocab = input_embedding(source_lm.model).weight.shape[0]
    batches = [mx.random.randint(0, vocab, (4, length), key=mx.random.key(seed + i))
               for i in range(max(1, windows // 4))]
    translator = fit(source_lm.model, target_lm.model, batches, recipes, config, progress=(
        progress and (lambda i, n: progress(i, len(batches), f"fitting: {n:,} tokens"))))
    measured = translator.info["fit"]
    seconds_per_million = measured["seconds"] / measured["tokens"] * 1e6
    record = {"fit_seconds": measured["seconds"], "fit_tokens": measured["tokens"],
              "fit_peak_memory_bytes": measured["peak_memory_bytes"],
              "projected_peak_memory_bytes": here.fit_peak_bytes,
              "fit_moments_bytes": measured["moments_bytes"],
              "fit_seconds_per_million_tokens": round(seconds_per_million, 1),
              "projected_seconds_per_million_tokens": round(
                  here.fit_seconds_per_million_tokens, 1)}
    if full_names:
        from mlx_lm.utils import _get_classes

        from .models import LoadedModel
        from .zoo.families import full_config

        def lazy(config):  # built, never evaluated: nothing is allocated
            model_class, args_class = _get_classes(config)
            return model_class(args_class.from_dict(config))

        full = [LoadedModel(n, None, lazy(full_config(n)), None, full_config(n))
                for n in full_names]
        source_layout, target_layout = (layout_of(lm.model) for lm in full)
        recipes = config.plan(source_layout, target_layout)
        projected = plan_cost(*full, recipes, config.point, identity, gflops, bandwidth)
        scale = seconds_per_million / max(here.fit_seconds_per_million_tokens, 1e-12)
        record["full"] = {
            "models": list(full_names), "layers": [len(source_layout.layers),
                                                   len(target_layout.layers)],
            "feature_sets": [[f.inputs, f.outputs, f.maps] for f in projected.feature_sets],
            "moments_bytes": projected.moments_bytes,
            "fit_peak_bytes_without_weights": projected.fit_peak_bytes - projected.weights_bytes,
            "fit_seconds_per_million_tokens": round(
                projected.fit_seconds_per_million_tokens * scale, 1),
            "solve_seconds": round(projected.solve_seconds * scale, 1),
            "translation_flops_per_token": projected.translation_flops_per_token}
    return translator, record


def describe_fit(f: dict) -> str:
    """One line for a `realistic_fit` record: measured here, and projected to the full models."""
    projected = f.get("projected_peak_memory_bytes")
    line = (f"{f['fit_tokens']:,} tokens in {f['fit_seconds']:.1f} s, peak "
            f"{f['fit_peak_memory_bytes'] / 2**30:.1f} GiB"
            + (f" (projected {projected / 2**30:.1f} GiB)" if projected else "")
            + f", moments {f['fit_moments_bytes'] / 2**20:.0f} MiB")
    if "full" in f:
        g = f["full"]
        line += (f"; projected to the full checkpoints ({' -> '.join(g['models'])}, "
                 f"{g['layers'][0]} -> {g['layers'][1]} layers): moments "
                 f"{g['moments_bytes'] / 2**30:.2f} GiB, peak without weights "
                 f"{g['fit_peak_bytes_without_weights'] / 2**30:.1f} GiB, "
                 f"{g['fit_seconds_per_million_tokens'] / 3600:.1f} h per million fitting "
                 f"tokens on this machine + {g['solve_seconds']:.0f} s solve, "
                 f"{g['translation_flops_per_token'] / 1e6:.0f} MFLOP per translated token "
                 "(the full configs' FFNs are dense)")
    return line


def realistic_pair(name: str, dtype, token_identity: str, progress=None):
    """Random-weight models with real checkpoints' per-layer sizes, and a translator fitted in
    closed form on them (values meaningless, cost real), with its fit record."""
    from .errors import KvtransError
    from .models import LoadedModel, cast_parameters
    from .translators.fit import FitConfig
    from .zoo.families import REALISTIC_PAIRS, realistic_config
    from .zoo.random_model import build_model

    if name not in REALISTIC_PAIRS:
        raise KvtransError(f"--realistic takes {', '.join(REALISTIC_PAIRS)}")
    models = []
    for i, n in enumerate(REALISTIC_PAIRS[name]):
        config = realistic_config(n, vocab_size=4096)
        model = build_model(config, seed=i)
        cast_parameters(model, dtype)
        models.append(LoadedModel(n, Path("."), model, None, config))
    translator, record = realistic_fit(models[0], models[1],
                                       FitConfig(token_identity=token_identity),
                                       REALISTIC_PAIRS[name], progress=progress)
    return models[0], models[1], translator, record


def plot_switch(result: dict, path: Path) -> Path | None:
    """A PNG of a `kvtrans bench` result (None when matplotlib is absent)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["rows"]
    x = [r["length"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("reprefill_s", "re-prefill"),
                       ("reprefill_chunked_s", "re-prefill (chunked recurrence)"),
                       ("cold_switch_s", "cold switch"),
                       ("warm_switch_s", "warm switch (translate)"),
                       ("gated_switch_s", "gated switch (translate, read the last r, gate)")):
        if all(r.get(key) is not None for r in rows):
            ax.plot(x, [r[key] * 1000 for r in rows], marker="o", label=label)
    if all("bound_s" in r for r in rows):
        ax.plot(x, [r["bound_s"] * 1000 for r in rows], linestyle="--", color="gray",
                label="bound (step + FLOPs at peak + bytes at bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"{result['pair']} · {result['dtype']} · {result['blas']}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
