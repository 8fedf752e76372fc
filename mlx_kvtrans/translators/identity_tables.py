"""Identity tables: per-token offsets added to a map's output, looked up by the ids of the token
at each position (t) and of the one before it (t-1).

A copying head reads, at the position it copies from, a key that says which token came before
and a value that says which token is there: per-token detail a linear map of the source's
features (and of a 128-wide input embedding) blurs. The tables carry it directly:

    y = W x + b + U0[id_t] V0 + U1[id_{t-1}] V1

Fitted in closed form in the same pass as the map: per id, the sums of x and y and the count
(and the (t-1, t) bigram counts) are streamed; once W and b are solved, table 0 is each id's
mean residual shrunk towards zero, (sum of residuals) / (count + shrink), and table 1 the same
for the previous id on what table 0 leaves. Each table is then cut to rank r by an SVD, so a
vocabulary of V ids costs V r + r d parameters (the V r lookup rows in bfloat16). The per-id
sums hold V (din + dout) floats per lag: at a real checkpoint's vocabulary this is the fit's
largest buffer.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

LAGS = (0, 1)
SHRINK = 2.0  # an id seen n times keeps n / (n + 2) of its mean residual


class TableMoments:
    """Per-id sums of x and y, counts, and bigram counts, for one map."""

    def __init__(self, vocab: int, din: int, dout: int):
        self.vocab = vocab
        self.count = {lag: np.zeros(vocab) for lag in LAGS}
        self.sx = {lag: np.zeros((vocab, din)) for lag in LAGS}
        self.sy = {lag: np.zeros((vocab, dout)) for lag in LAGS}
        self.bigrams: list[np.ndarray] = []  # codes prev * vocab + cur, one array per batch

    def add(self, x: mx.array, y: mx.array, ids: mx.array) -> None:
        """x (B, T, din), y (B, T, dout), ids (B, T): the positions' own token ids."""
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        ids = np.asarray(ids, np.int64)
        for lag in LAGS:
            if lag:  # position t reads the id at t-1: the first position has none
                key = ids[:, :-lag]
                xs = x[:, lag:]
                ys = y[:, lag:]
            else:
                key = ids
                xs = x
                ys = y
            key = key.reshape(-1)
            np.add.at(self.count[lag], key, 1.0)
            np.add.at(self.sx[lag], key, xs.reshape(len(key), -1))
            np.add.at(self.sy[lag], key, ys.reshape(len(key), -1))
        self.bigrams.append((ids[:, :-1] * self.vocab + ids[:, 1:]).reshape(-1))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for d in (self.count, self.sx, self.sy) for a in d.values())

    def solve(self, weight: np.ndarray, bias: np.ndarray, rank: int) -> dict[str, mx.array]:
        """Tables for the map y = x @ weight.T + bias, each cut to `rank`."""
        w, b = np.asarray(weight, np.float64), np.asarray(bias, np.float64)

        def residual(lag):
            return self.sy[lag] - self.sx[lag] @ w.T - self.count[lag][:, None] * b

        table0 = residual(0) / (self.count[0][:, None] + SHRINK)
        # what table 0 already explains at the positions each previous id precedes
        codes, n = np.unique(np.concatenate(self.bigrams), return_counts=True)
        explained = np.zeros_like(table0)
        np.add.at(explained, codes // self.vocab, n[:, None] * table0[codes % self.vocab])
        table1 = (residual(1) - explained) / (self.count[1][:, None] + SHRINK)
        out = {}
        for lag, table in zip(LAGS, (table0, table1)):
            u, v = low_rank(table, rank)
            # the lookup rows are most of a tabled translator's bytes, and each is a shrunk mean
            # of a few positions' residuals, far coarser than bfloat16: stored so
            out[f"table{lag}.u"], out[f"table{lag}.v"] = mx.array(u, mx.bfloat16), mx.array(v)
        return out


def low_rank(table: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(V, r) and (r, d) factors of the best rank-r approximation of `table` (V, d)."""
    u, s, vt = np.linalg.svd(table, full_matrices=False)
    r = min(rank, len(s))
    return (u[:, :r] * s[:r]).astype(np.float32), vt[:r].astype(np.float32)


def table_offsets(params: dict, ids: mx.array) -> mx.array:
    """(B, T, dout) offsets of the tables in `params` for token ids (B, T)."""
    out = params["table0.u"][ids] @ params["table0.v"]
    previous = params["table1.u"][ids[:, :-1]] @ params["table1.v"]
    return out + mx.pad(previous, [(0, 0), (1, 0), (0, 0)])


def table_shapes(vocab: int, rank: int, dout: int) -> dict[str, tuple[int, int]]:
    r = min(rank, dout, vocab)
    return {name: shape for lag in LAGS
            for name, shape in ((f"table{lag}.u", (vocab, r)), (f"table{lag}.v", (r, dout)))}
