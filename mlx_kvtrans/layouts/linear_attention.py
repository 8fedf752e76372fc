"""Linear-attention layers: conv histories and the gated-delta recurrent state.

Gated DeltaNet (qwen3_next, qwen3_5): `ArraysCache(2)` = [conv history `(B, K-1, 2*Hk*Dk + Hv*Dv)`,
state `S` `(B, Hv, Dv, Dk)` float32]. Kimi Delta Attention (kimi_linear): `ArraysCache(4)` =
[q, k, v conv histories `(B, K-1, H*Dk)` each, `S`]. KDA's gate is per channel, GDN's per head.

conv history: raw = the raw projection rows entering the short convolution (pre-conv, pre-SiLU);
engine = the last K-1 of them (zeros in front when fewer tokens were read).
recurrent state: normed = the per-token inputs of `gated_delta_update` (q, k after conv, SiLU and
`normalize_qk`; v after conv and SiLU; gate logits a; beta logits b); engine = `S` after the last
token, which `replay` rebuilds by running the model's own recurrence over normed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields

import mlx.core as mx
import mlx.nn as nn

from .base import LayerCache
from .gated_delta import gated_delta_update_chunked, metal_recurrence_available
from .objects import CapturePoint, ObjectKind, activation_dtype, fixed_object


@dataclass
class RecurrentInputs:
    """Per-token inputs of the gated delta rule, as `gated_delta_update` takes them."""

    q: mx.array  # (B, T, Hk, Dk)
    k: mx.array  # (B, T, Hk, Dk)
    v: mx.array  # (B, T, Hv, Dv)
    a: mx.array  # gate logits: (B, T, Hv) for GDN, (B, T, Hv, Dk) for KDA
    b: mx.array  # beta logits (B, T, Hv)

    def arrays(self) -> list[mx.array]:
        return [getattr(self, f.name) for f in fields(self)]

    @property
    def length(self) -> int:
        return self.q.shape[1]

    def slice(self, start: int, stop: int) -> "RecurrentInputs":
        return type(self)(*(x[:, start:stop] for x in self.arrays()))

    @classmethod
    def concatenate(cls, parts: list["RecurrentInputs"], axis: int = 1) -> "RecurrentInputs":
        """`parts` joined along the tokens (axis 1), or along the batch (axis 0)."""
        return cls(*(mx.concatenate(xs, axis=axis) for xs in zip(*(p.arrays() for p in parts))))


@dataclass
class RawRecurrentInputs(RecurrentInputs):
    """Recurrence inputs whose k and v are still the rows entering the layer's short
    convolution (q unused): `DeltaRuleLayer.convolved` passes them through it when installed,
    after the conv history the cache already holds."""


def _recurrence(mixer):
    """The `gated_delta_update` that `mixer`'s mlx-lm module calls (looked up at call time)."""
    return sys.modules[type(mixer).__module__].gated_delta_update


