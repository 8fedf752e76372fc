"""A translator: per target object, the recipe that builds it from the source's cache.

Recipes (one home each): `map` token-wise linear map (token_map.py math: y = W [x_s1 | ... | x_sv |
emb(id)] + b); `zero`, `copy`, `bilinear` for recurrent states (state.py); conv histories are
per-token rows, so they are mapped (only the last K-1 rows are ever computed) or copied.
Translating reads the source capture once and builds the target's objects layer by layer, each at
its own capture point; `install` then applies the target's own norm, RoPE and positions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx

from ..capture import Capture
from ..layouts import ModelLayout, ObjectKind
from ..layouts.linear_attention import RecurrentInputs
from .features import input_embedding, layer_features
from .state import apply_bilinear, zero_state

RECIPES = ("map", "zero", "copy", "bilinear", "replay")
REPLAY_INPUTS = ("k", "v", "a", "b")  # what the state needs; q only reads it out


@dataclass(frozen=True)
class ObjectSpec:
    layer: int  # target layer
    name: str  # target object
    recipe: str  # one of RECIPES
    point: int  # the target capture point the recipe produces
    sources: tuple[int, ...] = ()  # source layers read (map: features; copy/bilinear: the state)
    source_kinds: tuple[str, ...] = ()  # map: only these source object kinds (split K/V); () = all
    heads: int = 0  # map: 0 = head-mixing; n = head-wise (target head h reads source head h)

    @property
    def key(self) -> str:
        return f"{self.layer}.{self.name}"

    def to_json(self) -> dict:
        return {**asdict(self), "sources": list(self.sources),
                "source_kinds": list(self.source_kinds)}

    @classmethod
    def from_json(cls, data: dict) -> "ObjectSpec":
        return cls(**{**data, "sources": tuple(data["sources"]),
                      "source_kinds": tuple(data.get("source_kinds", ()))})

    def features(self, features: dict, identity) -> mx.array:
        """The map's input: the features of its source layers (+ token identity)."""
        parts = [features[(s, self.source_kinds)] for s in self.sources]
        return mx.concatenate(parts + ([identity] if identity is not None else []), axis=-1)


