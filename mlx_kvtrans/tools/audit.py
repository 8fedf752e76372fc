"""How well each cached object identifies the tokens it holds: what a cache at rest reveals.

Per layer and object, the top-1 accuracy of two linear read-outs of the token id from the
object's per-token rows, fitted on one split of held-out text and scored on another: ridge
regression to a one-hot of the id, and the nearest fit-split mean row of each id (ridge to a
one-hot of thousands of ids from a few dozen features underfits; the class means do not). For
an MLA layer 0, whose latent is a function of the token alone, also the accuracy of the
translators' token identity: nearest neighbour over a codebook of the whole vocabulary
(`translators.token_identity`).

Rows are read at capture point engine, what the engine caches and a prompt-cache file stores. A
conv history keeps only its last K-1 rows at engine: its rows are read at raw, where every token
has one (and the stored K-1 are exactly these rows). A recurrent state is one fixed-size matrix
per layer, not a row per token: it gets no read-out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from ..capture import capture
from ..errors import KvtransError
from ..layouts import CapturePoint, layout_of
from ..translators.recipes.token_map import per_token_rows
from ..translators.token_identity import build_codebook, decode_ids, first_mla_layer

STORAGE_NOTE = ("caches identify the tokens they hold: store them as you would the conversation "
                "text (prompt-cache files and transcripts are written 0600)")
RIDGE = 1e-3  # times the mean feature variance: a light ridge; the split, not it, keeps scores honest

Progress = Callable[[int, int, str], None]


class LinearReadout:
    """Ridge regression from (N, D) rows to a one-hot of their token ids, on streamed moments.

    The one-hot spans `classes`, the ids that occur in the fit split: a class the fit never saw
    has zero weights, so leaving it out changes no fitted weight. An intercept comes from
    centring, so rows of no information predict the fit split's most common token.
    """

    def __init__(self, dim: int, classes: np.ndarray):
        self.classes = np.asarray(classes)  # sorted ids
        self.n = 0
        self.sum = np.zeros(dim)
        self.xtx = np.zeros((dim, dim))
        self.class_sums = np.zeros((len(self.classes), dim))  # row j: sum of class j's rows
        self.counts = np.zeros(len(self.classes))

    def add(self, rows: np.ndarray, ids: np.ndarray) -> None:
        x = np.asarray(rows, dtype=np.float64)
        columns = np.searchsorted(self.classes, ids)
        if np.any(self.classes[np.minimum(columns, len(self.classes) - 1)] != ids):
            raise ValueError("fit ids outside `classes`")
        self.n += len(x)
        self.sum += x.sum(0)
        self.xtx += x.T @ x
        np.add.at(self.class_sums, columns, x)
        np.add.at(self.counts, columns, 1)

    def solve(self, ridge: float = RIDGE) -> None:
        # W = (X_c^T X_c + lam I)^-1 X_c^T Y, with X_c the centred rows
        self.mean = self.sum / self.n
        cov = self.xtx - self.n * np.outer(self.mean, self.mean)
        cross = self.class_sums.T - np.outer(self.mean, self.counts)  # (D, C)
        lam = ridge * max(np.trace(cov) / len(cov), 1e-12)
        self.weights = np.linalg.solve(cov + lam * np.eye(len(cov)), cross).astype(np.float32)
        self.prior = (self.counts / self.n).astype(np.float32)

        means = self.class_sums / self.counts[:, None]
        self.means = means.T.astype(np.float32)  # (D, C)
        self.half_sq = (0.5 * (means * means).sum(-1)).astype(np.float32)

    def predict(self, rows: np.ndarray) -> np.ndarray:
        scores = (np.asarray(rows, np.float32) - self.mean.astype(np.float32)) @ self.weights
        return self.classes[np.argmax(scores + self.prior, axis=-1)]

    def nearest_mean(self, rows: np.ndarray) -> np.ndarray:
        """The class whose fit-split mean row is nearest: also linear in the row
        (argmax <x, m_c> - |m_c|^2 / 2), and exact for rows that are a function of the token."""
        scores = np.asarray(rows, np.float32) @ self.means - self.half_sq
        return self.classes[np.argmax(scores, axis=-1)]


@dataclass(frozen=True)
class AuditRow:
    layer: int
    mixer: str
    object: str
    kind: str
    point: int | None  # capture point the rows were read at; None: not per token
    features: int  # per token, or the object's size when it is not per token
    readout: float | None  # top-1 accuracy of the ridge read-out on the score split
    nearest_mean: float | None = None  # top-1 accuracy of the nearest fit-split class mean
    codebook: float | None = None  # top-1 accuracy of nearest-neighbour codebook decoding
    note: str = ""


@dataclass
class Audit:
    model: str
    fit_tokens: int
    score_tokens: int
    vocab: int
    classes: int  # ids that occur in the fit split: the read-out's one-hot spans these
    majority: float  # score-split accuracy of always answering the fit split's commonest id
    ceiling: float  # share of score tokens whose id occurs in the fit split
    window: int
    ridge: float
    rows: list[AuditRow] = field(default_factory=list)

    def to_json(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "rows"},
                "one_hot": f"the {self.classes:,} token ids that occur in the fit split "
                           f"(of {self.vocab:,})",
                "storage": STORAGE_NOTE, "rows": [asdict(r) for r in self.rows]}


def _windows(ids: list[int], window: int, batch: int) -> list[mx.array]:
    """(B, window) batches of consecutive windows; a shorter last window alone."""
    cuts = [ids[i:i + window] for i in range(0, len(ids), window)]
    full = [c for c in cuts if len(c) == window]
    out = [mx.array(full[i:i + batch]) for i in range(0, len(full), batch)]
    return out + [mx.array([c]) for c in cuts if len(c) < window]


def _reads(layout) -> dict[tuple[int, str], CapturePoint]:
    """(layer, object) -> the capture point its per-token rows are read at."""
    reads = {}
    for layer in layout.layers:
        for obj in layer.objects:
            if obj.per_token:
                reads[(layer.index, obj.name)] = CapturePoint.ENGINE
            elif obj.token_dim and CapturePoint.RAW in obj.capture_points:  # conv history
                reads[(layer.index, obj.name)] = CapturePoint.RAW
    return reads


def audit(lm, fit_ids: list[int], score_ids: list[int], window: int = 256, batch: int = 4,
          ridge: float = RIDGE, codebook: bool = True, progress: Progress | None = None
          ) -> Audit:
    """Audit every cache object of `lm` (a LoadedModel): a read-out fitted on the caches of
    `fit_ids` and scored on those of `score_ids`, both read in windows of `window` tokens."""
    if not fit_ids or not score_ids:
        raise KvtransError("audit needs tokens to fit on and tokens to score on")
    model, layout = lm.model, layout_of(lm.model)
    reads = _reads(layout)
    select = {(layer, name, point) for (layer, name), point in reads.items()}
    points = set(reads.values())
    fit, score = np.asarray(fit_ids), np.asarray(score_ids)
    classes = np.unique(fit)
    readouts = {key: LinearReadout(layout.layers[key[0]].cache.object(key[1]).token_dim, classes)
                for key in reads}

    book = None
    if codebook and layout.layers and _first_mla(layout) == 0:
        if progress:
            progress(0, 1, "codebook")
        book = build_codebook(model, len(lm.tokenizer.get_vocab()))

    fit_batches, score_batches = _windows(fit_ids, window, batch), _windows(score_ids, window, batch)
    total, done = len(fit_batches) + len(score_batches), 0

    def rows_of(tokens):
        cap = capture(model, tokens, points=points, layout=layout, select=select)
        for (layer, name), point in reads.items():
            rows = per_token_rows(cap.objects[layer][(name, point)])
            yield (layer, name), rows

    for tokens in fit_batches:
        ids = np.asarray(tokens).reshape(-1)
        for key, rows in rows_of(tokens):
            readouts[key].add(np.asarray(rows.astype(mx.float32)).reshape(len(ids), -1), ids)
        done += 1
        if progress:
            progress(done, total, "fit split")
    for r in readouts.values():
        r.solve(ridge)

    correct, near = dict.fromkeys(reads, 0), dict.fromkeys(reads, 0)
    decoded = 0
    for tokens in score_batches:
        ids = np.asarray(tokens).reshape(-1)
        for key, rows in rows_of(tokens):
            flat = np.asarray(rows.astype(mx.float32)).reshape(len(ids), -1)
            correct[key] += int((readouts[key].predict(flat) == ids).sum())
            near[key] += int((readouts[key].nearest_mean(flat) == ids).sum())
            if book is not None and key == (0, "latent"):
                decoded += int((np.asarray(decode_ids(rows, book)).reshape(-1) == ids).sum())
        done += 1
        if progress:
            progress(done, total, "score split")

    commonest = classes[np.argmax(np.unique(fit, return_counts=True)[1])]
    result = Audit(lm.name, len(fit), len(score), len(lm.tokenizer.get_vocab()), len(classes),
                   majority=float(np.mean(score == commonest)),
                   ceiling=float(np.mean(np.isin(score, classes))), window=window, ridge=ridge)
    for layer in layout.layers:
        for obj in layer.objects:
            key = (layer.index, obj.name)
            if key in reads:
                note = (f"engine stores its last {obj.engine_shape[1]} rows" if not obj.per_token
                        else "")
                result.rows.append(AuditRow(
                    layer.index, layer.mixer, obj.name, obj.kind.value, int(reads[key]),
                    obj.token_dim, correct[key] / len(score), near[key] / len(score),
                    decoded / len(score) if book is not None and key == (0, "latent") else None,
                    note))
            else:
                size = int(np.prod(obj.engine_shape))
                result.rows.append(AuditRow(layer.index, layer.mixer, obj.name, obj.kind.value,
                                            None, size, None,
                                            note="fixed size, not per token: no read-out"))
    return result


def _first_mla(layout) -> int | None:
    try:
        return first_mla_layer(layout)
    except ValueError:
        return None


def held_out_tokens(tokenizer, count: int, fit_text: Path | None = None,
                    score_text: Path | None = None) -> tuple[list[int], list[int]]:
    """The first `count` tokens of each split: fit on the zoo corpus's validation text, score
    on its test text, unless other files are given."""
    from ..models import held_out_split
    from ..tokens import encode_file

    splits = []
    for given, name in ((fit_text, "validation"), (score_text, "test")):
        path = given or held_out_split(name)
        if path is None or not Path(path).is_file():
            raise KvtransError(f"no {name} text at {path}: give a text file")
        ids = encode_file(tokenizer, Path(path))[:count]
        if len(ids) < 2:
            raise KvtransError(f"{path}: too little text to audit")
        splits.append(ids)
    return splits[0], splits[1]


def load_model(name: str):
    """A model as `mlx_kvtrans.load` takes it, or a llama-architecture .gguf file."""
    if str(name).endswith(".gguf"):
        from .gguf import load_gguf

        return load_gguf(name)
    from ..models import load

    return load(name)
