"""Planning: which recipe builds each target object, and which source features it reads.

Source features (`features`), per the hybrid-translation paper's design (`auto`, the default:
`same` for two models of one geometry, else `attention`):
- `attention`: the source's per-token attention objects (GQA keys and values; MLA
  latents and rope keys; indexer keys). A hybrid source (with linear-attention layers) gives
  every map all of its attention layers ("7 MLA latents per token plus token IDs" for
  Kimi-Linear), so one moment matrix serves every map; a source without linear attention gives
  each target layer the `nu` attention layers nearest its relative depth (KV-Lingo 3.1);
- `nearest`: the `nu` nearest attention layers, also for a hybrid source (when all of them are
  too wide, as Qwen3.5-27B's 16 x 2,048);
- `all`: every per-token object of the `nu` nearest layers, linear-attention layers' conv rows
  raw or recurrence inputs normed included, compressed to `width` principal directions when a
  width is given (those rows are 12,288 wide per layer on Kimi-Linear);
- `same`, for two models of one geometry (a new generation, a fine-tune): each object is built
  from the same object of the same source layer: states and conv histories copied, per-token
  objects mapped from their own kind (keys from keys), so that a translator is a few maps of
  the objects' width (LatentPort's copy plus a correction) rather than maps of many layers.
Each object gets the recipe the user names for its kind or name, or the first default that
applies (map for per-token objects and conv histories; copy for a state the source has one like;
replay otherwise).
"""

from __future__ import annotations

from ..layouts import CapturePoint, ModelLayout, ObjectKind
from ..translators.recipes import DEFAULT_ORDER, PlanContext, Recipe, RecipeError, recipe_named


def relative_depth(n_source: int, n_target: int, layer: int, nu: int,
                   candidates: list[int] | None = None) -> tuple[int, ...]:
    """The `nu` source layers (of `candidates`) nearest target `layer`'s relative depth."""
    candidates = list(range(n_source)) if candidates is None else candidates
    centre = (layer + 0.5) / n_target * n_source - 0.5
    nearest = sorted(candidates, key=lambda s: (abs(s - centre), s))[:max(1, nu)]
    return tuple(sorted(nearest))


def feature_layers(source: ModelLayout, point: int) -> list[int]:
    """Source layers with per-token features at `point` (at engine a linear-attention layer holds
    only fixed-size summaries, so it has none)."""
    def readable(o):
        return ((o.per_token and point in o.capture_points)
                or (point == CapturePoint.RAW and o.kind == ObjectKind.CONV_HISTORY)
                or (point == CapturePoint.NORMED and o.kind == ObjectKind.RECURRENT_STATE))
    return [l.index for l in source.layers if any(readable(o) for o in l.objects)]


FEATURES = ("auto", "attention", "nearest", "all", "same")
ATTENTION_KINDS = {ObjectKind.TOKEN_KEY, ObjectKind.TOKEN_VALUE, ObjectKind.MLA_LATENT,
                   ObjectKind.ROPE_KEY, ObjectKind.INDEXER_KEY}


def attention_layers(source: ModelLayout, point: int) -> list[int]:
    """Source layers holding per-token attention objects readable at `point`."""
    return [l.index for l in source.layers
            if any(o.kind in ATTENTION_KINDS and point in o.capture_points for o in l.objects)]


def is_hybrid(layout: ModelLayout) -> bool:
    return any(o.kind in (ObjectKind.CONV_HISTORY, ObjectKind.RECURRENT_STATE)
               for l in layout.layers for o in l.objects)


def feature_sources(source: ModelLayout, n_target: int, layer: int, point: int, nu: int,
                    features: str = "attention") -> tuple[int, ...]:
    """The source layers target `layer`'s maps read, under the `features` design."""
    if features not in FEATURES:
        raise RecipeError(f"features must be {', '.join(FEATURES)}, not {features!r}")
    if features == "same":
        return (layer,)
    if features == "all":
        candidates = feature_layers(source, point)
    else:
        candidates = attention_layers(source, point)
        if not candidates:
            raise RecipeError("the source has no attention layer to read at capture point "
                              f"({point}); use features 'all'")
        if features == "attention" and is_hybrid(source):
            return tuple(candidates)
    return relative_depth(len(source.layers), n_target, layer, nu, candidates)


def same_geometry(source: ModelLayout, target: ModelLayout) -> bool:
    """Whether every layer of the two models holds objects of the same names and shapes."""
    def shapes(layout):
        return [sorted((o.name, o.engine_shape) for o in l.objects) for l in layout.layers]
    return shapes(source) == shapes(target)


def designed(source: ModelLayout, target: ModelLayout, features: str) -> str:
    """`features` as a plan reads it: "auto" is `same` for two models of one geometry (a few
    maps of the objects' width), else `attention`."""
    if features != "auto":
        return features
    return "same" if same_geometry(source, target) else "attention"


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
         split_kv: bool = False, headwise: bool = False, features: str = "auto"
         ) -> list[Recipe]:
    """The recipe of every target object.

    `recipes` names a recipe by object kind or name (e.g. {"recurrent_state": "bilinear"});
    `points` sets the capture point per object kind or name (default `point`); `split_kv` maps
    keys from source keys and values from source values (GQA to GQA), instead of from all source
    objects; `headwise` (with `split_kv`, equal KV head counts) lets target head h read source
    head h only; `features` chooses what the maps read (see above). Raises RecipeError (a
    ValueError) for a request that cannot be met.
    """
    recipes, points = recipes or {}, points or {}
    features = designed(source, target, features)
    per_token = [o for lay in (*source.layers, *target.layers) for o in lay.objects
                 if o.per_token]  # a hybrid's states and conv histories have their own recipes
    same = features == "same"
    if same:
        if not same_geometry(source, target):
            raise RecipeError("features 'same' needs two models of one geometry (the same "
                              "objects, of the same shapes, in every layer)")
        split_kv = all(o.kind in (ObjectKind.TOKEN_KEY, ObjectKind.TOKEN_VALUE)
                       for o in per_token)
    if split_kv and not all(o.kind in (ObjectKind.TOKEN_KEY, ObjectKind.TOKEN_VALUE)
                            for o in per_token):
        raise RecipeError("split K/V maps need GQA keys and values on both sides")
    heads = 0
    if headwise:
        counts = {o.engine_shape[1] for o in per_token}
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

    def point_of(obj):
        return CapturePoint(points.get(obj.name, points.get(obj.kind.value, point)))

    out = []
    for layer in target.layers:
        ctx = PlanContext(source, target,
                          feature_sources(source, len(target.layers), layer.index, point, nu,
                                          features),
                          point_of, lambda l, name: state_source(source, target, l, name),
                          split_kv, heads)
        for obj in layer.objects:
            wanted = recipes.get(obj.name, recipes.get(obj.kind.value))
            if wanted is None and same and not obj.per_token:
                wanted = "copy"  # a state or conv history of the same shape, as it is
            if wanted is not None:
                out.append(recipe_named(wanted).plan(obj, layer.index, ctx))
            else:
                out.append(next(r for cls in DEFAULT_ORDER
                                if (r := cls.default(obj, layer.index, ctx)) is not None))
    return out
