"""Streaming second moments and the closed-form (ridge) solve of a linear map.

Stage 1 fits y ~ W x + b over every token of a corpus without holding activations: it keeps
X^T X, X^T Y and the sums of x, y and y^2 (float64 on the host, so millions of tokens add up
exactly enough), then solves W with a ridge term scaled to the data and falls back to the
pseudo-inverse if the system is singular. R^2 per output is reported from the same moments.
Optional per-token weights give attention-weighted fitting (KV-Lingo section 3.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

# relative variance below which an output is constant within the float32 sums of a batch
CONSTANT = 1e-6


@dataclass
class Moments:
    """Running sums for y ~ W x + b, x in R^din, y in R^dout."""

    din: int
    dout: int
    n: float = 0.0  # total weight (tokens when unweighted)
    xx: np.ndarray = field(init=False)
    xy: np.ndarray = field(init=False)
    sx: np.ndarray = field(init=False)
    sy: np.ndarray = field(init=False)
    syy: np.ndarray = field(init=False)

    def __post_init__(self):
        self.xx = np.zeros((self.din, self.din))
        self.xy = np.zeros((self.din, self.dout))
        self.sx = np.zeros(self.din)
        self.sy = np.zeros(self.dout)
        self.syy = np.zeros(self.dout)

    def add(self, x: mx.array, y: mx.array, weights: mx.array | None = None) -> None:
        """Accumulate tokens: x (..., din), y (..., dout), optional weights (...)."""
        x = x.reshape(-1, self.din).astype(mx.float32)
        y = y.reshape(-1, self.dout).astype(mx.float32)
        w = mx.ones((x.shape[0],)) if weights is None else weights.reshape(-1).astype(mx.float32)
        xw = x * w[:, None]
        # matmuls on the device in float32 per batch, summed in float64 across batches
        parts = [xw.T @ x, xw.T @ y, xw.sum(0), (y * w[:, None]).sum(0),
                 (y * y * w[:, None]).sum(0), w.sum()]
        mx.eval(parts)
        xx, xy, sx, sy, syy, n = (np.asarray(p, dtype=np.float64) for p in parts)
        self.xx += xx
        self.xy += xy
        self.sx += sx
        self.sy += sy
        self.syy += syy
        self.n += float(n)

    def merge(self, other: "Moments") -> None:
        for name in ("xx", "xy", "sx", "sy", "syy"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.n += other.n


@dataclass
class LinearFit:
    weight: np.ndarray  # (dout, din): y = x @ weight.T + bias
    bias: np.ndarray  # (dout,)
    r2: np.ndarray  # (dout,) coefficient of determination per output
    used_pinv: bool

    @property
    def mean_r2(self) -> float:
        """Over the outputs that vary; 1 when none does (the bias fits a constant exactly)."""
        varying = self.r2[np.isfinite(self.r2)]
        return float(np.mean(varying)) if varying.size else 1.0


def solve(m: Moments, ridge: float = 1e-4, bias: bool = True) -> LinearFit:
    """argmin_W,b sum_t w_t ||W x_t + b - y_t||^2 + ridge * tr(Cxx) / din * ||W||^2."""
    if m.n <= 0:
        raise ValueError("no tokens accumulated")
    if bias:  # centre: fit on deviations from the means, then b = mean_y - W mean_x
        mx_, my = m.sx / m.n, m.sy / m.n
        cxx = m.xx - m.n * np.outer(mx_, mx_)
        cxy = m.xy - m.n * np.outer(mx_, my)
    else:
        mx_, my = np.zeros(m.din), np.zeros(m.dout)
        cxx, cxy = m.xx, m.xy
    lam = ridge * max(np.trace(cxx) / m.din, 1e-12)
    a = cxx + lam * np.eye(m.din)
    used_pinv = False
    try:
        w = np.linalg.solve(a, cxy)
        if not np.all(np.isfinite(w)):
            raise np.linalg.LinAlgError
    except np.linalg.LinAlgError:
        w = np.linalg.pinv(a) @ cxy
        used_pinv = True
    b = my - mx_ @ w
    # residual sum of squares from the centred moments, sum (y - xW - b)^2 per output column;
    # the centred form keeps the precision an output's large mean would cancel away
    tss = m.syy - m.sy**2 / m.n
    rss = m.syy - m.n * my**2 - 2 * np.einsum("ij,ij->j", w, cxy) + np.einsum("ij,ik,kj->j", w, cxx, w)
    # an output constant to float32's precision (a norm channel's constant bias) has no R^2
    measurable = tss > CONSTANT * m.syy
    r2 = np.where(measurable, 1.0 - np.maximum(rss, 0.0) / np.where(measurable, tss, 1.0),
                  np.nan)
    return LinearFit(w.T.astype(np.float32), b.astype(np.float32), r2, used_pinv)


class SharedMoments:
    """Second moments shared by every map that reads the same input features: X^T X (and the
    sums of x) is accumulated once per feature set, X^T Y once for all the maps' outputs side by
    side, and one factorisation solves them all (hybrid-translation paper: one matrix serves
    every target layer that reads the same features).

    Per batch, each map `add`s its (feature key, x, name, y); `flush` accumulates the batch.
    """

    def __init__(self):
        self.moments: dict = {}  # feature key -> Moments over all its outputs
        self.columns: dict = {}  # feature key -> {name: (start, stop)}
        self.pending: dict = {}  # feature key -> (x, [(name, y)]) of this batch
        self.solutions: dict = {}

    def add(self, key, x: mx.array, name: str, y: mx.array) -> None:
        entry = self.pending.setdefault(key, (x, []))
        entry[1].append((name, y.reshape(*y.shape[:-1], -1)))

    def flush(self) -> None:
        for key, (x, outputs) in self.pending.items():
            if key not in self.moments:
                spans, start = {}, 0
                for name, y in outputs:
                    spans[name] = (start, start + y.shape[-1])
                    start += y.shape[-1]
                self.columns[key] = spans
                self.moments[key] = Moments(x.shape[-1], start)
            order = self.columns[key]
            ys = dict(outputs)
            self.moments[key].add(x, mx.concatenate([ys[name] for name in order], axis=-1))
        self.pending = {}

    def solve(self, key, name: str, ridge: float) -> LinearFit:
        """The map `name` of feature set `key`, from the one solve of all its maps."""
        if key not in self.solutions:
            self.solutions[key] = solve(self.moments[key], ridge=ridge)
        whole = self.solutions[key]
        start, stop = self.columns[key][name]
        return LinearFit(whole.weight[start:stop], whole.bias[start:stop],
                         whole.r2[start:stop], whole.used_pinv)

    @property
    def nbytes(self) -> int:
        return sum(m.xx.nbytes + m.xy.nbytes for m in self.moments.values())


class Covariance(Moments):
    """Streamed second moments of x alone, for principal directions."""

    def __init__(self, din: int):
        super().__init__(din, 1)

    def add(self, x: mx.array, weights=None) -> None:
        super().add(x, mx.zeros((*x.shape[:-1], 1)), weights)

    def principal_directions(self, width: int) -> np.ndarray:
        """(din, width): the top-`width` eigenvectors of the centred covariance."""
        mean = self.sx / self.n
        cov = self.xx / self.n - np.outer(mean, mean)
        values, vectors = np.linalg.eigh(cov)
        return vectors[:, np.argsort(values)[::-1][:width]].astype(np.float32)
