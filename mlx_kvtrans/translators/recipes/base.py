"""What every recipe is: the plan for one target object, and everything about building it.

A recipe instance names a target object (layer, name), the capture point it produces, and the
source layers it reads. Its class owns the rest: when it applies (`plan`, `default`), what it
reads from source and target (`feature_reads`, `source_points`, `target_points`), the statistics
it streams while fitting (`accumulate`) and its closed-form solve (`solve`), how it builds the
target object (`build`), its parameters' shapes and FLOPs, and its manifest entry (`to_json`).
Callers ask the recipe; nothing outside this package tests a recipe's name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar

import mlx.core as mx

from ...capture import Capture
from ...layouts import CacheObject, CapturePoint, ModelLayout


class RecipeError(ValueError):
    """A recipe asked for an object it cannot build."""


@dataclass
class PlanContext:
    """What planning one target layer knows: both layouts and the layer assignment."""

    source: ModelLayout
    target: ModelLayout
    sources: tuple[int, ...]  # the source feature layers assigned to this target layer
    point_of: Callable[[CacheObject], CapturePoint]  # the requested point of a target object
    state_source: Callable[[int, str], int | None]  # a source layer with a same-shaped state
    split_kv: bool = False
    heads: int = 0


@dataclass
class FitBatch:
    """One batch of fitting data, as every recipe's `accumulate` reads it."""

    source: Capture
    target: Capture
    features: dict  # (source layer, kinds) -> (B, T, D) features at the translator's point
    identity: mx.array | None  # (B, T, E) target embeddings of the token ids, or None
    attention: dict[int, mx.array]  # target layer -> (B, prefix) weights (attention-weighted)
    shared: Any = None  # stats.SharedMoments: maps reading the same features share moments
    ids: mx.array | None = None  # (B, T) token ids, with token identity on
    vocab: int = 0  # the target's vocabulary (identity tables' rows)
    expand: Any = None  # RandomFeatures appended to the input of maps that `expand`, or None


@dataclass
class BuildInputs:
    """What building one target object reads."""

    source: Capture
    features: dict
    identity: mx.array | None
    batch: int
    target_object: CacheObject
    all_rows: bool = False  # conv histories: every row, not only the K-1 the engine keeps
    ids: mx.array | None = None  # (B, T) token ids, with token identity on
    expand: Any = None  # RandomFeatures appended to the input of maps that `expand`, or None


# Abramowitz & Stegun 7.1.28: erf(z) = 1 - (1 + a1 z + ... + a6 z^6)^-16 for z >= 0, error <= 3e-7
_ERF_COEFFICIENTS = (0.0705230784, 0.0422820123, 0.0092705272, 0.0001520143, 0.0002765672,
                     0.0000430638)


def gelu(x: mx.array) -> mx.array:
    """`nn.gelu` (x Phi(x), with the exact erf) to within 1e-6 x max(1, |x|): the residual
    term's nonlinearity. On a GPU MLX's own; elsewhere erf by the polynomial below, compiled
    into one kernel: a CPU runs that several times faster than MLX's erf, or than the same
    arithmetic op by op, each op a pass over memory (at the zoo's sizes the residual's
    nonlinearity was most of a translation's time)."""
    if mx.default_device() == mx.gpu:
        import mlx.nn as nn

        return nn.gelu(x)
    return _compiled_polynomial_gelu(x)


def _polynomial_gelu(x: mx.array) -> mx.array:
    """Past |z| = 4 (erf within 2e-8 of 1) z is held there, so nothing overflows and gradients
    stay finite."""
    z = mx.minimum(mx.abs(x) * 0.7071067811865476, 4.0)
    p = z * _ERF_COEFFICIENTS[-1]
    for a in reversed(_ERF_COEFFICIENTS[:-1]):
        p = z * (a + p)
    p = 1.0 + p
    for _ in range(4):
        p = p * p
    erf = mx.sign(x) * (1.0 - 1.0 / p)
    return 0.5 * x * (1.0 + erf)


# MLX builds the kernel with the system's C++ compiler once per machine (cached on disk) and
# runs the ops one by one where it cannot
_compiled_polynomial_gelu = mx.compile(_polynomial_gelu, shapeless=True)


RMS_EPS = 1e-6  # the residual term's rms_norm of its input

UNEXPANDED = "unexpanded"  # ends the feature key of a map that reads no random features


def expanded(feature_key: tuple) -> bool:
    """Whether the maps of this feature key read the translator's random features."""
    return feature_key[-1] != UNEXPANDED


def concat_features(features: dict, sources, kinds, identity, expand=None) -> mx.array:
    """A map's input: the features of its source layers, then the token identity, then (with
    `expand`, a `RandomFeatures`) random features of them."""
    parts = [features[(s, kinds)] for s in sources] + ([identity] if identity is not None else [])
    return mx.concatenate(parts + ([expand(parts)] if expand is not None else []), axis=-1)


