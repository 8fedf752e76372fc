"""Random features: a fixed nonlinear expansion of every map's input, fitted in closed form.

A token-wise linear map of the source's features leaves part of what the target's objects hold
out of reach; more source layers or more fitting tokens add little
(`research/results/capacity.md`). Appending H random features of the map's input,

    phi(x) = gelu([rms(x_1) | ... | rms(x_k) | rms(e)] @ P),

each block (a source layer's features x_i, the token identity's embedding e) scaled to unit
RMS so that no block's scale decides the projection, with P (din, H) Gaussian / sqrt(din) drawn
from a seed, makes the same ridge regression a nonlinear map (random-feature regression: a
kernel ridge regression in the limit of many features). Stage 1 fits the rows for phi with the
rest; stage 2 trains them as it trains every weight. P is not a parameter: it is drawn again
from (seed, din) by NumPy's frozen legacy stream, so it is the same on every machine and costs
no storage; the maps' weights grow by H rows each. A map whose `expand` is off reads its input
as it is (`FitConfig.random_layers`: only the target layers where the translation loses most).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .recipes.base import gelu


@dataclass
class RandomFeatures:
    width: int  # H
    seed: int = 0
    _projections: dict = field(default_factory=dict, repr=False, compare=False)

    def projection(self, din: int) -> mx.array:
        """P for inputs of `din` columns: (din, H), the same for a (seed, din) everywhere."""
        if din not in self._projections:
            rng = np.random.RandomState(self.seed)
            p = rng.standard_normal((din, self.width)) / np.sqrt(din)
            self._projections[din] = mx.array(p.astype(np.float32))
        return self._projections[din]

    def __call__(self, parts: list[mx.array]) -> mx.array:
        """phi of the input whose blocks are `parts`, (..., H)."""
        z = mx.concatenate([mx.fast.rms_norm(p, None, 1e-6) for p in parts], axis=-1)
        return gelu(z @ self.projection(z.shape[-1]))

    def flops(self, din: int) -> float:
        """Per token, the projection of an input of `din` columns (H of them its features)."""
        return 2.0 * (din - self.width) * self.width

    def to_json(self) -> dict:
        return {"width": self.width, "seed": self.seed}

    @classmethod
    def from_json(cls, entry: dict | None) -> "RandomFeatures | None":
        return cls(int(entry["width"]), int(entry.get("seed", 0))) if entry else None
