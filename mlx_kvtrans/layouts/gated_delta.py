"""The gated delta rule in chunkwise-parallel form, in pure MLX ops (any device, differentiable).

mlx-lm runs the recurrence token by token off Metal (a Python loop of compiled steps); this form
does the same arithmetic a chunk of C tokens at a time with matmuls, looping only over chunks.

Recurrence, in mlx-lm's convention (state `S` is `(Dv, Dk)` per head, gate `g` scalar per head for
GDN or per key channel for KDA):
    S_t = S_{t-1} * g_t;   S_t += beta_t * (v_t - S_t k_t) k_t^T;   o_t = S_t q_t.
Chunk form (Gated DeltaNet paper, WY representation), with gamma_i = sum_{j<=i} log g_j inside a
chunk, and S transposed to (Dk, Dv):
    D_ij  = exp(gamma_i - gamma_j) for j <= i                    (pairwise decay; per channel for KDA)
    A_ij  = sum_d k_id k_jd D_ijd  (j < i);   T = (I + diag(beta) A)^-1
    U     = T diag(beta) (V - (K * e^gamma) S_0)                  (pseudo-values)
    O     = (Q * e^gamma) S_0 + [sum_d q_id k_jd D_ijd]_(j<=i) U
    S_C   = e^gamma_C * S_0 + (K * e^(gamma_C - gamma))^T U
Only differences gamma_i - gamma_j with j <= i are exponentiated, so nothing overflows however
strong the decay.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_update as reference_update  # mlx-lm's own


def log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """log g, as mlx-lm's `compute_g` defines g = exp(-exp(A_log) * softplus(a + dt_bias))."""
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a.astype(mx.float32) + dt_bias)


def _unit_lower_inverse(N: mx.array, size: int) -> mx.array:
    """(I + N)^-1 for strictly lower-triangular N (nilpotent): prod_k (I + (-N)^(2^k))."""
    eye = mx.eye(size, dtype=N.dtype)
    power = -N
    inverse = eye + power
    span = 2
    while span < size:
        power = power @ power
        inverse = inverse @ (eye + power)
        span *= 2
    return inverse


def default_chunk_size(per_channel: bool) -> int:
    # Measured on a 2-core CPU (forward + backward, B=8, T=512, D=32).
    return 32


def _decayed_products(a: mx.array, k: mx.array, gamma: mx.array, sub: int = 8) -> mx.array:
    """sum_d a_id k_jd exp(gamma_id - gamma_jd) for j <= i (0 above), per chunk: (..., C, C).

    Per-channel decays do not factor into a matmul safely (exp(gamma_i) and exp(-gamma_j)
    over- and underflow), so the chunk is cut into sub-chunks of `sub` tokens: pairs inside a
    sub-chunk use the pairwise decay; pairs across sub-chunks factor through the end e of the
    earlier one, exp(gamma_i - gamma_e) * exp(gamma_e - gamma_j), both <= 1, as a matmul.
    """
    *lead, C, D = a.shape
    c = sub if C % sub == 0 and C > sub else C
    S = C // c
    a, k, gamma = (x.reshape(*lead, S, c, D) for x in (a, k, gamma))
    # within sub-chunks: (..., S, c, c)
    diff = gamma[..., :, None, :] - gamma[..., None, :, :]
    inner = mx.tril(mx.ones((c, c), dtype=mx.bool_))
    diag = (a[..., :, None, :] * k[..., None, :, :]
            * mx.exp(mx.where(inner[..., None], diff, -mx.inf))).sum(-1)
    if S == 1:
        return diag.reshape(*lead, C, C)
    # across sub-chunks x > y: (..., S_x, S_y, c, c)
    end = gamma[..., -1:, :]  # (..., S, 1, D)
    later = mx.tril(mx.ones((S, S), dtype=mx.bool_), k=-1)[:, :, None, None]
    to_end = mx.where(later, gamma[..., :, None, :, :] - mx.expand_dims(end, -4), -mx.inf)
    left = a[..., :, None, :, :] * mx.exp(to_end)  # (..., S_x, S_y, c, D)
    right = k * mx.exp(end - gamma)  # (..., S_y, c, D)
    across = left @ mx.expand_dims(mx.swapaxes(right, -1, -2), -4)  # (..., S_x, S_y, c, c)
    eye = mx.eye(S, dtype=mx.bool_)[:, :, None, None]
    blocks = mx.where(eye, mx.expand_dims(diag, -3), across)  # diag: (..., S, 1, c, c)
    return mx.swapaxes(blocks, -3, -2).reshape(*lead, C, C)


