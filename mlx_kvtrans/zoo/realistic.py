"""Realistic pairs: random-weight models with real checkpoints' per-layer sizes, and a
translator fitted in closed form on them (its values are meaningless, its cost is real), for
timing a switch (`kvtrans bench --realistic`) and projecting a fit to the full checkpoints."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..backend.blas import matmul_gflops, memory_bandwidth_gbs
from ..errors import KvtransError
from ..layouts import layout_of
from ..models import LoadedModel, cast_parameters, embedding_dims, input_embedding
from ..training.cost import fits, gib, plan_cost
from .families import REALISTIC_PAIRS, full_config, realistic_config


def realistic_fit(source_lm, target_lm, config, full_names: tuple[str, str] | None = None,
                  windows: int = 8, length: int = 256, seed: int = 0, progress=None):
    """Fit a translator in closed form on random-weight models of real per-layer sizes (its
    values are meaningless, its cost is real) and project the cost to the full checkpoints'
    layer counts (`full_names`: keys of `families.FULL`).

    The projection scales `training.cost.plan_cost`'s model of the fit by how this fit
    measured against that model here. Returns (translator, record)."""
    from ..training.fit import fit

    gflops, bandwidth = matmul_gflops(), memory_bandwidth_gbs()
    identity = (embedding_dims(target_lm.model)
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
        from .random_model import unbuilt_model

        full = [LoadedModel(n, None, unbuilt_model(full_config(n)), None, full_config(n))
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


def realistic_configs(name: str) -> dict[str, dict]:
    """The configs of a realistic pair's models (`kvtrans bench --realistic NAME`)."""
    if name not in REALISTIC_PAIRS:
        raise KvtransError(f"--realistic takes {', '.join(REALISTIC_PAIRS)}, not {name!r}")
    return {n: realistic_config(n, vocab_size=4096) for n in REALISTIC_PAIRS[name]}


def realistic_pair(name: str, dtype: str, token_identity: str, progress=None):
    """(translator, source, target, fit record): random-weight models with real checkpoints'
    per-layer sizes in `dtype` (a name: float32, bfloat16, ...), and a translator fitted in
    closed form on them (values meaningless, cost real)."""
    from ..training.fit import FitConfig
    from .random_model import build_model

    realistic_configs(name)  # a known name
    models = []
    for i, n in enumerate(REALISTIC_PAIRS[name]):
        config = realistic_config(n, vocab_size=4096)  # one per side: a pair may name one twice
        model = build_model(config, seed=i)
        decay_as_trained(model, seed=i)
        cast_parameters(model, getattr(mx, dtype))
        models.append(LoadedModel(n, Path("."), model, None, config))
    translator, record = realistic_fit(models[0], models[1],
                                       FitConfig(token_identity=token_identity),
                                       REALISTIC_PAIRS[name], progress=progress)
    return translator, models[0], models[1], record


def trained_dt_bias(shape, key) -> mx.array:
    """A `dt_bias` as flash-linear-attention initialises Gated DeltaNet and KDA layers for
    training: softplus(dt_bias) log-uniform in [0.001, 0.1]."""
    import math

    dt = mx.exp(mx.random.uniform(math.log(1e-3), math.log(1e-1), shape, key=key))
    return dt + mx.log(-mx.expm1(-dt))  # softplus^-1


def decay_as_trained(model, seed: int = 0) -> None:
    """Give `model`'s linear-attention layers the decay rates a trained checkpoint starts from.

    mlx-lm initialises `dt_bias` to zero (KDA) or one (GDN), so nearly every channel forgets
    most of its state at each token, which no trained model does and which makes the
    recurrence's cost unlike a real checkpoint's (`trained_dt_bias`)."""
    key = mx.random.key(seed)
    for _, module in model.named_modules():
        bias = getattr(module, "dt_bias", None)
        if bias is None or getattr(module, "A_log", None) is None:
            continue
        key, sub = mx.random.split(key)
        module.dt_bias = trained_dt_bias(bias.shape, sub).astype(bias.dtype)
    mx.eval(model.parameters())