@dataclass(frozen=True)
class Recipe:
    recipe: ClassVar[str]  # the name in manifests and on the command line
    reads_identity: ClassVar[bool] = False  # whether token identity joins its input

    layer: int  # target layer
    name: str  # target object
    point: CapturePoint  # the target capture point this recipe produces
    sources: tuple[int, ...] = ()  # source layers it reads

    @property
    def key(self) -> str:
        """Prefix of its parameters and metrics: "layer<L>.<object>" (never a bare number, so
        `tree_flatten` and `nn.average_gradients` read the names as a dict tree)."""
        return f"layer{self.layer}.{self.name}"

    # -- planning ---------------------------------------------------------------------------
    @classmethod
    def plan(cls, obj: CacheObject, layer: int, ctx: PlanContext) -> "Recipe":
        """This recipe for target object `obj`, or RecipeError saying why it cannot build it."""
        raise NotImplementedError

    @classmethod
    def default(cls, obj: CacheObject, layer: int, ctx: PlanContext) -> "Recipe | None":
        """This recipe when it is the default for `obj`; None otherwise."""
        return None

    # -- what it reads ----------------------------------------------------------------------
    def feature_reads(self) -> set[tuple[int, tuple[str, ...]]]:
        """(source layer, object kinds) whose per-token features it reads."""
        return set()

    def source_points(self) -> set[CapturePoint]:
        """Source capture points it reads besides the features' own."""
        return set()

    def target_points(self) -> set[CapturePoint]:
        """Target capture points fitting compares against."""
        return set()

    # -- fitting ----------------------------------------------------------------------------
    def accumulate(self, batch: FitBatch, stats: dict) -> None:
        """Stream one batch into `stats` (this recipe's entries live under `self.key`)."""

    def fitted(self, stats: dict) -> "Recipe":
        """This recipe with what fitting measured about the target (shapes), if anything."""
        return self

    def shaped(self, widths: "Widths") -> "Recipe":
        """This recipe with what `widths` says about the target (shapes), if anything."""
        return self

    def solve(self, stats: dict, ridge: float) -> tuple[dict[str, mx.array], dict[str, Any]]:
        """(parameters by name relative to `key`, metrics by name relative to `key`)."""
        return {}, {}

    # -- translating ------------------------------------------------------------------------
    def build(self, inputs: BuildInputs, params: dict[str, mx.array]):
        raise NotImplementedError

    # -- fused translation: recipes whose work is linear maps of the same input -------------
    def fused_input(self, inputs: BuildInputs) -> tuple | None:
        """A key naming its input when its work is linear maps of that input over every token
        (then maps of the same input run as one matmul); None when it builds otherwise."""
        return None

    def linear_parts(self, params: dict[str, mx.array]) -> list[tuple[str, mx.array, mx.array]]:
        """(part, weight, bias) of each linear map, for a fused input."""
        return []

    def added_terms(self, params: dict[str, mx.array]) -> dict[str, tuple[mx.array, ...]]:
        """Terms added to its single part's output, for a fused input: "tables" (u0, v0, u1,
        v1): u0[id_t] @ v0 + u1[id_t-1] @ v1; "residual" (up, down):
        gelu(rms(x) @ up.T) @ down.T."""
        return {}

    def from_parts(self, inputs: BuildInputs, outputs: dict[str, mx.array]):
        """The target object from each part's output x @ weight.T + bias."""
        raise NotImplementedError

    def param_shapes(self, widths: "Widths") -> dict[str, tuple[int, ...]]:
        """Parameter name (relative to `key`) -> shape."""
        return {}

    def flops(self, length: int, shapes: dict[str, tuple[int, ...]],
              target_object: CacheObject) -> float:
        """Arithmetic (2 x multiply-adds) of building the object from a `length`-token prompt."""
        return 0.0

    # -- manifest ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        data = {"recipe": self.recipe}
        for f in fields(self):
            value = getattr(self, f.name)
            data[f.name] = list(value) if isinstance(value, tuple) else value
        data["point"] = int(self.point)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Recipe":
        names = {f.name for f in fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v
                  for k, v in data.items() if k in names}
        values["point"] = CapturePoint(values["point"])
        return cls(**values)


@dataclass
class Widths:
    """What a translator's parameters are shaped by, measured on a short capture."""

    features: dict[tuple[int, tuple[str, ...]], int]  # (source layer, kinds) -> width
    identity: int  # width of the token-identity embedding (0 when off)
    target: dict[tuple[int, str, int], Any]  # (layer, object, point) -> its value on 8 tokens
    vocab: int = 0  # the target's vocabulary (identity tables)
    expansion: int = 0  # random features appended to the input of maps that `expand` (0: none)
