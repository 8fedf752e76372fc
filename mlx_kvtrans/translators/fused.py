"""Maps of the same input as one matmul.

A translator holds dozens of linear maps of a few feature sets (per target layer and object),
each perhaps with identity tables (a gather of the token's and the previous token's rows, then
a small matmul) and a residual (a small two-layer net). Run one by one, these are small,
memory-bound steps; fused, each feature set is one GEMM near the matmul peak:

    y = [x | u0[id_t] | u1[id_t-1] | gelu(rms(x) @ up.T)] @ W + b

where u0, u1 and up hold every map's tables and hidden units side by side (one gather per lag)
and W stacks every map's weight over block rows that send each map's table and residual
columns to its own outputs only.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .recipes.base import Recipe, gelu


@dataclass
class FusedMaps:
    parts: list[tuple[Recipe, str, int]]  # (recipe, part, output width), in column order
    weight: mx.array  # (din + table ranks + hidden units, sum of widths)
    bias: mx.array
    tables: tuple[mx.array, mx.array] | None  # every map's u0 and u1 side by side: (V, ranks)
    up: mx.array | None  # every map's residual up rows: (hidden units, din)
    arrays: list[mx.array]  # the parameters it was built from

    def __call__(self, x: mx.array, ids: mx.array | None) -> mx.array:
        features = [x]
        if self.tables is not None:
            now, before = self.tables
            features += [now[ids], mx.pad(before[ids[:, :-1]], [(0, 0), (1, 0), (0, 0)])]
        if self.up is not None:
            features.append(gelu(mx.fast.rms_norm(x, None, 1e-6) @ self.up.T))
        # one matmul per feature block, each adding into the output: the same sum as one
        # matmul of the concatenated features, without writing that (T, din + ...) copy
        y, start = self.bias, 0
        for f in features:
            y = mx.addmm(y, f, self.weight[start:start + f.shape[-1]])
            start += f.shape[-1]
        return y

    def split(self, y: mx.array) -> dict[Recipe, dict[str, mx.array]]:
        """Per recipe, part -> its columns of `y`."""
        start, outputs = 0, {}
        for r, part, width in self.parts:
            outputs.setdefault(r, {})[part] = y[..., start:start + width]
            start += width
        return outputs


def parameters(group: list[Recipe], params_of) -> list[mx.array]:
    """Every array a fused group is built from, in a fixed order (`params_of(r)`: a recipe's
    parameters), to tell whether a cached fusion is current."""
    out = []
    for r in group:
        params = params_of(r)
        out += [a for _, w, b in r.linear_parts(params) for a in (w, b)]
        out += [a for term in r.added_terms(params).values() for a in term]
    return out


def fuse(group: list[Recipe], params_of) -> FusedMaps:
    """The fused maps of `group` (recipes of one input, from `Recipe.fused_input`)."""
    parts, weights, biases, owners = [], [], [], []
    for r in group:
        params = params_of(r)
        start = sum(w.shape[0] for w in weights)
        for part, w, b in r.linear_parts(params):
            parts.append((r, part, w.shape[0]))
            weights.append(w)
            biases.append(b)
        owners.append((r.added_terms(params), start, sum(w.shape[0] for w in weights) - start))
    total = sum(w.shape[0] for w in weights)

    def placed(rows: mx.array, start: int, width: int) -> mx.array:
        """(k, width) rows as (k, total): zero outside the owner's output columns."""
        return mx.pad(rows, [(0, 0), (start, total - start - width)])

    blocks = [mx.concatenate(weights).T]
    tables = up = None
    with_tables = [(t["tables"], s, w) for t, s, w in owners if "tables" in t]
    if with_tables:
        tables = tuple(mx.concatenate([t[2 * lag] for t, _, _ in with_tables], axis=1)
                       for lag in (0, 1))
        blocks += [placed(t[2 * lag + 1], s, w) for lag in (0, 1) for t, s, w in with_tables]
    with_residual = [(t["residual"], s, w) for t, s, w in owners if "residual" in t]
    if with_residual:
        up = mx.concatenate([u for (u, _), _, _ in with_residual])
        blocks += [placed(down.T, s, w) for (_, down), s, w in with_residual]
    weight = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks)
    return FusedMaps(parts, weight, mx.concatenate(biases), tables, up,
                     parameters(group, params_of))
