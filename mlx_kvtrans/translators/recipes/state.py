"""Recurrent-state recipes (hybrid-translation paper, "State strategies"), and the conv-history
copy:

- zero: the target's state starts empty (the baseline);
- copy: the source's final state (or conv history), when the geometries match;
- bilinear: copy with a correction S_h -> A_h S_h B_h per value head, A_h (Dv x Dv) and
  B_h (Dk x Dk) fitted in closed form by alternating ridge passes over (source, target) pairs.
(Replay, which predicts the target's per-token recurrence inputs and runs its own recurrence,
is in replay.py.)
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...layouts import CapturePoint, ObjectKind
from .base import PlanContext, Recipe, RecipeError


def _conv_refusal(obj) -> RecipeError:
    return RecipeError(f"conv history {obj.name} can be mapped, or copied from a source conv "
                       "history of the same shape")


def _require_state(obj) -> None:
    if obj.kind != ObjectKind.RECURRENT_STATE:
        raise (_conv_refusal(obj) if obj.kind == ObjectKind.CONV_HISTORY else
               RecipeError(f"{obj.name} ({obj.kind.value}) is per token: map it"))


def _same_state_source(cls, obj, layer, ctx: PlanContext) -> int:
    src = ctx.state_source(layer, obj.name)
    if src is None:
        if obj.kind == ObjectKind.CONV_HISTORY:
            raise _conv_refusal(obj)
        raise RecipeError(f"target layer {layer}: no source state of shape {obj.engine_shape} "
                          f"to {cls.recipe}; use replay or zero")
    return src


@dataclass(frozen=True)
class Zero(Recipe):
    recipe = "zero"

    @classmethod
    def plan(cls, obj, layer, ctx):
        _require_state(obj)
        return cls(layer, obj.name, CapturePoint.ENGINE)

    def build(self, inputs, params):
        shape = inputs.target_object.engine_shape
        return mx.zeros((inputs.batch, *shape[1:]), dtype=mx.float32)


@dataclass(frozen=True)
class Copy(Recipe):
    recipe = "copy"

    @classmethod
    def plan(cls, obj, layer, ctx):
        if obj.kind not in (ObjectKind.RECURRENT_STATE, ObjectKind.CONV_HISTORY):
            raise RecipeError(f"{obj.name} ({obj.kind.value}) is per token: map it")
        return cls(layer, obj.name, CapturePoint.ENGINE,
                   (_same_state_source(cls, obj, layer, ctx),))

    @classmethod
    def default(cls, obj, layer, ctx):
        if obj.kind == ObjectKind.RECURRENT_STATE and ctx.state_source(layer, obj.name) is not None:
            return cls.plan(obj, layer, ctx)
        return None

    def source_points(self):
        return {CapturePoint.ENGINE}

    def build(self, inputs, params):
        return inputs.source.objects[self.sources[0]][(self.name, CapturePoint.ENGINE)]


def apply_bilinear(A: mx.array, B: mx.array, S: mx.array) -> mx.array:
    """A (H, Dv, Dv), S (batch, H, Dv, Dk), B (H, Dk, Dk) -> A_h S_h B_h per head."""
    return A @ S.astype(mx.float32) @ B


def fit_bilinear(sources: np.ndarray, targets: np.ndarray, rounds: int = 12,
                 ridge: float = 1e-4) -> tuple[np.ndarray, np.ndarray]:
    """A_h, B_h minimising sum_n ||A_h S_nh B_h - T_nh||^2 per head, from the identity.

    sources, targets: (N, H, Dv, Dk). Each pass solves one factor exactly with the other fixed:
        A = (sum T M^T)(sum M M^T + lam I)^-1,  M = S B
        B = (sum N^T N + lam I)^-1 (sum N^T T),  N = A S
    """
    S = np.asarray(sources, dtype=np.float64)
    T = np.asarray(targets, dtype=np.float64)
    _, H, Dv, Dk = S.shape
    A = np.tile(np.eye(Dv), (H, 1, 1))
    B = np.tile(np.eye(Dk), (H, 1, 1))
    for _ in range(rounds):
        M = S @ B  # (N, H, Dv, Dk)
        mm = np.einsum("nhik,nhjk->hij", M, M)
        lam = ridge * np.trace(mm, axis1=1, axis2=2)[:, None, None] / Dv + 1e-12
        A = np.einsum("nhik,nhjk->hij", T, M) @ np.linalg.inv(mm + lam * np.eye(Dv))
        N = A @ S
        nn_ = np.einsum("nhki,nhkj->hij", N, N)
        lam = ridge * np.trace(nn_, axis1=1, axis2=2)[:, None, None] / Dk + 1e-12
        B = np.linalg.inv(nn_ + lam * np.eye(Dk)) @ np.einsum("nhki,nhkj->hij", N, T)
    return A.astype(np.float32), B.astype(np.float32)


def bilinear_r2(A, B, sources, targets) -> float:
    pred = np.asarray(A, np.float64) @ np.asarray(sources, np.float64) @ np.asarray(B, np.float64)
    T = np.asarray(targets, np.float64)
    return float(1 - ((pred - T) ** 2).sum() / max(((T - T.mean()) ** 2).sum(), 1e-12))


@dataclass(frozen=True)
class Bilinear(Copy):
    recipe = "bilinear"

    @classmethod
    def plan(cls, obj, layer, ctx):
        _require_state(obj)
        return super().plan(obj, layer, ctx)

    @classmethod
    def default(cls, obj, layer, ctx):
        return None

    def target_points(self):
        return {CapturePoint.ENGINE}

    def accumulate(self, batch, stats):
        pairs = stats.setdefault(self.key, ([], []))
        pairs[0].append(np.asarray(
            batch.source.objects[self.sources[0]][(self.name, CapturePoint.ENGINE)]))
        pairs[1].append(np.asarray(
            batch.target.objects[self.layer][(self.name, CapturePoint.ENGINE)]))

    def solve(self, stats, ridge):
        s, t = (np.concatenate(x) for x in stats[self.key])
        A, B = fit_bilinear(s, t, ridge=ridge)
        identity = np.eye(A.shape[-1]), np.eye(B.shape[-1])
        metrics = {"r2": round(bilinear_r2(A, B, s, t), 5),
                   "r2_copy": round(bilinear_r2(*identity, s, t), 5)}
        return {"A": mx.array(A), "B": mx.array(B)}, {"": metrics}

    def build(self, inputs, params):
        return apply_bilinear(params["A"], params["B"], super().build(inputs, params))

    def param_shapes(self, widths):
        _, heads, dv, dk = widths.target[(self.layer, self.name, CapturePoint.ENGINE)].shape
        return {"A": (heads, dv, dv), "B": (heads, dk, dk)}

    def flops(self, length, shapes, target_object):
        heads, dv, _ = shapes["A"]
        dk = shapes["B"][-1]
        return 2.0 * heads * (dv * dv * dk + dv * dk * dk)
