"""Maps of the same input as one matmul.

A translator holds dozens of linear maps of a few feature sets (per target layer and object),
each perhaps with identity tables (a gather of the token's and the previous token's rows, then
a small matmul) and a residual (a small two-layer net). Run one by one, these are small,
memory-bound steps; fused, each feature set is one GEMM near the matmul peak:

    y = x @ W + b,  then map m's columns += [u0[id_t] | u1[id_t-1] | gelu(rms(x) @ up.T)]_m @ V_m

where W holds every map's weight side by side, u0, u1 and up every map's tables and hidden
units side by side (one gather per lag, one matmul for every hidden unit), and V_m stacks map
m's own table and residual rows: they reach its outputs only, so a block-diagonal matmul
does their arithmetic and no more.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .recipes.base import Recipe, gelu


@dataclass
class Block:
    """One map's table and residual terms: its columns of the gathered rows and of the hidden
    units, and what sends them to its own outputs."""

    recipe: Recipe
    start: int  # its first output column
    ranks: slice | None  # its columns of the gathered table rows (either lag)
    hidden: slice | None  # its columns of the hidden units
    weight: mx.array  # (2 x rank + hidden, width): v0, v1 and down.T stacked


@dataclass
class FusedMaps:
    parts: list[tuple[Recipe, str, int]]  # (recipe, part, output width), in column order
    weight: mx.array  # (din, sum of widths)
    bias: mx.array
    tables: tuple[mx.array, mx.array] | None  # every map's u0 and u1 side by side: (V, ranks)
    up: mx.array | None  # every map's residual up rows: (hidden units, din)
    blocks: list[Block]  # the maps with tables or a residual, in column order
    arrays: list[mx.array]  # the parameters it was built from

    def __call__(self, x: mx.array, ids: mx.array | None) -> dict[Recipe, dict[str, mx.array]]:
        """Per recipe, part -> its output."""
        y = mx.addmm(self.bias, x, self.weight)
        now = before = hidden = None
        if self.tables is not None:
            now = self.tables[0][ids]
            before = mx.pad(self.tables[1][ids[:, :-1]], [(0, 0), (1, 0), (0, 0)])
        if self.up is not None:
            hidden = gelu(mx.fast.rms_norm(x, None, 1e-6) @ self.up.T)
        added = {}
        for b in self.blocks:
            terms = [now[..., b.ranks], before[..., b.ranks]] if b.ranks is not None else []
            terms += [hidden[..., b.hidden]] if b.hidden is not None else []
            added[b.recipe] = (b.start, mx.concatenate(terms, axis=-1) @ b.weight)
        start, outputs = 0, {}
        for r, part, width in self.parts:
            out = y[..., start:start + width]
            if r in added:  # its parts' columns lie within its block's
                at, term = added[r]
                out = out + term[..., start - at:start - at + width]
            outputs.setdefault(r, {})[part] = out
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
    parts, weights, biases, blocks = [], [], [], []
    u0, u1, up = [], [], []
    for r in group:
        params = params_of(r)
        start = sum(w.shape[0] for w in weights)
        for part, w, b in r.linear_parts(params):
            parts.append((r, part, w.shape[0]))
            weights.append(w)
            biases.append(b)
        terms = r.added_terms(params)
        if not terms:
            continue
        rows, ranks, hidden = [], None, None
        if "tables" in terms:
            t = terms["tables"]
            at = sum(u.shape[1] for u in u0)
            ranks = slice(at, at + t[0].shape[1])
            u0.append(t[0])
            u1.append(t[2])
            rows += [t[1], t[3]]
        if "residual" in terms:
            u, down = terms["residual"]
            at = sum(h.shape[0] for h in up)
            hidden = slice(at, at + u.shape[0])
            up.append(u)
            rows.append(down.T)
        blocks.append(Block(r, start, ranks, hidden, mx.concatenate(rows)))
    tables = (mx.concatenate(u0, axis=1), mx.concatenate(u1, axis=1)) if u0 else None
    return FusedMaps(parts, mx.concatenate(weights).T, mx.concatenate(biases), tables,
                     mx.concatenate(up) if up else None, blocks, parameters(group, params_of))
