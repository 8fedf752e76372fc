"""Stage 1: plan a translator for a model pair and fit it in closed form.

Layer assignment: target layer l reads the `nu` source layers nearest its relative depth
(KV-Lingo section 3.1). Each per-token target object gets a token-wise linear map fitted by ridge
regression on streamed second moments; recurrent states get zero / copy / bilinear correction;
conv histories are mapped as per-token rows (or copied when the geometry matches).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterable

import mlx.core as mx
import numpy as np

from ..capture import capture
from ..layouts import ModelLayout, ObjectKind, layout_of
from .attention_weights import recording_attention
from .features import input_embedding, layer_features
from .state import bilinear_r2, fit_bilinear
from .stats import LinearFit, Moments, solve
from .translator import RECIPES, REPLAY_INPUTS, ObjectSpec, Translator

PER_TOKEN = {ObjectKind.TOKEN_KEY, ObjectKind.TOKEN_VALUE, ObjectKind.MLA_LATENT,
             ObjectKind.ROPE_KEY, ObjectKind.INDEXER_KEY}


def relative_depth(n_source: int, n_target: int, layer: int, nu: int,
                   candidates: list[int] | None = None) -> tuple[int, ...]:
    """The `nu` source layers (of `candidates`) nearest target `layer`'s relative depth."""
    candidates = list(range(n_source)) if candidates is None else candidates
    centre = (layer + 0.5) / n_target * n_source - 0.5
    nearest = sorted(candidates, key=lambda s: (abs(s - centre), s))[:max(1, nu)]
    return tuple(sorted(nearest))


def _state_source(source: ModelLayout, target: ModelLayout, layer: int, name: str):
    """The source layer holding a state of the same shape at the nearest relative depth."""
    shape = target.layers[layer].cache.object(name).engine_shape
    same = [l.index for l in source.layers
            if any(o.name == name and o.engine_shape == shape for o in l.objects)]
    if not same:
        return None
    return relative_depth(len(source.layers), len(target.layers), layer, 1, same)[0]


def feature_layers(source: ModelLayout, point: int) -> list[int]:
    """Source layers with per-token features at `point` (at (3) a linear-attention layer holds
    only fixed-size summaries, so it has none)."""
    def readable(o):
        return ((o.per_token and point in o.capture_points)
                or (point == 1 and o.kind == ObjectKind.CONV_HISTORY)
                or (point == 2 and o.kind == ObjectKind.RECURRENT_STATE))
    return [l.index for l in source.layers if any(readable(o) for o in l.objects)]


