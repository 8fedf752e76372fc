"""File helpers shared by the artifacts (zoo manifests, translator directories) and by every file
that holds cache contents or conversation text.

A cache identifies the tokens it holds (`kvtrans audit` measures how well), so a prompt-cache
file or a transcript is the conversation itself: such files are created readable by their owner
only, and appear at their path complete or not at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

PRIVATE_MODE = 0o600


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def private_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """A new empty file beside `path`, mode 0600, for a writer that takes a file name; renamed
    onto `path` when the block succeeds, removed when it fails. `suffix` ends the temporary
    name (mlx appends ".safetensors" to a name that lacks it)."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)  # mkstemp creates it 0600 whatever the umask
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, PRIVATE_MODE)  # in case the writer replaced the file instead of filling it
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_private(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` atomically, readable by its owner only (0600)."""
    with private_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    return Path(path)
