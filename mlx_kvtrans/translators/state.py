"""Recurrent-state recipes (hybrid-translation paper, "State strategies").

- zero: the target's state starts empty (the baseline);
- copy: the source's final state, when the geometries match;
- copy + bilinear correction: S_h -> A_h S_h B_h per value head, A_h (Dv x Dv) and B_h (Dk x Dk)
  fitted in closed form by alternating ridge passes over (source, target) state pairs.
(Replay, which predicts the target's per-token recurrence inputs and runs its own recurrence,
lives with the token maps that predict those inputs.)
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def zero_state(shape: tuple, batch: int) -> mx.array:
    return mx.zeros((batch, *shape[1:]), dtype=mx.float32)


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
