"""A translator: per target object, the recipe that builds it from the source's cache, the
recipes' parameters, and how it knows token identity.

Translating reads the source capture once and builds the target's objects layer by layer, each at
its own capture point; `install` then applies the target's own norm, RoPE and positions.
`translate(params=...)` is a pure function of the parameters, so distillation differentiates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..capture import RESIDUAL, Capture, join_recorded
from ..errors import KvtransError
from ..layouts import CapturePoint, ModelLayout, layout_of
from ..models import input_embedding
from . import fused
from .features import feature_point, layer_features, projection_name
from .fused import FusedMaps
from .random_features import RandomFeatures
from .recipes import BuildInputs, Recipe
from .recipes.base import concat_features, expanded
from .token_identity import TokenIdentity


@dataclass
class Translator:
    source_point: CapturePoint  # capture point of the source features
    identity: TokenIdentity
    recipes: list[Recipe]
    params: dict[str, mx.array]  # flat: "layer<L>.<object>.<name>"
    info: dict[str, Any] = field(default_factory=dict)  # manifest fields (pair, fit, metrics)
    expansion: RandomFeatures | None = None  # random features of the maps' inputs (`expand`)
    # its measured fidelity per setting (frontier.json beside its weights), for the dial
    frontier: Any = field(default=None, compare=False, repr=False)
    # across tokenizers: (the source's, the target's), bound by `artifact.load` given both
    # models, so that a translation of the target's tokens finds the source's tokens of them
    tokenizers: tuple | None = field(default=None, compare=False, repr=False)
    # fused group -> its FusedMaps, built on first use: a switch then reads the weights once
    # instead of concatenating them first
    _fused: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def token_identity(self) -> str:
        return self.identity.mode

    @property
    def across_tokenizers(self) -> bool:
        """Whether it was fitted between models that tokenize differently."""
        return "alignment" in self.info

    def aligned(self, target_ids: list[int]):
        """The text of the target's `target_ids` as both models read it, each target token's
        source tokens pooled as this translator was fitted (`cross_tokenizer.aligned_ids`)."""
        from .cross_tokenizer import aligned_ids

        if self.tokenizers is None:
            raise KvtransError("this translator translates across tokenizers: load it with both "
                               "models (load_translator(path, source, target)) so that it knows "
                               "their tokenizers")
        return aligned_ids(*self.tokenizers, list(target_ids),
                           self.info["alignment"].get("pooling", "mean"))

    def prepare(self) -> "Translator":
        """Load what is loaded lazily (a source's codebook), so no switch pays for it."""
        if self.identity.mode == "codebook":
            self.identity.first_ids()
        return self

    def params_of(self, recipe: Recipe, params: dict | None = None) -> dict[str, mx.array]:
        """`recipe`'s parameters by their relative names."""
        prefix = recipe.key + "."
        flat = self.params if params is None else params
        return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}

    def parameters(self) -> dict:
        """The parameters as a tree ({"layer3": {"keys": {"weight": ...}}}), float32."""
        return tree_unflatten([(k, v.astype(mx.float32)) for k, v in self.params.items()])

    # -- what it reads ----------------------------------------------------------------------
    def feature_reads(self, recipes: list[Recipe] | None = None
                      ) -> set[tuple[int, tuple[str, ...]]]:
        """(source layer, object kinds) pairs whose features the recipes read."""
        recipes = self.recipes if recipes is None else recipes
        return set().union(*(r.feature_reads() for r in recipes))

    def source_points(self) -> set[CapturePoint]:
        """Capture points the source must be read at."""
        points = {self.source_point} | self.identity.source_points()
        return points.union(*(r.source_points() for r in self.recipes))

    def reads(self, source_layout: ModelLayout) -> set[tuple[int, str, CapturePoint]]:
        """Every per-token (source layer, object, capture point) this translator reads: what a
        session must record of the source while it reads and writes (fixed-size objects it
        reads, such as a copied state, come from the engine cache)."""
        out = set()
        for layer, kinds in self.feature_reads():
            for obj in source_layout.layers[layer].objects:
                if kinds and obj.kind.value not in kinds:
                    continue
                if feature_point(obj, self.source_point) is not None:
                    out.add((layer, obj.name, self.source_point))
        out |= {(j, *RESIDUAL) for j in self.residuals()}
        return out | self.identity.reads(source_layout)

    def residuals(self) -> set[int]:
        """The source layers whose entering hidden state a switch reads: its relay's."""
        from .relay import relay_of

        chosen = relay_of(self)
        return set() if chosen is None else {chosen.source_layer}

    def features(self, source: Capture, params: dict | None = None,
                 recipes: list[Recipe] | None = None) -> dict:
        """(source layer, kinds) -> (B, T, D) features, compressed where fitting compressed
        (those `recipes` read; default all)."""
        flat = self.params if params is None else params
        out = {}
        for s, kinds in self.feature_reads(recipes):
            x = layer_features(source, s, self.source_point, kinds)
            projection = flat.get(projection_name(s))
            out[(s, kinds)] = x if projection is None else x @ projection
        return out

    # -- translating ------------------------------------------------------------------------
    def translate(self, source: Capture, target_model, target_layout: ModelLayout | None = None,
                  token_ids: mx.array | None = None, all_rows: bool = False,
                  params: dict | None = None, layers: Collection[int] | None = None,
                  lap=None) -> tuple[list[dict[str, mx.array]], list[dict[str, int]]]:
        """(per target layer: object name -> tensor, per target layer: name -> capture point).

        `params`: parameters to translate with (flat or a tree; default the translator's own).
        `layers`: only these target layers (a process of a pipeline-sharded target); the
        others are left empty.
        Conv histories keep K-1 rows, so only those are mapped, unless `all_rows` (a session
        that keeps every token's objects, to translate them onwards later).
        `lap(step, arrays)`: see `FusedMaps.__call__`."""
        target_layout = target_layout or layout_of(target_model)
        flat = self.params if params is None else dict(tree_flatten(params))
        recipes = [r for r in self.recipes if layers is None or r.layer in layers]
        features = self.features(source, flat, recipes)
        ids = self.identity.ids(source, token_ids)
        identity = None if ids is None else input_embedding(target_model)(ids).astype(mx.float32)
        if lap:
            lap("features", list(features.values()) + ([] if identity is None else [identity]))
        objects = [{} for _ in target_layout.layers]
        points = [{} for _ in target_layout.layers]
        inputs = {r: BuildInputs(source, features, identity if r.reads_identity else None,
                                 source.tokens.shape[0],
                                 target_layout.layers[r.layer].cache.object(r.name), all_rows,
                                 ids, self.expansion)
                  for r in recipes}
        # maps of the same input run as one matmul (one GEMM at the matmul peak, not dozens)
        groups: dict[tuple, list[Recipe]] = {}
        for r in recipes:
            key = r.fused_input(inputs[r])
            if key is not None:
                groups.setdefault((key, r.reads_identity), []).append(r)
        for key, group in groups.items():
            sources, kinds = key[0][:2]
            maps = self._fused_maps(key, group, flat, keep=params is None)
            x = concat_features(features, sources, kinds, inputs[group[0]].identity,
                                self.expansion if expanded(key[0]) else None)
            outputs = maps(x, inputs[group[0]].ids, lap)
            for r in group:
                objects[r.layer][r.name] = r.from_parts(inputs[r], outputs[r])
                points[r.layer][r.name] = r.point
        for layer in target_layout.layers:
            for r in (r for r in recipes if r.layer == layer.index):
                if r.name not in objects[layer.index]:
                    objects[layer.index][r.name] = r.build(inputs[r], self.params_of(r, flat))
                    points[layer.index][r.name] = r.point
            mx.eval(list(objects[layer.index].values()))
        if lap:
            lap("rest", [])
        return objects, points

    def _fused_maps(self, key, group: list[Recipe], flat: dict, keep: bool) -> FusedMaps:
        """The group's maps fused; built once for its own parameters (`keep`), then reused
        while they are the same arrays."""
        params_of = lambda r: self.params_of(r, flat)  # noqa: E731
        cached = self._fused.get(key) if keep else None
        if cached is not None:
            arrays = fused.parameters(group, params_of)
            if len(arrays) == len(cached.arrays) and all(
                    a is c for a, c in zip(arrays, cached.arrays)):
                return cached
        maps = fused.fuse(group, params_of)
        if keep:
            maps.weight = mx.contiguous(maps.weight)
            self._fused[key] = maps
        return maps

    # -- cost -------------------------------------------------------------------------------
    def param_shapes(self) -> dict[Recipe, dict[str, tuple[int, ...]]]:
        return {r: {name: tuple(v.shape) for name, v in self.params_of(r).items()}
                for r in self.recipes}

    def flops(self, length: int, target_layout: ModelLayout) -> float:
        """Arithmetic (2 x multiply-adds) of translating a `length`-token prompt."""
        shapes = self.param_shapes()
        compression = sum(2.0 * w.shape[0] * w.shape[1] * length
                          for name, w in self.params.items() if name.startswith("features."))
        expansion = 0.0
        if self.expansion is not None:  # one projection per distinct input
            inputs = {r.feature_key(): shape[1] for r in self.recipes
                      if hasattr(r, "feature_key") and expanded(r.feature_key())
                      for name, shape in shapes[r].items() if name.endswith("weight")}
            expansion = length * sum(map(self.expansion.flops, inputs.values()))
        return compression + expansion + sum(
            r.flops(length, shapes[r], target_layout.layers[r.layer].cache.object(r.name))
            for r in self.recipes)