def gated_delta_chunked(q, k, v, log_g, beta, state=None, chunk_size: int | None = None):
    """Chunkwise gated delta rule.

    q, k: (B, T, Hk, Dk); v: (B, T, Hv, Dv); log_g: (B, T, Hv) or (B, T, Hv, Dk);
    beta: (B, T, Hv); state: (B, Hv, Dv, Dk) or None. Returns (y (B, T, Hv, Dv), state).
    """
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    dtype = q.dtype
    if Hv > Hk:  # grouped value heads share key heads
        q, k = (mx.repeat(x, Hv // Hk, axis=2) for x in (q, k))
    per_channel = log_g.ndim == 4
    C = max(1, min(chunk_size or default_chunk_size(per_channel), T))
    pad = (-T) % C
    if pad:  # padded tokens: no decay (log g = 0), no write (beta = 0), outputs dropped
        q, k, v, log_g, beta = (mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                                for x in (q, k, v, log_g, beta))
    n = (T + pad) // C

    # (B, H, n, C, ...) in float32
    def chunks(x):
        x = x.astype(mx.float32).reshape(B, n, C, *x.shape[2:])
        return mx.moveaxis(x, 3, 1) if x.ndim > 3 else x
    q, k, v = chunks(q), chunks(k), chunks(v)
    beta = chunks(beta)[..., None]  # (B, H, n, C, 1)
    gamma = chunks(log_g) if per_channel else chunks(log_g)[..., None]
    gamma = mx.cumsum(gamma, axis=3)  # (B, H, n, C, Dk or 1)

    causal = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), k=-1)
    if per_channel:
        kk = _decayed_products(k, k, gamma)
        qk = _decayed_products(q, k, gamma)
    else:
        diff = gamma - mx.swapaxes(gamma, -1, -2)  # (B, H, n, C, C)
        decay = mx.exp(mx.where(causal, diff, -mx.inf))
        kk = (k @ mx.swapaxes(k, -1, -2)) * decay
        qk = (q @ mx.swapaxes(k, -1, -2)) * decay
    A = mx.where(strict, kk, 0.0)
    T_inv = _unit_lower_inverse(beta * A, C)  # (B, H, n, C, C)
    u_from_v = T_inv @ (beta * v)  # (B, H, n, C, Dv)
    k_decayed = k * mx.exp(gamma)  # K * e^gamma
    u_from_state = T_inv @ (beta * k_decayed)  # (B, H, n, C, Dk)
    q_decayed = q * mx.exp(gamma)
    gamma_last = gamma[..., -1:, :]  # (B, H, n, 1, Dk or 1)
    k_to_end = k * mx.exp(gamma_last - gamma)
    qk = mx.where(causal, qk, 0.0)

    S = (mx.zeros((B, Hv, Dk, Dv), mx.float32) if state is None
         else mx.swapaxes(state.astype(mx.float32), -1, -2))
    outputs = []
    for c in range(n):
        U = u_from_v[:, :, c] - u_from_state[:, :, c] @ S
        outputs.append(q_decayed[:, :, c] @ S + qk[:, :, c] @ U)
        S = mx.swapaxes(mx.exp(gamma_last[:, :, c]), -1, -2) * S + \
            mx.swapaxes(k_to_end[:, :, c], -1, -2) @ U
    y = mx.stack(outputs, axis=2).reshape(B, Hv, n * C, Dv)[:, :, :T]
    return mx.swapaxes(y, 1, 2).astype(dtype), mx.swapaxes(S, -1, -2)


def gated_delta_update_chunked(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                               use_kernel=True, lower_bound=None, allow_neg_eigval=False,
                               chunk_size: int | None = None):
    """Drop-in for mlx-lm's `gated_delta_update` (same arguments), computed chunkwise."""
    if mask is not None or lower_bound is not None:
        return reference_update(q, k, v, a, b, A_log, dt_bias, state, mask,
                                use_kernel=use_kernel, lower_bound=lower_bound,
                                allow_neg_eigval=allow_neg_eigval)
    beta = mx.sigmoid(b.astype(mx.float32))
    if allow_neg_eigval:
        beta = beta * 2.0
    y, state = gated_delta_chunked(q, k, v, log_decay(A_log, a, dt_bias), beta, state,
                                   chunk_size=chunk_size)
    return y, state


def metal_recurrence_available() -> bool:
    """Whether mlx-lm's `gated_delta_update` would use its Metal kernel here (a Mac GPU)."""
    return bool(mx.metal.is_available() and mx.default_device() == mx.gpu)
