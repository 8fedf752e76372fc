"""Maps of the same input as one matmul.

A translator holds dozens of linear maps of a few feature sets (per target layer and object),
each perhaps with identity tables (a gather of the token's and the previous token's rows, then
a small matmul) and a residual (a small two-layer net). Run one by one, these are small,
memory-bound steps; fused, each feature set is one GEMM near the matmul peak:

    [y | h] = x @ [W | up.T] + [b | 0],  then map m's columns += [u0[id_t] | u1[id_t-1] | g]_m @ V_m

with g = gelu(h / rms(x)) (the residual's rms_norm(x) @ up.T, the norm's scale applied after the
matmul), W every map's weight side by side, up every map's hidden units, u0 and u1 every map's
tables side by side (one gather per lag), and V_m stacking map m's own table and residual rows:
they reach its outputs only. Maps whose terms have one shape (rank, hidden units, width) form a
group whose columns lie together, so the group's terms are one batched matmul, not one small
matmul per map.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .recipes.base import RMS_EPS, Recipe, gelu


@dataclass
class BlockGroup:
    """Maps whose table and residual terms have one shape: their output columns, their columns
    of the gathered table rows and of the hidden units (each a run of equal widths, one per
    map), and what sends those to each map's own outputs."""

    recipes: list[Recipe]
    columns: slice
    ranks: slice | None
    hidden: slice | None
    weight: mx.array  # (maps, 2 x rank + hidden, width): each map's v0, v1 and down.T stacked


@dataclass
class FusedMaps:
    parts: list[tuple[Recipe, str, int]]  # (recipe, part, output width), in column order
    weight: mx.array  # (din, sum of widths + hidden units): the maps' weights, then up.T
    bias: mx.array
    width: int  # sum of the parts' widths: the columns after them are the hidden units
    tables: tuple[mx.array, mx.array] | None  # every map's u0 and u1 side by side: (V, ranks)
    groups: list[BlockGroup]  # the maps with tables or a residual
    arrays: list[mx.array]  # the parameters it was built from

    def __call__(self, x: mx.array, ids: mx.array | None, lap=None
                 ) -> dict[Recipe, dict[str, mx.array]]:
        """Per recipe, part -> its output. `lap(step, arrays)`, when given, follows each step
        with what it made (`research/translate_steps.py` evaluates them there, to time it)."""
        lap = lap or (lambda step, arrays: None)
        y = mx.addmm(self.bias, x, self.weight)
        lap("matmul", [y])
        now = before = hidden = None  # the group terms run on rows of (tokens, columns)
        if self.tables is not None:
            now = self.tables[0][ids].reshape(-1, self.tables[0].shape[1])
            before = mx.pad(self.tables[1][ids[:, :-1]], [(0, 0), (1, 0), (0, 0)])
            before = before.reshape(-1, self.tables[1].shape[1])
            lap("gather", [now, before])
        if y.shape[-1] > self.width:
            scale = mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + RMS_EPS)
            hidden = gelu(y[..., self.width:] * scale).reshape(-1, y.shape[-1] - self.width)
            lap("gelu", [hidden])
        inputs = []
        for g in self.groups:
            n = len(g.recipes)
            terms = [t[:, s].reshape(-1, n, (s.stop - s.start) // n).transpose(1, 0, 2)
                     for t, s in ((now, g.ranks), (before, g.ranks), (hidden, g.hidden))
                     if s is not None]
            inputs.append(mx.concatenate(terms, axis=-1))  # (maps, tokens, K), contiguous
        lap("layout", inputs)
        grouped = {}
        for g, z in zip(self.groups, inputs):
            n, width = len(g.recipes), g.weight.shape[-1]
            base = y[..., g.columns].reshape(-1, n, width).transpose(1, 0, 2)
            total = base + z @ g.weight  # (maps, tokens, width)
            lap("group matmul", [total])
            for i, r in enumerate(g.recipes):
                grouped[r] = total[i].reshape(*y.shape[:-1], width)
        start, outputs = 0, {}
        for r, part, width in self.parts:
            # a grouped map has a single part
            out = grouped[r] if r in grouped else y[..., start:start + width]
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


def _term_shape(recipe: Recipe, params: dict) -> tuple[int, int, int] | None:
    """(table rank, hidden units, width) of a map's added terms, or None without any."""
    terms = recipe.added_terms(params)
    if not terms:
        return None
    rank = terms["tables"][0].shape[1] if "tables" in terms else 0
    hidden = terms["residual"][0].shape[0] if "residual" in terms else 0
    parts = recipe.linear_parts(params)
    if len(parts) != 1:
        raise ValueError(f"{recipe.key}: added terms need a single linear part, not "
                         f"{len(parts)}")
    return rank, hidden, parts[0][1].shape[0]


def fuse(group: list[Recipe], params_of) -> FusedMaps:
    """The fused maps of `group` (recipes of one input, from `Recipe.fused_input`)."""
    params = {r: params_of(r) for r in group}
    shapes = {r: _term_shape(r, params[r]) for r in group}
    kinds = list(dict.fromkeys(s for s in shapes.values() if s is not None))
    # maps with terms first, one run per shape, so that each group's columns lie together
    ordered = [r for kind in kinds for r in group if shapes[r] == kind]
    ordered += [r for r in group if shapes[r] is None]
    parts = []
    weights = []
    biases = []
    u0 = []
    u1 = []
    up = []
    rows = {}
    for r in ordered:
        for part, w, b in r.linear_parts(params[r]):
            parts.append((r, part, w.shape[0]))
            weights.append(w)
            biases.append(b)
        terms = r.added_terms(params[r])
        stacked = []
        if "tables" in terms:
            t = terms["tables"]
            u0.append(t[0])
            u1.append(t[2])
            stacked += [t[1], t[3]]
        if "residual" in terms:
            u, down = terms["residual"]
            up.append(u)
            stacked.append(down.T)
        if stacked:
            rows[r] = mx.concatenate(stacked)
    width = sum(w.shape[0] for w in weights)
    groups = []
    column = 0
    rank_at = 0
    hidden_at = 0
    for rank, hidden, out in kinds:
        members = [r for r in ordered if shapes[r] == (rank, hidden, out)]
        n = len(members)
        groups.append(BlockGroup(
            members, slice(column, column + n * out),
            slice(rank_at, rank_at + n * rank) if rank else None,
            slice(hidden_at, hidden_at + n * hidden) if hidden else None,
            mx.stack([rows[r] for r in members])))
        column += n * out
        rank_at += n * rank
        hidden_at += n * hidden
    tables = (mx.concatenate(u0, axis=1), mx.concatenate(u1, axis=1)) if u0 else None
    weight = mx.concatenate(weights + up).T
    bias = mx.concatenate(biases + ([mx.zeros((hidden_at,), biases[0].dtype)] if up else []))
    return FusedMaps(parts, weight, bias, width, tables, groups,
                     parameters(group, params.__getitem__))
