"""Token identity: which token each cached position holds, for exact long-range recall.

The layer-0 MLA latent is a function of the token alone (embedding -> norm -> kv_a_proj: nothing
mixes positions before it), so a codebook with one row per vocabulary entry decodes cached latents
back to token ids by nearest neighbour. The target's input embedding of the decoded ids is then
appended to every map's input (hybrid-translation paper, "Token identity"). With `ids` the ids
are taken as given instead.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from ..capture import Capture, capture
from ..layouts import CapturePoint, ObjectKind, layout_of
from ..models import weights_fingerprint

CODEBOOK_POINT = CapturePoint.NORMED  # the normalised latent: scale-free, so nearest neighbour
MODES = ("off", "ids", "codebook")


def first_mla_layer(layout) -> int:
    for layer in layout.layers:
        if any(o.kind == ObjectKind.MLA_LATENT for o in layer.objects):
            return layer.index
    raise ValueError("the source has no MLA layer: codebook token identity needs one; "
                     "use --token-identity ids")


def build_codebook(model, vocab_size: int, chunk: int = 4096) -> mx.array:
    """(vocab, kv_lora_rank) layer-0 latents of every token id, at capture point normed."""
    layout = layout_of(model)
    layer = first_mla_layer(layout)
    if layer != 0:
        raise ValueError(f"the first MLA layer is layer {layer}: earlier layers mix positions, "
                         "so its latent is not a function of the token alone")
    rows = []
    for start in range(0, vocab_size, chunk):
        ids = mx.arange(start, min(start + chunk, vocab_size))[None]
        cap = capture(model, ids, points=(CODEBOOK_POINT,), layout=layout)
        rows.append(cap.objects[0][("latent", CODEBOOK_POINT)][0])
    return mx.concatenate(rows, axis=0)


def cached_codebook(model, vocab_size: int, fingerprint: str, cache_dir: Path) -> mx.array:
    """The codebook of a source model, built once and kept under `cache_dir`."""
    path = Path(cache_dir) / f"codebook-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}.safetensors"
    if path.exists():
        return mx.load(str(path))["codebook"]
    book = build_codebook(model, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path), {"codebook": book})
    return book


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVTRANS_CACHE", Path.home() / ".cache" / "mlx-kvtrans"))


def codebook_of(source, cache_dir: Path | None = None) -> mx.array:
    """The codebook of a loaded source model (LoadedModel), cached by its weights' fingerprint."""
    return cached_codebook(source.model, len(source.tokenizer.get_vocab()),
                           weights_fingerprint(source.path), cache_dir or default_cache_dir())


TIE = 1e-5  # squared distances this close, relative to the norms, are one: the lowest id wins


def decode_ids(latents: mx.array, codebook: mx.array, chunk: int = 1024) -> mx.array:
    """Nearest codebook row of each latent (B, T, r) -> ids (B, T); of rows tied to rounding,
    the lowest id."""
    B, T, r = latents.shape
    flat = latents.reshape(-1, r).astype(mx.float32)
    book = codebook.astype(mx.float32)
    book_sq = (book * book).sum(-1)
    largest = book_sq.max()
    out = []
    for start in range(0, flat.shape[0], chunk):
        x = flat[start:start + chunk]
        dist = book_sq[None, :] - 2 * (x @ book.T)  # ||x||^2 is the same for every row
        # a multithreaded BLAS computes columns by different kernels, so equal rows can differ
        # in the last bits here: a tie is any row within rounding of the nearest
        scale = (x * x).sum(-1, keepdims=True) + largest
        near = dist <= dist.min(axis=-1, keepdims=True) + TIE * scale
        out.append(mx.argmax(near.astype(mx.uint8), axis=-1))
    return mx.concatenate(out).reshape(B, T)


def first_duplicates(codebook: mx.array) -> mx.array:
    """(vocab,) the lowest id whose codebook row equals each id's, bit for bit: the id
    `decode_ids` returns for a latent equal to that row (a tie goes to the lowest id)."""
    rows = np.asarray(codebook.astype(mx.float32))
    _, index, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    return mx.array(index[inverse.reshape(-1)].astype(np.int32))


MATCH_TOLERANCE = 1e-4  # squared distance to the known id's row, relative to its squared norm


def confirm_ids(latents: mx.array, codebook: mx.array, known: mx.array, first: mx.array,
                chunk: int = 1024) -> mx.array:
    """`decode_ids`, given ids that the positions should hold: where a latent is its known
    id's codebook row (to rounding), that id (its first duplicate, as decoding gives) at the
    cost of one row per position instead of a search of the whole vocabulary; elsewhere (a
    known id that is not what the cache holds) decoded."""
    B, T, r = latents.shape
    flat = latents.reshape(-1, r).astype(mx.float32)
    ids = known.reshape(-1).astype(mx.int32)
    rows = codebook[ids].astype(mx.float32)
    miss = ((flat - rows) ** 2).sum(-1) > MATCH_TOLERANCE * (rows * rows).sum(-1)
    out = np.array(first[ids])
    where = np.nonzero(np.asarray(miss))[0]
    if where.size:
        out[where] = np.asarray(decode_ids(flat[mx.array(where)][None], codebook, chunk)[0])
    return mx.array(out).reshape(B, T)


@dataclass
class TokenIdentity:
    """How a translator knows which token each position holds: `off`, `ids` (given by the
    caller, who knows the conversation) or `codebook` (decoded from the source's cache; the
    codebook is built or loaded the first time it is needed)."""

    mode: str = "off"
    codebook: mx.array | None = field(default=None, repr=False)
    first: mx.array | None = field(default=None, repr=False)  # `first_duplicates` of it
    load_codebook: Callable[[], mx.array] | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"token identity must be {', '.join(MODES)}, not {self.mode!r}")

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def source_points(self) -> set[CapturePoint]:
        return {CODEBOOK_POINT} if self.mode == "codebook" else set()

    def reads(self, source_layout) -> set[tuple[int, str, CapturePoint]]:
        """The per-token source objects decoding reads: the layer-0 latent, for a codebook."""
        if self.mode != "codebook":
            return set()
        return {(first_mla_layer(source_layout), "latent", CODEBOOK_POINT)}

    def bind(self, source) -> None:
        """Load the codebook of `source` (a LoadedModel) lazily, when first needed."""
        if self.mode == "codebook" and self.codebook is None:
            self.load_codebook = lambda: codebook_of(source)

    def book(self) -> mx.array:
        if self.codebook is None:
            if self.load_codebook is None:
                raise ValueError("codebook token identity needs the source's codebook: load the "
                                 "translator with its source model")
            self.codebook = self.load_codebook()
        return self.codebook

    def first_ids(self) -> mx.array:
        if self.first is None:
            self.first = first_duplicates(self.book())
        return self.first

    def ids(self, source: Capture, known_ids: mx.array | None) -> mx.array | None:
        """Token ids of the source capture's positions (None when off). Decoding reads the
        source's layer-0 latent; a span the source holds by translation has no latent it
        computed itself: there, the known ids stand in."""
        if self.mode == "off":
            return None
        if self.mode == "ids":
            if known_ids is None:
                raise ValueError("token identity `ids` needs the token ids")
            return known_ids
        latent = source.objects[first_mla_layer(source.layout)].get(("latent", CODEBOOK_POINT))
        if latent is None:
            if known_ids is None:
                raise ValueError("the source's capture lacks the layer-0 latent to decode")
            return known_ids
        if known_ids is None:
            return decode_ids(latent, self.book())
        return confirm_ids(latent, self.book(), known_ids, self.first_ids())
