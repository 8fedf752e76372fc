"""Gate initialisation of linear-attention layers, and the decays it gives.

A gated-delta layer forgets its state by exp(-exp(A_log) * softplus(a + dt_bias)) per token
(a: the layer's input-dependent gate logit, near 0 at initialisation). mlx-lm's constructors set
dt_bias to 1 (Gated DeltaNet) or 0 (KDA), so softplus(dt_bias) is 1.3 or 0.69 and with A up to 16
the state forgets within a token or two; trained from there, the zoo's first hybrids kept a state
that carried nothing. The reference implementations (Mamba-2, flash-linear-attention's Gated
DeltaNet and KDA) draw the time step dt log-uniformly in [1e-3, 1e-1] and set
dt_bias = softplus^-1(dt), A uniformly in [1, 16]: decays from about 0.2 to 0.999 at the start.
"""

from __future__ import annotations

import math

import mlx.core as mx

DT_RANGE = (1e-3, 1e-1)
A_RANGE = (1.0, 16.0)


def gated_modules(model) -> list:
    """The linear-attention mixers of an mlx-lm model (those with A_log and dt_bias)."""
    return [m for _, m in model.named_modules() if hasattr(m, "A_log") and hasattr(m, "dt_bias")]


def reference_gate_init(model, key: mx.array) -> int:
    """Re-draw A_log and dt_bias of every linear-attention mixer as the reference
    implementations do; returns how many mixers were set."""
    mixers = gated_modules(model)
    keys = mx.random.split(key, 2 * max(1, len(mixers)))
    for i, m in enumerate(mixers):
        k_dt, k_a = keys[2 * i], keys[2 * i + 1]
        lo, hi = math.log(DT_RANGE[0]), math.log(DT_RANGE[1])
        dt = mx.exp(mx.random.uniform(lo, hi, m.dt_bias.shape, key=k_dt))
        m.dt_bias = (dt + mx.log(-mx.expm1(-dt))).astype(m.dt_bias.dtype)  # softplus^-1(dt)
        a = mx.random.uniform(A_RANGE[0], A_RANGE[1], m.A_log.shape, key=k_a)
        m.A_log = mx.log(a).astype(m.A_log.dtype)
    mx.eval(model.parameters())
    return len(mixers)


def initial_decays(model) -> mx.array:
    """Every mixer's per-token state decay with a zero gate logit, flattened: what a state
    keeps of itself per token before the gates have learned anything."""
    out = []
    for m in gated_modules(model):
        a = mx.exp(m.A_log.astype(mx.float32)).reshape(-1)
        dt = mx.logaddexp(m.dt_bias.astype(mx.float32), 0.0)  # softplus
        per_head = dt.reshape(a.shape[0], -1)  # KDA: a time step per channel of each head
        out.append(mx.exp(-a[:, None] * per_head).reshape(-1))
    return mx.concatenate(out) if out else mx.zeros((0,))
