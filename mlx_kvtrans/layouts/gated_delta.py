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
With a per-channel gate (KDA) the decay does not factor out of the sums over channels, and
exponentials dominate the cost on a CPU (an `exp` costs several multiplies; `fast_math.exp`
here, as MLX's own runs one value at a time there). Where a chunk's channel decays by at most
`FACTOR_SPAN` nats, D_ijd = e^gamma_id * e^-gamma_jd, so the
sums are matmuls of (K * e^gamma) with (K * e^-gamma): two exponentials per token and channel, no
overflow (e^60 fits float32 with room, forward and backward). The few channels of a chunk that decay further
(fast-forgetting channels) are gathered and summed pairwise, only differences gamma_i - gamma_j
with j <= i exponentiated, so nothing overflows however strong the decay.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_update as reference_update  # mlx-lm's own

from ..backend import fast_math


def log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """log g, as mlx-lm's `compute_g` defines g = exp(-exp(A_log) * softplus(a + dt_bias)),
    off a GPU softplus(x) = (x + |x|) / 2 + log1p(e^-|x|) by `fast_math.exp` and Kahan's
    log1p(y) = y log(u) / (u - 1), u = 1 + y (MLX's softplus and log1p run several times
    slower on a CPU); on a GPU MLX's own."""
    x = a.astype(mx.float32) + dt_bias
    if mx.default_device() == mx.gpu:
        softplus = nn.softplus(x)
    else:
        y = fast_math.exp(-mx.abs(x))
        u = 1.0 + y
        log1p = mx.where(u == 1.0, y, y * mx.log(u) / mx.where(u == 1.0, 1.0, u - 1.0))
        softplus = 0.5 * (x + mx.abs(x)) + log1p  # its slope at 0 is 1/2, as softplus's
    return -mx.exp(A_log.astype(mx.float32)) * softplus


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


FACTOR_SPAN = 60.0  # nats of decay within a chunk up to which D factors (e^60 ~ 1e26 < 3e38)


def default_chunk_size(per_channel: bool) -> int:
    """Tokens per chunk: the fastest of 16 / 32 / 64 in `research/recurrence.py`'s sweep on a
    2-core CPU (replay at real layer sizes, 1K and 4K tokens). A per-channel decay favours
    short chunks: fewer of a chunk's channels decay past FACTOR_SPAN."""
    return 16 if per_channel else 32


def _unsafe_channels(gamma_last: mx.array):
    """Indices (b, h, chunk, channel) whose chunk decays by more than FACTOR_SPAN nats (the
    cumulative log decay's last row, `gamma_last` (B, H, n, D)), as four int32 arrays; None when
    there are none."""
    import numpy as np

    unsafe = np.asarray(gamma_last < -FACTOR_SPAN)
    if not unsafe.any():
        return None
    return tuple(mx.array(i.astype(np.int32)) for i in np.nonzero(unsafe))


def _factored_products(q: mx.array | None, k: mx.array, gamma: mx.array, grow: mx.array):
    """(kk, qk, k_to_end) for a per-channel decay: sum_d x_id k_jd exp(gamma_id - gamma_jd) for
    j <= i, per chunk (..., C, C), and K * e^(gamma_C - gamma), as matmuls and products over
    the channels whose chunk decay factors; the others computed pairwise and added. Without
    `q`, no qk (None)."""
    C = gamma.shape[-2]
    causal = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    unsafe = _unsafe_channels(gamma[..., -1, :])
    # e^-gamma <= e^FACTOR_SPAN as an exponential, not 1 / e^gamma: the reciprocal's gradient
    # (e^-2 gamma) overflows float32 past 44 nats
    if unsafe is None:
        shrink = fast_math.exp(-gamma)
    else:
        safe = gamma[..., -1:, :] >= -FACTOR_SPAN
        # the inner where keeps the gradient finite where the decay does not factor
        shrink = mx.where(safe, fast_math.exp(-mx.where(safe, gamma, 0.0)), 0.0)
    k_back = k * shrink
    kk = (k * grow) @ mx.swapaxes(k_back, -1, -2)
    qk = None if q is None else (q * grow) @ mx.swapaxes(k_back, -1, -2)
    k_to_end = k_back * grow[..., -1:, :]
    if unsafe is not None:
        b, h, c, d = unsafe
        pick = lambda x: mx.swapaxes(x, -1, -2)[b, h, c, d]  # noqa: E731  (N, C)
        g, k_u = pick(gamma), pick(k)
        decay = fast_math.exp(mx.where(causal, g[:, :, None] - g[:, None, :], -mx.inf))
        kk = kk.at[b, h, c].add(k_u[:, :, None] * decay * k_u[:, None, :])
        if q is not None:
            qk = qk.at[b, h, c].add(pick(q)[:, :, None] * decay * k_u[:, None, :])
        to_end = mx.swapaxes(k_to_end, -1, -2).at[b, h, c, d].add(
            k_u * fast_math.exp(g[:, -1:] - g))
        k_to_end = mx.swapaxes(to_end, -1, -2)
    return (mx.where(causal, kk, 0.0), None if q is None else mx.where(causal, qk, 0.0),
            k_to_end)


def gated_delta_chunked(q, k, v, log_g, beta, state=None, chunk_size: int | None = None,
                        state_only: bool = False, tree: bool | None = None):
    """Chunkwise gated delta rule.

    q, k: (B, T, Hk, Dk); v: (B, T, Hv, Dv); log_g: (B, T, Hv) or (B, T, Hv, Dk);
    beta: (B, T, Hv); state: (B, Hv, Dv, Dk) or None. Returns (y (B, T, Hv, Dv), state);
    `state_only`: (None, state), skipping the outputs' arithmetic (a replay that rebuilds a
    state), the chunks composed as a tree where `tree` says (default: by `TREE_RATIO`).
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
    q = chunks(q)
    k = chunks(k)
    v = chunks(v)
    beta = chunks(beta)[..., None]  # (B, H, n, C, 1)
    gamma = chunks(log_g) if per_channel else chunks(log_g)[..., None]
    gamma = mx.cumsum(gamma, axis=3)  # (B, H, n, C, Dk or 1)

    causal = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), k=-1)
    grow = fast_math.exp(gamma)  # e^gamma, <= 1
    if per_channel:
        kk, qk, k_to_end = _factored_products(None if state_only else q, k, gamma, grow)
    else:
        diff = gamma - mx.swapaxes(gamma, -1, -2)  # (B, H, n, C, C)
        decay = fast_math.exp(mx.where(causal, diff, -mx.inf))
        kk = (k @ mx.swapaxes(k, -1, -2)) * decay
        qk = None if state_only else mx.where(causal, (q @ mx.swapaxes(k, -1, -2)) * decay, 0.0)
        k_to_end = k * fast_math.exp(gamma[..., -1:, :] - gamma)
    A = mx.where(strict, kk, 0.0)
    T_inv = _unit_lower_inverse(beta * A, C)  # (B, H, n, C, C)
    u_from_v = T_inv @ (beta * v)  # (B, H, n, C, Dv)
    u_from_state = T_inv @ (beta * (k * grow))  # (B, H, n, C, Dk)
    q_decayed = None if state_only else q * grow
    chunk_decay = mx.swapaxes(grow[..., -1:, :], -1, -2)  # e^gamma_C: (B, H, n, Dk or 1, 1)

    S = (mx.zeros((B, Hv, Dk, Dv), mx.float32) if state is None
         else mx.swapaxes(state.astype(mx.float32), -1, -2))
    if state_only and (Dk <= TREE_RATIO * C if tree is None else tree):
        # S_(c+1) = M_c S_c + N_c: M_c = diag(e^gamma_C) - K_end^T U_state, N_c = K_end^T U_v
        k_end_t = mx.swapaxes(k_to_end, -1, -2)  # (B, H, n, Dk, C)
        eye = mx.eye(Dk, dtype=mx.float32)
        M = chunk_decay * eye - k_end_t @ u_from_state
        N = k_end_t @ u_from_v
        M, N = _compose_chunks(M, N)
        return None, mx.swapaxes(M @ S + N, -1, -2)
    outputs = []
    for c in range(n):
        U = u_from_v[:, :, c] - u_from_state[:, :, c] @ S
        if not state_only:
            outputs.append(q_decayed[:, :, c] @ S + qk[:, :, c] @ U)
        S = chunk_decay[:, :, c] * S + \
            mx.swapaxes(k_to_end[:, :, c], -1, -2) @ U
    if state_only:
        return None, mx.swapaxes(S, -1, -2)
    y = mx.stack(outputs, axis=2).reshape(B, Hv, n * C, Dv)[:, :, :T]
    return mx.swapaxes(y, 1, 2).astype(dtype), mx.swapaxes(S, -1, -2)


# A replay that rebuilds only the final state composes the chunks' affine maps as a tree: log2 n
# batched steps in place of n small dependent ones, at Dk / C times the arithmetic (Dk = Dv). At
# the zoo's sizes (Dk = 32, C = 16) the n small steps' overhead dominates and the tree is faster
# (`research/recurrence.py`); at a real checkpoint's Dk = 128 the arithmetic does.
TREE_RATIO = 2


def _compose_chunks(M: mx.array, N: mx.array) -> tuple[mx.array, mx.array]:
    """The affine maps S -> M_c S + N_c of chunks c = 0..n-1 (axis 2) composed in order, as a
    tree of batched matmuls (log2 n steps, not n dependent ones): (M, N) of shape (B, H, Dk,
    Dk) and (B, H, Dk, Dv)."""
    while M.shape[2] > 1:
        if M.shape[2] % 2:  # the last chunk waits a round: compose it with the identity
            M = mx.concatenate([M, mx.broadcast_to(mx.eye(M.shape[-1], dtype=M.dtype),
                                                   M[:, :, :1].shape)], axis=2)
            N = mx.concatenate([N, mx.zeros_like(N[:, :, :1])], axis=2)
        first, then = M[:, :, 0::2], M[:, :, 1::2]
        M, N = then @ first, then @ N[:, :, 0::2] + N[:, :, 1::2]
    return M[:, :, 0], N[:, :, 0]


def gated_delta_update_chunked(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                               use_kernel=True, lower_bound=None, allow_neg_eigval=False,
                               chunk_size: int | None = None, state_only: bool = False,
                               tree: bool | None = None):
    """Drop-in for mlx-lm's `gated_delta_update` (same arguments), computed chunkwise;
    `state_only`: (None, state), `tree` as `gated_delta_chunked` takes it."""
    if mask is not None or lower_bound is not None:
        return reference_update(q, k, v, a, b, A_log, dt_bias, state, mask,
                                use_kernel=use_kernel, lower_bound=lower_bound,
                                allow_neg_eigval=allow_neg_eigval)
    beta = mx.sigmoid(b.astype(mx.float32))
    if allow_neg_eigval:
        beta = beta * 2.0
    return gated_delta_chunked(q, k, v, log_decay(A_log, a, dt_bias), beta, state,
                               chunk_size=chunk_size, state_only=state_only, tree=tree)


def metal_recurrence_available() -> bool:
    """Whether mlx-lm's `gated_delta_update` would use its Metal kernel here (a Mac GPU)."""
    return bool(mx.metal.is_available() and mx.default_device() == mx.gpu)