def plan(source: ModelLayout, target: ModelLayout, point: int = 1, nu: int = 2,
         recipes: dict[str, str] | None = None, points: dict[str, int] | None = None,
         split_kv: bool = False, headwise: bool = False) -> list[ObjectSpec]:
    """Which recipe builds each target object.

    `recipes` overrides by object kind or name (e.g. {"recurrent_state": "bilinear"}); `points`
    sets the capture point per object kind or name (default `point`); `split_kv` maps keys from
    source keys and values from source values (GQA to GQA), instead of from all source objects;
    `headwise` (with `split_kv`, equal KV head counts) lets target head h read source head h only.
    """
    recipes, points = recipes or {}, points or {}
    if split_kv and not all(o.kind in (ObjectKind.TOKEN_KEY, ObjectKind.TOKEN_VALUE)
                            for lay in (*source.layers, *target.layers) for o in lay.objects):
        raise ValueError("split K/V maps need GQA keys and values on both sides")
    heads = 0
    if headwise:
        counts = {o.engine_shape[1] for lay in (*source.layers, *target.layers) for o in lay.objects}
        if not split_kv or len(counts) != 1:
            raise ValueError("head-wise maps need split K/V and the same number of KV heads on "
                             "both sides")
        heads = counts.pop()
    for choice in recipes.values():
        if choice not in RECIPES:
            raise ValueError(f"unknown recipe {choice!r}; recipes: {', '.join(RECIPES)}")
    specs = []
    n_s, n_t = len(source.layers), len(target.layers)
    readable = feature_layers(source, point)
    for layer in target.layers:
        sources = relative_depth(n_s, n_t, layer.index, nu, readable)
        for obj in layer.objects:
            wanted = recipes.get(obj.name, recipes.get(obj.kind.value))
            if obj.kind in PER_TOKEN:
                p = obj.point_for(points.get(obj.name, points.get(obj.kind.value, point)))
                kinds = (obj.kind.value,) if split_kv else ()
                specs.append(ObjectSpec(layer.index, obj.name, "map", p, sources, kinds, heads))
            elif obj.kind == ObjectKind.CONV_HISTORY:
                src = _state_source(source, target, layer.index, obj.name)
                if wanted == "copy" and src is not None:
                    specs.append(ObjectSpec(layer.index, obj.name, "copy", 3, (src,)))
                elif wanted not in (None, "map"):
                    raise ValueError(f"conv history {obj.name} can be mapped, or copied from a "
                                     "source conv history of the same shape")
                else:
                    specs.append(ObjectSpec(layer.index, obj.name, "map", 1, sources))
            else:  # recurrent state: copy when the source has one like it, else replay
                src = _state_source(source, target, layer.index, obj.name)
                choice = wanted or ("copy" if src is not None else "replay")
                if choice in ("copy", "bilinear") and src is None:
                    raise ValueError(f"target layer {layer.index}: no source state of shape "
                                     f"{obj.engine_shape} to {choice}; use replay or zero")
                if choice == "map":
                    raise ValueError("a recurrent state is not per token: zero, copy, bilinear "
                                     "or replay")
                if choice == "replay":
                    specs.append(ObjectSpec(layer.index, obj.name, "replay", 2, sources))
                else:
                    specs.append(ObjectSpec(layer.index, obj.name, choice, 3,
                                            (src,) if choice != "zero" else ()))
    return specs


def _blocks(spec: ObjectSpec, din: int, dout: int, per_layer: int):
    """(moments key, input columns, output rows) of each block a map is fitted as: the whole map,
    or with head-wise maps one block per head: its slice of each source layer's `per_layer`
    features, plus the token-identity columns after them, which every head reads."""
    if not spec.heads:
        return [(spec.key, None, None)]
    n, layers = spec.heads, len(spec.sources)
    d_src, d_tgt = per_layer // n, dout // n
    shared = list(range(layers * per_layer, din))
    return [(f"{spec.key}.h{h}",
             [j * per_layer + h * d_src + c for j in range(layers) for c in range(d_src)] + shared,
             list(range(h * d_tgt, (h + 1) * d_tgt))) for h in range(n)]


def per_token_target(value: mx.array) -> mx.array:
    """A target object as (B, T, D) rows: (3) per-token tensors are (B, heads, T, dim)."""
    if value.ndim == 4:
        B, H, T, D = value.shape
        return value.transpose(0, 2, 1, 3).reshape(B, T, H * D)
    return value


