"""Replay: a recurrent state rebuilt by the target's own recurrence. Token-wise maps predict the
target's per-token recurrence inputs (k, v, gate and beta logits; q only reads the state out)
from the source's features, and `install` runs the target's `gated_delta_update` over them. The
default for a target state the source has nothing like.

`convolve` (`FitConfig.replay_convolve`, from features at raw): k and v are predicted as the
rows entering the layer's short convolution, which `install` passes through the target's own
convolution, after the conv history it holds. Each convolved row mixes the last K tokens, which
a token-wise map of one position's features fits poorly; the rows before it are one token's
projection each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from ...layouts import CapturePoint, ObjectKind
from ...layouts.linear_attention import RawRecurrentInputs, RecurrentInputs
from ..stats import Moments, solve
from .base import UNEXPANDED, Recipe, RecipeError, concat_features

REPLAY_INPUTS = ("k", "v", "a", "b")  # what the state needs; q only reads it out


@dataclass(frozen=True)
class Replay(Recipe):
    recipe = "replay"
    reads_identity = True

    # per input: its per-token shape in the target, e.g. {"k": [Hk, Dk], "a": [Hv]}
    shapes: dict = field(default_factory=dict, hash=False, compare=False)
    expand: bool = True  # whether the translator's random features join its input
    convolve: bool = False  # k and v as the rows entering the short convolution (above)

    @classmethod
    def plan(cls, obj, layer, ctx):
        if obj.kind != ObjectKind.RECURRENT_STATE:
            raise RecipeError(f"{obj.name} ({obj.kind.value}) has no recurrence to replay")
        return cls(layer, obj.name, CapturePoint.NORMED, ctx.sources)

    @classmethod
    def default(cls, obj, layer, ctx):
        return cls.plan(obj, layer, ctx) if obj.kind == ObjectKind.RECURRENT_STATE else None

    def feature_reads(self):
        return {(s, ()) for s in self.sources}

    def target_points(self):
        return {CapturePoint.NORMED} | ({CapturePoint.RAW} if self.convolve else set())

    def _targets(self, target) -> dict[str, mx.array]:
        """Per input, what the maps are fitted to in a target capture: the recurrence inputs
        normed, with k and v the rows entering the convolution when `convolve`."""
        inputs = target.objects[self.layer][(self.name, CapturePoint.NORMED)]
        out = {name: getattr(inputs, name) for name in REPLAY_INPUTS}
        if self.convolve:
            layer = target.layout.layers[self.layer].cache
            rows = {name: target.objects[self.layer][(name, CapturePoint.RAW)]
                    for name in layer.conv_names}
            out["k"], out["v"] = layer.raw_rows(rows)
        return out

    def with_shapes(self, inputs: RecurrentInputs) -> "Replay":
        shapes = {name: list(getattr(inputs, name).shape[2:]) for name in REPLAY_INPUTS}
        return replace(self, shapes=shapes)

    def accumulate(self, batch, stats):
        x = concat_features(batch.features, self.sources, (), batch.identity,
                            batch.expand if self.expand else None)
        inputs = batch.target.objects[self.layer][(self.name, CapturePoint.NORMED)]
        entry = stats.setdefault(self.key, {"recipe": self.with_shapes(inputs), "moments": {},
                                            "shared": batch.shared is not None})
        targets = self._targets(batch.target)
        for name in REPLAY_INPUTS:
            y = targets[name]
            if entry["shared"]:
                batch.shared.add(self.feature_key(), x, f"{self.key}.{name}",
                                 y.reshape(*y.shape[:2], -1))
                continue
            if name not in entry["moments"]:
                entry["moments"][name] = Moments(x.shape[-1], int(np.prod(y.shape[2:])))
            entry["moments"][name].add(x, y.reshape(*y.shape[:2], -1))

    def fitted(self, stats) -> "Replay":
        """This recipe with the target's input shapes, as fitting measured them."""
        return stats[self.key]["recipe"]

    def shaped(self, widths) -> "Replay":
        return self.with_shapes(widths.target[(self.layer, self.name, CapturePoint.NORMED)])

    def feature_key(self) -> tuple:
        return (self.sources, ()) + (() if self.expand else (UNEXPANDED,))

    def solve(self, stats, ridge):
        params, metrics = {}, {}
        entry = stats[self.key]
        for name in REPLAY_INPUTS:
            fit = (stats["shared"].solve(self.feature_key(), f"{self.key}.{name}", ridge)
                   if entry["shared"] else solve(entry["moments"][name], ridge=ridge))
            params[f"{name}.weight"], params[f"{name}.bias"] = (mx.array(fit.weight),
                                                               mx.array(fit.bias))
            metrics[name] = {"r2": round(fit.mean_r2, 5), "pinv": fit.used_pinv}
        return params, metrics

    def build(self, inputs, params):
        """Predicted per-token recurrence inputs normed; install replays the target's recurrence."""
        x = concat_features(inputs.features, self.sources, (), inputs.identity,
                            inputs.expand if self.expand else None)
        return self.from_parts(inputs, {name: x @ weight.T + bias
                                        for name, weight, bias in self.linear_parts(params)})

    def fused_input(self, inputs):
        return self.feature_key()

    def linear_parts(self, params):
        return [(name, params[f"{name}.weight"], params[f"{name}.bias"])
                for name in REPLAY_INPUTS]

    def from_parts(self, inputs, outputs):
        from mlx_lm.models.gated_delta import normalize_qk

        B, T, _ = outputs["k"].shape
        pred = {name: outputs[name].reshape(B, T, *self.shapes[name]) for name in REPLAY_INPUTS}
        k = pred["k"]
        if self.convolve:  # install convolves them after the history the cache holds
            return RawRecurrentInputs(mx.zeros_like(k), k, pred["v"], pred["a"], pred["b"])
        _, k = normalize_qk(k, k, inv_scale=k.shape[-1] ** -0.5, eps=1e-6)  # the target's own
        return RecurrentInputs(mx.zeros_like(k), k, pred["v"], pred["a"], pred["b"])

    def param_shapes(self, widths):
        din = (sum(widths.features[(s, ())] for s in self.sources) + widths.identity
               + (widths.expansion if self.expand else 0))
        inputs = widths.target[(self.layer, self.name, CapturePoint.NORMED)]
        out = {}
        for name in REPLAY_INPUTS:
            dout = math.prod(getattr(inputs, name).shape[2:])
            out[f"{name}.weight"], out[f"{name}.bias"] = (dout, din), (dout,)
        return out

    def flops(self, length, shapes, target_object):
        return sum(2.0 * shapes[f"{n}.weight"][0] * shapes[f"{n}.weight"][1] * length
                   for n in REPLAY_INPUTS)