def measured_sink(translator) -> int:
    """The first tokens a translator's target reads itself when handed a conversation from its
    start: what its fit measured (`attention_weights.attention_sink`), 0 where none is recorded."""
    return int((getattr(translator, "info", {}).get("sink") or {}).get("tokens", 0))


def translate_cache(translator: Translator, source_model, target_model, tokens,
                    sink: int | None = None) -> list:
    """Prefill `tokens` on the source, translate, and install: mlx-lm caches for the target.
    Across tokenizers `tokens` are the target's (one row): the source reads its own tokens of
    their text, pooled onto them as the translator was fitted (`cross_tokenizer`).
    Either model may be loaded sharded by mlx-lm (`sharding`): every process then calls this,
    and gets its share of the target's caches.
    `sink` > 0: the target reads the first `sink` tokens itself and the translation covers the
    rest, as a session's switch with that sink does (`session.switching`); None: the
    translator's `measured_sink`."""
    from mlx_lm.models.cache import make_prompt_cache

    from .install import translate_into
    from .sharding import capture_whole

    tokens = mx.array(tokens)
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    if translator.across_tokenizers:
        source = _source_of_text(translator, source_model, tokens)
    else:
        source = capture_whole(source_model, tokens, translator.source_points(),
                               translator.residuals())
    sink = measured_sink(translator) if sink is None else sink
    if not 0 < sink < tokens.shape[1]:
        return translate_into(translator, source, target_model, tokens)[2]
    span = after(source, sink)
    cache = make_prompt_cache(target_model)
    target_model(tokens[:, :sink], cache=cache)
    return translate_into(translator, span, target_model, span.tokens, offset=sink, cache=cache,
                          all_rows=True)[2]


def _source_of_text(translator: Translator, source_model, tokens: mx.array) -> Capture:
    """The source's capture of the text of the target's `tokens` (1, T), its own tokens of it
    read and pooled onto `tokens` as the translator was fitted."""
    from .cross_tokenizer import realigned
    from .sharding import capture_whole

    if tokens.shape[0] != 1:
        raise ValueError("across tokenizers a translation reads one text at a time (batch 1)")
    text = translator.aligned(tokens[0].tolist())
    return realigned(capture_whole(source_model, text.source, translator.source_points()), text)


def after(source: Capture, start: int) -> Capture:
    """What `source` captured of its tokens from `start` on: the per-token objects from there,
    the engine objects (where the prefill ended) as they are."""
    span = Capture(source.layout, source.tokens[:, start:],
                   join_recorded([source], start, source.tokens.shape[1], 0), source.engine)
    for found, whole in zip(span.objects, source.objects):
        found.update({k: v for k, v in whole.items() if k[1] == CapturePoint.ENGINE})
    return span