@dataclass
class Translator:
    source_point: int  # capture point of the source features
    token_identity: str  # off, ids, codebook
    specs: list[ObjectSpec]
    params: dict[str, mx.array]  # "<layer>.<name>.weight|bias|A|B"
    info: dict[str, Any] = field(default_factory=dict)  # manifest fields (pair, fit, metrics)

    def source_reads(self) -> set[tuple[int, tuple[str, ...]]]:
        """(source layer, object kinds) pairs whose features the maps read."""
        return {(s, spec.source_kinds) for spec in self.specs if spec.recipe in ("map", "replay")
                for s in spec.sources}

    def features(self, source: Capture) -> dict:
        return {(s, kinds): layer_features(source, s, self.source_point, kinds)
                for s, kinds in self.source_reads()}

    def source_points(self) -> set[int]:
        """Capture points the source must be read at."""
        points = {self.source_point}
        if any(spec.recipe in ("copy", "bilinear") for spec in self.specs):
            points.add(3)
        if self.token_identity == "codebook":
            from .token_identity import CODEBOOK_POINT
            points.add(CODEBOOK_POINT)
        return points

    def translate(self, source: Capture, target_model, target_layout: ModelLayout,
                  token_ids: mx.array | None = None, codebook: mx.array | None = None,
                  all_rows: bool = False
                  ) -> tuple[list[dict[str, mx.array]], list[dict[str, int]]]:
        """(per target layer: object name -> tensor, per target layer: name -> capture point).

        Conv histories keep K-1 rows, so only those are mapped, unless `all_rows` (a session
        that keeps every token's objects, to translate them onwards later)."""
        B, T = source.tokens.shape
        features = self.features(source)
        identity = None
        if self.token_identity != "off":
            if self.token_identity == "ids":
                ids = token_ids
            else:
                ids = self.decode(source, codebook, token_ids)
            identity = input_embedding(target_model)(ids).astype(mx.float32)
        objects = [{} for _ in target_layout.layers]
        points = [{} for _ in target_layout.layers]
        for layer in target_layout.layers:
            for spec in (s for s in self.specs if s.layer == layer.index):
                obj = layer.cache.object(spec.name)
                objects[spec.layer][spec.name] = self._build(spec, obj, source, features,
                                                             identity, B, all_rows)
                points[spec.layer][spec.name] = spec.point
            mx.eval(list(objects[layer.index].values()))  # stream: one layer at a time
        return objects, points

    def _replay_inputs(self, spec, features, identity):
        """Predicted per-token recurrence inputs (2); install replays the target's recurrence."""
        from mlx_lm.models.gated_delta import normalize_qk

        x = spec.features(features, identity)
        B, T, _ = x.shape
        shapes = self.info["replay_shapes"][spec.key]  # per input: per-token shape
        pred = {}
        for name in REPLAY_INPUTS:
            y = x @ self.params[f"{spec.key}.{name}.weight"].T + self.params[f"{spec.key}.{name}.bias"]
            pred[name] = y.reshape(B, T, *shapes[name])
        k = pred["k"]
        _, k = normalize_qk(k, k, inv_scale=k.shape[-1] ** -0.5, eps=1e-6)  # the target's own
        return RecurrentInputs(mx.zeros_like(k), k, pred["v"], pred["a"], pred["b"])

    def decode(self, source: Capture, codebook: mx.array | None,
               known_ids: mx.array | None = None) -> mx.array:
        """Token ids decoded from the source's layer-0 latent. A span the source holds by
        translation has no latent the source computed itself: there, the known ids stand in."""
        from .token_identity import CODEBOOK_POINT, decode_ids, first_mla_layer

        latent = source.objects[first_mla_layer(source.layout)].get(("latent", CODEBOOK_POINT))
        if latent is None:
            if known_ids is None:
                raise ValueError("the source's capture lacks the layer-0 latent to decode")
            return known_ids
        if codebook is None:
            raise ValueError("codebook token identity needs the source's codebook")
        return decode_ids(latent, codebook)

    def _build(self, spec, obj, source, features, identity, B, all_rows=False):
        if spec.recipe == "map":
            x = spec.features(features, identity)
            if obj.kind == ObjectKind.CONV_HISTORY and not all_rows:
                x = x[:, -(obj.engine_shape[1]):]  # only the rows the history keeps
            y = x @ self.params[f"{spec.key}.weight"].T + self.params[f"{spec.key}.bias"]
            if spec.point == 3:  # (B, T, heads * dim) -> the engine's (B, heads, T, dim)
                _, heads, _, dim = obj.engine_shape
                y = y.reshape(B, -1, heads, dim).transpose(0, 2, 1, 3)
            return y
        if spec.recipe == "zero":
            return zero_state(obj.engine_shape, B)
        if spec.recipe == "replay":
            return self._replay_inputs(spec, features, identity)
        state = source.objects[spec.sources[0]][(spec.name, 3)]  # same geometry: same name
        if spec.recipe == "copy":
            return state
        return apply_bilinear(self.params[f"{spec.key}.A"], self.params[f"{spec.key}.B"], state)


def translate_cache(translator: Translator, source_model, target_model, tokens,
                    codebook: mx.array | None = None) -> list:
    """Prefill `tokens` on the source, translate, and install: mlx-lm caches for the target."""
    from ..capture import capture
    from ..install import install
    from ..layouts import layout_of

    tokens = mx.array(tokens)
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    source = capture(source_model, tokens, points=translator.source_points())
    target_layout = layout_of(target_model)
    objects, points = translator.translate(source, target_model, target_layout, tokens, codebook)
    return install(target_layout, objects, points)