def fit(source_model, target_model, batches: Iterable[mx.array], specs: list[ObjectSpec],
        source_point: int = 1, token_identity: str = "off", ridge: float = 1e-3,
        codebook: mx.array | None = None, progress=None,
        attention_weighted: int = 0) -> Translator:
    """Fit every `map`, `replay` and `bilinear` spec on token `batches` ((B, T) id arrays).

    `attention_weighted` = c > 0: the last c tokens of each window act as a continuation whose
    attention (in the target) weights the prefix tokens' errors; maps of attention layers are
    then fitted on the prefix only.
    """
    source_layout, target_layout = layout_of(source_model), layout_of(target_model)
    shell = Translator(source_point, token_identity, specs, {}, {"replay_shapes": {}})
    moments: dict[str, Moments] = {}
    states: dict[str, tuple[list, list]] = {}
    target_points = {spec.point for spec in specs if spec.recipe in ("map", "replay")} | {3}
    replay_shapes: dict[str, dict[str, list[int]]] = {}
    shapes: dict[str, tuple[int, int, int]] = {}  # map key -> (din, dout, per source layer)
    data_hash = hashlib.sha256()
    tokens_seen = decoded_right = 0
    embed = input_embedding(target_model)
    for i, tokens in enumerate(batches):
        tokens = mx.array(tokens)
        data_hash.update(np.asarray(tokens, dtype=np.int32).tobytes())
        src = capture(source_model, tokens, points=shell.source_points(), layout=source_layout)
        with contextlib.ExitStack() as stack:
            attention = (stack.enter_context(recording_attention(target_model, target_layout,
                                                                  attention_weighted))
                         if attention_weighted else {})
            tgt = capture(target_model, tokens, points=target_points, layout=target_layout)
        identity = None
        if token_identity != "off":
            ids = tokens if token_identity == "ids" else shell.decode(src, codebook)
            decoded_right += int((ids == tokens).sum())
            identity = embed(ids).astype(mx.float32)
        features = shell.features(src)
        for spec in specs:
            if spec.recipe == "map":
                x = spec.features(features, identity)
                y = per_token_target(tgt.objects[spec.layer][(spec.name, spec.point)])
                per_layer = features[(spec.sources[0], spec.source_kinds)].shape[-1]
                shapes[spec.key] = (x.shape[-1], y.shape[-1], per_layer)
                weights = attention.get(spec.layer)
                if weights is not None:  # the prefix, weighted by the continuation's attention
                    x, y = x[:, : weights.shape[1]], y[:, : weights.shape[1]]
                for key, cols, rows in _blocks(spec, *shapes[spec.key]):
                    xb, yb = (x, y) if cols is None else (x[..., cols], y[..., rows])
                    if key not in moments:
                        moments[key] = Moments(xb.shape[-1], yb.shape[-1])
                    moments[key].add(xb, yb, weights)
            elif spec.recipe == "replay":
                x = spec.features(features, identity)
                inputs = tgt.objects[spec.layer][(spec.name, 2)]
                for name in REPLAY_INPUTS:
                    y = getattr(inputs, name)
                    replay_shapes.setdefault(spec.key, {})[name] = list(y.shape[2:])
                    key = f"{spec.key}.{name}"
                    if key not in moments:
                        moments[key] = Moments(x.shape[-1], int(np.prod(y.shape[2:])))
                    moments[key].add(x, y.reshape(*y.shape[:2], -1))
            elif spec.recipe == "bilinear":
                pair = states.setdefault(spec.key, ([], []))
                pair[0].append(np.asarray(src.objects[spec.sources[0]][(spec.name, 3)]))
                pair[1].append(np.asarray(tgt.objects[spec.layer][(spec.name, 3)]))
        tokens_seen += tokens.size
        if progress:
            progress(i + 1, tokens_seen)
    params, metrics = {}, {}
    solutions = {key: solve(m, ridge=ridge) for key, m in moments.items()}
    for spec in specs:  # head-wise blocks -> one block-diagonal map
        if spec.recipe == "map" and spec.heads:
            parts = [(cols, rows, solutions.pop(key))
                     for key, cols, rows in _blocks(spec, *shapes[spec.key])]
            din, dout, _ = shapes[spec.key]
            weight, bias = np.zeros((dout, din), np.float32), np.zeros(dout, np.float32)
            for cols, rows, sol in parts:
                weight[np.ix_(rows, cols)] = sol.weight
                bias[rows] = sol.bias
            r2 = float(np.mean([sol.mean_r2 for _, _, sol in parts]))
            solutions[spec.key] = LinearFit(weight, bias, np.array([r2]), False)
    for key, solution in solutions.items():
        params[f"{key}.weight"] = mx.array(solution.weight)
        params[f"{key}.bias"] = mx.array(solution.bias)
        metrics[key] = {"r2": round(solution.mean_r2, 5), "pinv": solution.used_pinv}
    for key, (s, t) in states.items():
        s, t = np.concatenate(s), np.concatenate(t)
        A, B = fit_bilinear(s, t, ridge=ridge)
        params[f"{key}.A"], params[f"{key}.B"] = mx.array(A), mx.array(B)
        metrics[key] = {"r2": round(bilinear_r2(A, B, s, t), 5),
                        "r2_copy": round(bilinear_r2(np.eye(A.shape[-1]), np.eye(B.shape[-1]),
                                                     s, t), 5)}
    shell.params = params
    shell.info = {"fit": {"stage": 1, "tokens": tokens_seen, "ridge": ridge,
                          "attention_weighted": attention_weighted,
                          "data_sha256": data_hash.hexdigest()},
                  "metrics": metrics, "replay_shapes": replay_shapes}
    if token_identity == "codebook":
        shell.info["fit"]["codebook_decode_accuracy"] = round(decoded_right / tokens_seen, 5)
    return shell


