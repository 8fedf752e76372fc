"""The token-wise linear map: per-token target objects (GQA keys and values, MLA latents and rope
keys, indexer keys) and conv-history rows, from the features of the `nu` source layers nearest the
target layer's depth, plus token identity (hybrid-translation paper, "Per-object recipes"):

    y = W [x_s1 | ... | x_snu | emb(id)] + b

fitted by ridge regression on streamed second moments. `split_kv` maps keys from source keys and
values from source values; `heads` = n makes it head-wise (target head h reads source head h
only, plus the token identity): a block-diagonal W fitted block by block. `tables` = r adds
rank-r identity tables of the ids at t and t-1 (`identity_tables`). `residual` = h adds a small
nonlinear term, down(gelu(up(rms(x)))) with h hidden units: it starts at zero (down = 0), so the
closed form is unchanged, and only stage 2 trains it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from ...capture import capture
from ...layouts import CapturePoint, ObjectKind, layout_of
from ..cross_tokenizer import AlignedText, realigned
from ..features import layer_features
from ..identity_tables import LAGS, TableMoments, table_offsets, table_shapes
from ..stats import LinearFit, Moments, solve
from .base import (RMS_EPS, UNEXPANDED, BuildInputs, FitBatch, PlanContext, Recipe,
                   RecipeError, concat_features, gelu)

PER_TOKEN = {ObjectKind.TOKEN_KEY, ObjectKind.TOKEN_VALUE, ObjectKind.MLA_LATENT,
             ObjectKind.ROPE_KEY, ObjectKind.INDEXER_KEY}


def per_token_rows(value: mx.array) -> mx.array:
    """A target object as (B, T, D) rows: engine per-token tensors are (B, heads, T, dim)."""
    if value.ndim == 4:
        B, H, T, D = value.shape
        return value.transpose(0, 2, 1, 3).reshape(B, T, H * D)
    return value


@dataclass(frozen=True)
class TokenMap(Recipe):
    recipe = "map"
    reads_identity = True

    source_kinds: tuple[str, ...] = ()  # only these source object kinds (split K/V); () = all
    heads: int = 0  # 0 = head-mixing; n = head-wise
    tables: int = 0  # rank of the identity tables (0: none)
    residual: int = 0  # hidden width of the residual nonlinearity (0: none)
    expand: bool = True  # whether the translator's random features join its input

    @classmethod
    def plan(cls, obj, layer, ctx: PlanContext) -> "TokenMap":
        if obj.kind in PER_TOKEN:
            kinds = (obj.kind.value,) if ctx.split_kv else ()
            return cls(layer, obj.name, obj.point_for(ctx.point_of(obj)), ctx.sources, kinds,
                       ctx.heads)
        if obj.kind == ObjectKind.CONV_HISTORY:  # its rows are per token at raw
            return cls(layer, obj.name, CapturePoint.RAW, ctx.sources)
        raise RecipeError(f"{obj.name} ({obj.kind.value}) is not per token: zero, copy, "
                          "bilinear or replay")

    @classmethod
    def default(cls, obj, layer, ctx):
        if obj.kind in PER_TOKEN or obj.kind == ObjectKind.CONV_HISTORY:
            return cls.plan(obj, layer, ctx)
        return None

    def feature_reads(self):
        return {(s, self.source_kinds) for s in self.sources}

    def target_points(self):
        return {self.point}

    # -- fitting ----------------------------------------------------------------------------
    def _blocks(self, din: int, dout: int, per_layer: int):
        """(moments key, input columns, output rows) of each block the map is fitted as: the
        whole map, or one block per head: its slice of each source layer's `per_layer`
        features, plus the token-identity columns after them, which every head reads."""
        if not self.heads:
            return [(self.key, None, None)]
        n, layers = self.heads, len(self.sources)
        d_src, d_tgt = per_layer // n, dout // n
        shared = list(range(layers * per_layer, din))
        return [(f"{self.key}.h{h}",
                 [j * per_layer + h * d_src + c for j in range(layers) for c in range(d_src)]
                 + shared,
                 list(range(h * d_tgt, (h + 1) * d_tgt))) for h in range(n)]

    def feature_key(self) -> tuple:
        """What its input is: maps with the same key read the same features."""
        return (self.sources, self.source_kinds) + (() if self.expand else (UNEXPANDED,))

    def accumulate(self, batch: FitBatch, stats: dict) -> None:
        x = concat_features(batch.features, self.sources, self.source_kinds, batch.identity,
                            batch.expand if self.expand else None)
        y = per_token_rows(batch.target.objects[self.layer][(self.name, self.point)])
        per_layer = batch.features[(self.sources[0], self.source_kinds)].shape[-1]
        weights = batch.attention.get(self.layer)
        shared = batch.shared is not None and not self.heads and weights is None
        entry = stats.setdefault(self.key, {"shape": (x.shape[-1], y.shape[-1], per_layer),
                                            "moments": {}, "shared": shared})
        ids = batch.ids
        if weights is not None:  # the prefix, weighted by the continuation's attention
            x, y = x[:, : weights.shape[1]], y[:, : weights.shape[1]]
            ids = None if ids is None else ids[:, : weights.shape[1]]
        if self.tables:
            if ids is None:
                raise RecipeError("identity tables need token identity (ids or codebook)")
            if "tables" not in entry:
                entry["tables"] = TableMoments(batch.vocab, x.shape[-1], y.shape[-1])
            entry["tables"].add(x, y, ids)
        if shared:
            batch.shared.add(self.feature_key(), x, self.key, y)
            return
        for key, cols, rows in self._blocks(*entry["shape"]):
            xb, yb = (x, y) if cols is None else (x[..., cols], y[..., rows])
            if key not in entry["moments"]:
                entry["moments"][key] = Moments(xb.shape[-1], yb.shape[-1])
            entry["moments"][key].add(xb, yb, weights)

    def solve(self, stats, ridge):
        entry = stats[self.key]
        if entry["shared"]:
            fit = stats["shared"].solve(self.feature_key(), self.key, ridge)
        elif not self.heads:
            fit = solve(entry["moments"][self.key], ridge=ridge)
        else:  # head-wise blocks -> one block-diagonal map
            din, dout, _ = entry["shape"]
            weight, bias = np.zeros((dout, din), np.float32), np.zeros(dout, np.float32)
            r2 = []
            for key, cols, rows in self._blocks(*entry["shape"]):
                block = solve(entry["moments"][key], ridge=ridge)
                weight[np.ix_(rows, cols)] = block.weight
                bias[rows] = block.bias
                r2.append(block.mean_r2)
            fit = LinearFit(weight, bias, np.array([float(np.mean(r2))]), False)
        params = {"weight": mx.array(fit.weight), "bias": mx.array(fit.bias)}
        if self.tables:
            params.update(entry["tables"].solve(fit.weight, fit.bias, self.tables))
        if self.residual:
            params.update(self._residual_start(*fit.weight.shape))
        return params, {"": {"r2": round(fit.mean_r2, 5), "pinv": fit.used_pinv}}

    def _residual_start(self, dout: int, din: int) -> dict[str, mx.array]:
        key = mx.random.key(1_000 * self.layer + sum(map(ord, self.name)))
        return {"residual.up": mx.random.normal((self.residual, din), key=key) / din ** 0.5,
                "residual.down": mx.zeros((dout, self.residual))}

    # -- translating ------------------------------------------------------------------------
    def build(self, inputs: BuildInputs, params):
        obj = inputs.target_object
        x = concat_features(inputs.features, self.sources, self.source_kinds, inputs.identity,
                            inputs.expand if self.expand else None)
        start = 0
        if obj.kind == ObjectKind.CONV_HISTORY and not inputs.all_rows:
            # only the rows the history keeps are mapped (each row is its own token's)
            start = max(x.shape[1] - obj.engine_shape[1], 0)
            x = x[:, start:]
        y = x @ params["weight"].T + params["bias"]
        if self.tables:  # from the token before the first row kept, for the previous-token table
            offsets = table_offsets(params, inputs.ids[:, max(start - 1, 0):])
            y = y + (offsets[:, 1:] if start > 0 else offsets)
        if self.residual:
            hidden = gelu(mx.fast.rms_norm(x, None, RMS_EPS) @ params["residual.up"].T)
            y = y + hidden @ params["residual.down"].T
        return self.from_parts(inputs, {"": y})

    def fused_input(self, inputs):
        if inputs.target_object.kind == ObjectKind.CONV_HISTORY and not inputs.all_rows:
            return None  # it maps only the K-1 rows the history keeps
        return self.feature_key()

    def linear_parts(self, params):
        return [("", params["weight"], params["bias"])]

    def added_terms(self, params):
        terms = {}
        if self.tables:
            terms["tables"] = tuple(params[f"table{lag}.{f}"] for lag in LAGS for f in "uv")
        if self.residual:
            terms["residual"] = (params["residual.up"], params["residual.down"])
        return terms

    def from_parts(self, inputs, outputs):
        y = outputs[""]
        if self.point == CapturePoint.ENGINE:  # (B, T, heads * dim) -> (B, heads, T, dim)
            _, heads, _, dim = inputs.target_object.engine_shape
            y = y.reshape(inputs.batch, -1, heads, dim).transpose(0, 2, 1, 3)
        return y

    def param_shapes(self, widths):
        din = sum(widths.features[(s, self.source_kinds)] for s in self.sources)
        din += widths.identity + (widths.expansion if self.expand else 0)
        dout = per_token_rows(widths.target[(self.layer, self.name, self.point)]).shape[-1]
        shapes = {"weight": (dout, din), "bias": (dout,)}
        if self.tables:
            shapes.update(table_shapes(widths.vocab, self.tables, dout))
        if self.residual:
            shapes.update({"residual.up": (self.residual, din),
                           "residual.down": (dout, self.residual)})
        return shapes

    def flops(self, length, shapes, target_object):
        dout, din = shapes["weight"]
        rows = (min(length, target_object.engine_shape[1])
                if target_object.kind == ObjectKind.CONV_HISTORY else length)
        tables = sum(shapes[f"table{lag}.v"][0] for lag in LAGS) if self.tables else 0
        residual = self.residual * (din + dout) / dout
        return 2.0 * (din + tables + residual) * dout * rows


def assign_best_single(source_model, target_model, batches, recipes, source_point=1,
                       ridge: float = 1e-3):
    """Best-single-fit layer assignment: each target layer's maps read the one source layer
    whose features fit its per-token objects best (mean R^2), instead of relative depth.
    `batches`: token ids both models read, or `AlignedText`s of models that tokenize
    differently (the source's features pooled onto the target's tokens).

    Holds second moments for every (target object, source layer) pair: meant for small models or
    a few layers at a time. Returns the re-assigned recipes and the R^2 table per target layer.
    """
    source_layout, target_layout = layout_of(source_model), layout_of(target_model)
    maps = [r for r in recipes if isinstance(r, TokenMap)]
    moments: dict[tuple[TokenMap, int], Moments] = {}
    for batch in batches:
        text = batch if isinstance(batch, AlignedText) else None
        tokens = text.target if text else mx.array(batch)
        src = capture(source_model, text.source if text else tokens, points={source_point},
                      layout=source_layout)
        src = realigned(src, text) if text else src
        tgt = capture(target_model, tokens, points={r.point for r in maps},
                      layout=target_layout)
        for s in range(len(source_layout.layers)):
            for recipe in maps:
                try:
                    x = layer_features(src, s, source_point, recipe.source_kinds)
                except ValueError:
                    continue  # this source layer has none of the kinds the map reads
                y = per_token_rows(tgt.objects[recipe.layer][(recipe.name, recipe.point)])
                if (recipe, s) not in moments:
                    moments[(recipe, s)] = Moments(x.shape[-1], y.shape[-1])
                moments[(recipe, s)].add(x, y)
    table: dict[int, dict[int, list[float]]] = {}
    for (recipe, s), m in moments.items():
        table.setdefault(recipe.layer, {}).setdefault(s, []).append(solve(m, ridge=ridge).mean_r2)
    scores = {layer: {s: float(np.mean(v)) for s, v in by_source.items()}
              for layer, by_source in table.items()}
    best = {layer: max(by_source, key=by_source.get) for layer, by_source in scores.items()}
    return ([replace(r, sources=(best[r.layer],)) if isinstance(r, TokenMap) and r.layer in best
             else r for r in recipes], scores)
