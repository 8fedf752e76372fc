"""Planning: which recipe builds each target object, and which source layers it reads.

Layer assignment: target layer l reads the `nu` source layers nearest its relative depth
(KV-Lingo section 3.1), among the source layers that have per-token features at the capture
point. Each object gets the recipe the user names for its kind or name, or the first default that
applies (map for per-token objects and conv histories; copy for a state the source has one like;
replay otherwise).
"""

from __future__ import annotations

from ..layouts import CapturePoint, ModelLayout, ObjectKind
from .recipes import DEFAULT_ORDER, PlanContext, Recipe, RecipeError, recipe_named


def relative_depth(n_source: int, n_target: int, layer: int, nu: int,
                   candidates: list[int] | None = None) -> tuple[int, ...]:
    """The `nu` source layers (of `candidates`) nearest target `layer`'s relative depth."""
    candidates = list(range(n_source)) if candidates is None else candidates
    centre = (layer + 0.5) / n_target * n_source - 0.5
    nearest = sorted(candidates, key=lambda s: (abs(s - centre), s))[:max(1, nu)]
    return tuple(sorted(nearest))


def feature_layers(source: ModelLayout, point: int) -> list[int]:
    """Source layers with per-token features at `point` (at (3) a linear-attention layer holds
    only fixed-size summaries, so it has none)."""
    def readable(o):
        return ((o.per_token and point in o.capture_points)
                or (point == CapturePoint.RAW and o.kind == ObjectKind.CONV_HISTORY)
                or (point == CapturePoint.NORMED and o.kind == ObjectKind.RECURRENT_STATE))
    return [l.index for l in source.layers if any(readable(o) for o in l.objects)]


def state_source(source: ModelLayout, target: ModelLayout, layer: int, name: str) -> int | None:
    """The source layer holding an object `name` of the target's shape at the nearest depth."""
    shape = target.layers[layer].cache.object(name).engine_shape
    same = [l.index for l in source.layers
            if any(o.name == name and o.engine_shape == shape for o in l.objects)]
    if not same:
        return None
    return relative_depth(len(source.layers), len(target.layers), layer, 1, same)[0]


def plan(source: ModelLayout, target: ModelLayout, point: int = CapturePoint.RAW, nu: int = 2,
         recipes: dict[str, str] | None = None, points: dict[str, int] | None = None,
         split_kv: bool = False, headwise: bool = False) -> list[Recipe]:
    """The recipe of every target object.

    `recipes` names a recipe by object kind or name (e.g. {"recurrent_state": "bilinear"});
    `points` sets the capture point per object kind or name (default `point`); `split_kv` maps
    keys from source keys and values from source values (GQA to GQA), instead of from all source
    objects; `headwise` (with `split_kv`, equal KV head counts) lets target head h read source
    head h only. Raises RecipeError (a ValueError) for a request that cannot be met.
    """
    recipes, points = recipes or {}, points or {}
    if split_kv and not all(o.kind in (ObjectKind.TOKEN_KEY, ObjectKind.TOKEN_VALUE)
                            for lay in (*source.layers, *target.layers) for o in lay.objects):
        raise RecipeError("split K/V maps need GQA keys and values on both sides")
    heads = 0
    if headwise:
        counts = {o.engine_shape[1] for lay in (*source.layers, *target.layers)
                  for o in lay.objects}
        if not split_kv or len(counts) != 1:
            raise RecipeError("head-wise maps need split K/V and the same number of KV heads on "
                              "both sides")
        heads = counts.pop()
    for choice in recipes.values():
        recipe_named(choice)
    known = {name for lay in target.layers for o in lay.objects for name in (o.name, o.kind.value)}
    for asked in sorted((set(recipes) | set(points)) - known):
        raise RecipeError(f"the target has no object or object kind {asked!r}; it has "
                          f"{', '.join(sorted(known))}")
    point = CapturePoint(point)
    readable = feature_layers(source, point)

    def point_of(obj):
        return CapturePoint(points.get(obj.name, points.get(obj.kind.value, point)))

    out = []
    for layer in target.layers:
        ctx = PlanContext(source, target,
                          relative_depth(len(source.layers), len(target.layers), layer.index, nu,
                                         readable),
                          point_of, lambda l, name: state_source(source, target, l, name),
                          split_kv, heads)
        for obj in layer.objects:
            wanted = recipes.get(obj.name, recipes.get(obj.kind.value))
            if wanted is not None:
                out.append(recipe_named(wanted).plan(obj, layer.index, ctx))
            else:
                out.append(next(r for cls in DEFAULT_ORDER
                                if (r := cls.default(obj, layer.index, ctx)) is not None))
    return out