def token_windows(token_ids: list[int], length: int, count: int, batch: int, seed: int = 0):
    """`count` windows of `length` tokens, evenly spread over `token_ids`, in batches."""
    stride = max(1, (len(token_ids) - length) // max(1, count))
    starts = [i * stride for i in range(count) if i * stride + length <= len(token_ids)]
    if not starts:
        raise ValueError(f"the fitting text has {len(token_ids)} tokens: fewer than one window "
                         f"of {length}")
    for i in range(0, len(starts), batch):
        yield mx.array([token_ids[s:s + length] for s in starts[i:i + batch]])


def assign_best_single(source_model, target_model, batches: Iterable[mx.array],
                       specs: list[ObjectSpec], source_point: int = 1,
                       ridge: float = 1e-3) -> tuple[list[ObjectSpec], dict[int, dict]]:
    """Best-single-fit layer assignment: each target layer reads the one source layer whose
    features fit its per-token objects best (mean R^2), instead of relative depth.

    Holds second moments for every (target object, source layer) pair: meant for small models or
    a few layers at a time. Returns the re-assigned specs and the R^2 table per target layer.
    """
    from dataclasses import replace

    source_layout, target_layout = layout_of(source_model), layout_of(target_model)
    maps = [s for s in specs if s.recipe == "map"]
    candidates = range(len(source_layout.layers))
    moments: dict[tuple[str, int], Moments] = {}
    for tokens in batches:
        tokens = mx.array(tokens)
        src = capture(source_model, tokens, points={source_point}, layout=source_layout)
        tgt = capture(target_model, tokens, points={s.point for s in maps}, layout=target_layout)
        for s in candidates:
            for spec in maps:
                try:
                    x = layer_features(src, s, source_point, spec.source_kinds)
                except ValueError:
                    continue  # this source layer has none of the kinds the map reads
                y = per_token_target(tgt.objects[spec.layer][(spec.name, spec.point)])
                key = (spec.key, s)
                if key not in moments:
                    moments[key] = Moments(x.shape[-1], y.shape[-1])
                moments[key].add(x, y)
    table: dict[int, dict[int, float]] = {}
    for (key, s), m in moments.items():
        layer = int(key.split(".")[0])
        table.setdefault(layer, {}).setdefault(s, []).append(solve(m, ridge=ridge).mean_r2)
    scores = {layer: {s: float(np.mean(v)) for s, v in by_source.items()}
              for layer, by_source in table.items()}
    best = {layer: max(by_source, key=by_source.get) for layer, by_source in scores.items()}
    return ([replace(s, sources=(best[s.layer],)) if s.recipe == "map" and s.layer in best else s
             for s in specs], scores)