class DeltaRuleLayer(LayerCache):
    """What GDN and KDA share: a recurrent state fed by conv'd projections."""

    conv_names: tuple[str, ...]

    def __init__(self, mixer, heads_k, heads_v, dk, dv, kernel, conv_widths, dtype):
        self.mixer_module = mixer
        self.heads_k = heads_k
        self.heads_v = heads_v
        self.dk = dk
        self.dv = dv
        self.kernel = kernel
        self.objects = tuple(
            fixed_object(name, ObjectKind.CONV_HISTORY, (1, kernel - 1, width), dtype,
                         (CapturePoint.RAW, CapturePoint.ENGINE), token_dim=width)
            for name, width in zip(self.conv_names, conv_widths)
        ) + (fixed_object("state", ObjectKind.RECURRENT_STATE, (1, heads_v, dv, dk), mx.float32,
                          (CapturePoint.NORMED, CapturePoint.ENGINE)),)

    # -- the recurrence ---------------------------------------------------------------------
    def recurrence_constants(self) -> tuple[mx.array, mx.array]:
        """(A_log, dt_bias) shaped as the module passes them to `gated_delta_update`."""
        raise NotImplementedError

    def replay(self, inputs: RecurrentInputs, state: mx.array | None = None,
               chunk_size: int | None = None, use_kernel: bool = True, parallel: bool = False,
               state_only: bool = False):
        """Run this layer's own recurrence over `inputs` from `state`; returns (outputs, state).

        `use_kernel`: mlx-lm's Metal kernel where it can run (a Mac GPU), its pure-ops loop
        elsewhere or when False. `parallel`: the chunkwise-parallel pure-MLX form instead
        (differentiable everywhere); with `state_only` it skips the outputs' arithmetic and
        returns None for them. `chunk_size` splits the tokens; the state carries across.
        """
        A_log, dt_bias = self.recurrence_constants()
        if parallel:
            def update(*args, **kwargs):
                return gated_delta_update_chunked(*args, state_only=state_only, **kwargs)
        else:
            update = _recurrence(self.mixer_module)
        step = chunk_size or max(inputs.length, 1)
        outputs = []
        for start in range(0, inputs.length, step):
            part = inputs.slice(start, start + step)
            y, state = update(part.q, part.k, part.v, part.a, part.b, A_log, dt_bias, state,
                              use_kernel=use_kernel)
            outputs.append(y)
        if not outputs or outputs[0] is None:
            return None, state
        return mx.concatenate(outputs, axis=1), state

    @property
    def recurrence_namespace(self) -> str:
        """The mlx-lm module whose `gated_delta_update` this layer calls (capture spies on it)."""
        return type(self.mixer_module).__module__

    # -- engine cache ---------------------------------------------------------------------------
    def read_engine(self, cache):
        return {name: cache[i] for i, name in enumerate(self.conv_names + ("state",))}

    def build_cache(self, objects):
        from mlx_lm.models.cache import ArraysCache

        names = self.conv_names + ("state",)
        cache = ArraysCache(len(names))
        for i, name in enumerate(names):
            cache[i] = self.cast(name, objects[name])
        return cache

    def append(self, cache, objects):
        for i, name in enumerate(self.conv_names + ("state",)):
            cache[i] = self.cast(name, objects[name])
        return cache

    def to_engine(self, objects, point, offset=0, previous=None, rotate=None):
        previous = previous or {}
        out = {}
        for name in self.conv_names:
            rows = objects[name]
            if self.point_of(name, point) == CapturePoint.RAW:
                rows = self.conv_history(rows, previous.get(name))
            out[name] = rows
        state = objects["state"]
        if isinstance(state, RawRecurrentInputs):
            state = self.convolved(state, previous)
        if self.point_of("state", point) == CapturePoint.NORMED:
            # as `fastest_recurrence` prefills: mlx-lm's Metal kernel on a Mac GPU, elsewhere
            # the chunkwise form
            _, state = self.replay(state, previous.get("state"),
                                   parallel=not metal_recurrence_available(), state_only=True)
        out["state"] = state
        return out

    # -- recurrence inputs from the rows entering the short convolution ---------------------
    def raw_rows(self, rows: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
        """(k, v) rows entering the short convolution, each (B, T, heads x dim), from the conv
        histories' rows at raw."""
        raise NotImplementedError

    def raw_inputs(self, rows: dict[str, mx.array], inputs: RecurrentInputs
                   ) -> RawRecurrentInputs:
        """`inputs` normed with k and v the conv histories' `rows` raw before the convolution."""
        k, v = self.raw_rows(rows)
        return RawRecurrentInputs(inputs.q, k.reshape(inputs.k.shape), v.reshape(inputs.v.shape),
                                  inputs.a, inputs.b)

    def convolved(self, raw: RawRecurrentInputs, previous: dict) -> RecurrentInputs:
        """The recurrence inputs normed of `raw`: k and v through this layer's own short
        convolution and SiLU, after the `previous` conv histories (zeros without), k normalized
        as the module does."""
        raise NotImplementedError

    def _normalized(self, k: mx.array) -> mx.array:
        from mlx_lm.models.gated_delta import normalize_qk

        return normalize_qk(k, k, inv_scale=self.dk ** -0.5, eps=1e-6)[1]

    def conv_history(self, rows: mx.array, previous: mx.array | None = None) -> mx.array:
        """The engine's conv history after `rows` (B, T, C): the last K-1 rows, zeros in front."""
        B, _, C = rows.shape
        if previous is None:
            previous = mx.zeros((B, self.kernel - 1, C), dtype=rows.dtype)
        history = mx.concatenate([previous.astype(rows.dtype), rows], axis=1)
        return mx.contiguous(history[:, -(self.kernel - 1):, :])


class GatedDeltaNet(DeltaRuleLayer):
    mixer = "gdn"
    cache_class = "ArraysCache(2)"
    conv_names = ("conv",)

    def __init__(self, gdn):
        super().__init__(gdn, gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim,
                         gdn.conv_kernel_size, (gdn.conv_dim,), activation_dtype(gdn.out_proj))

    def taps(self):
        def conv_rows(record, args, out):
            record("conv", CapturePoint.RAW, args[0][:, self.kernel - 1:])  # [history | rows]

        return [(self.mixer_module.conv1d, conv_rows)]

    def recurrence_constants(self):
        return self.mixer_module.A_log, self.mixer_module.dt_bias

    def raw_rows(self, rows):
        key = self.heads_k * self.dk  # the conv's channels: q | k | v
        _, k, v = mx.split(rows["conv"], [key, 2 * key], axis=-1)
        return k, v

    def convolved(self, raw, previous):
        B, T = raw.k.shape[:2]
        rows = [mx.zeros((B, T, self.heads_k * self.dk), raw.k.dtype),
                raw.k.reshape(B, T, -1), raw.v.reshape(B, T, -1).astype(raw.k.dtype)]
        rows = mx.concatenate(rows, axis=-1)
        before = previous.get("conv")
        if before is None:
            before = mx.zeros((B, self.kernel - 1, rows.shape[-1]), rows.dtype)
        out = nn.silu(self.mixer_module.conv1d(mx.concatenate([before.astype(rows.dtype), rows],
                                                              axis=1)))
        _, k, v = mx.split(out, [self.heads_k * self.dk, 2 * self.heads_k * self.dk], axis=-1)
        k = self._normalized(k.reshape(B, T, self.heads_k, self.dk))
        return RecurrentInputs(mx.zeros_like(k), k, v.reshape(B, T, self.heads_v, self.dv),
                               raw.a, raw.b)


class KimiDeltaAttention(DeltaRuleLayer):
    mixer = "kda"
    cache_class = "ArraysCache(4)"
    conv_names = ("conv_q", "conv_k", "conv_v")

    def __init__(self, kda):
        width = kda.projection_dim
        super().__init__(kda, kda.num_heads, kda.num_heads, kda.head_dim, kda.head_dim,
                         kda.conv_kernel, (width, width, width), activation_dtype(kda.o_proj))

    def taps(self):
        def conv_rows(name):
            def on_call(record, args, out):
                record(name, 1, args[0])  # ShortConv1d(x, state, ...): x = raw projection
            return on_call

        m = self.mixer_module
        return [(m.q_conv, conv_rows("conv_q")), (m.k_conv, conv_rows("conv_k")),
                (m.v_conv, conv_rows("conv_v"))]

    def recurrence_constants(self):
        m = self.mixer_module
        return m.A_log.reshape(m.num_heads, 1), m.dt_bias.reshape(m.num_heads, m.head_dim)

    def raw_rows(self, rows):
        return rows["conv_k"], rows["conv_v"]

    def convolved(self, raw, previous):
        B, T = raw.k.shape[:2]
        m = self.mixer_module
        k, _ = m.k_conv(raw.k.reshape(B, T, -1), previous.get("conv_k"), None, None)
        v, _ = m.v_conv(raw.v.reshape(B, T, -1), previous.get("conv_v"), None, None)
        k = self._normalized(k.reshape(B, T, self.heads_k, self.dk))
        return RecurrentInputs(mx.zeros_like(k), k, v.reshape(B, T, self.heads_v, self.dv),
                               raw.a, raw.b)
