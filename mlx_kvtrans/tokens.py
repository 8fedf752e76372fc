"""Token ids of text files, cached: a 27 MB corpus takes half a minute to tokenise on a CPU, and
`kvtrans fit` / `distill` read the same files run after run.

The cache lives in `$KVTRANS_CACHE` (default `$XDG_CACHE_HOME/kvtrans`, else `~/.cache/kvtrans`),
keyed by the file's bytes and the tokenizer's vocabulary, so an edited file or another tokenizer
never reads a stale entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from .files import private_path

CHUNK_CHARS = 1 << 20
# A chunk ends at a newline followed by a non-space: byte-level pre-tokenizers never join
# across it, so chunks tokenise to the same ids as the whole text.
_BOUNDARY = re.compile(r"\n(?=\S)")


def cache_dir() -> Path:
    if env := os.environ.get("KVTRANS_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvtrans"


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """`text` cut into pieces of about `size` characters at safe boundaries."""
    out, start = [], 0
    while start < len(text):
        match = _BOUNDARY.search(text, min(start + size, len(text)))
        end = match.end() if match else len(text)
        out.append(text[start:end])
        start = end
    return out


def encode_file(tokenizer, path: Path, progress=None, fingerprint: str | None = None
                ) -> list[int]:
    """Token ids of the text file `path` (read as UTF-8, bad bytes replaced).
    `progress(done, total, what)` follows the chunks when it is not cached."""
    raw = Path(path).read_bytes()
    key = hashlib.sha256(raw).hexdigest()[:24] + "-" + (fingerprint
                                                        or tokenizer_fingerprint(tokenizer))
    entry = cache_dir() / "tokens" / f"{key}.npy"
    if entry.is_file():
        try:
            return np.load(entry).tolist()
        except (OSError, ValueError):
            pass  # a torn entry: tokenise again
    pieces = chunks(raw.decode("utf-8", errors="replace"))
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if progress:
            progress(i, len(pieces), f"tokenising {Path(path).name}")
        ids.extend(tokenizer.encode(piece, add_special_tokens=i == 0))  # as one text
    try:  # the ids spell the user's text: private, like a transcript
        entry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with private_path(entry, suffix=".npy") as partial:
            np.save(partial, np.asarray(ids, dtype=np.int32))
    except OSError:
        pass  # a read-only cache only costs time
    return ids


def encode_files(tokenizer, paths: list[Path], progress=None) -> list[int]:
    fingerprint = tokenizer_fingerprint(tokenizer)
    return [t for p in paths for t in encode_file(tokenizer, p, progress, fingerprint)]
