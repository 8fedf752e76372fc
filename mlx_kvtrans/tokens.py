"""Token ids of text files, cached: a 27 MB corpus takes half a minute to tokenise on a CPU, and
`kvtrans fit` / `distill` read the same files run after run.

A `.jsonl` file is a chat log: one conversation per line in OpenAI's messages format
(`{"messages": [{"role": "user", "content": "..."}, ...]}`), rendered with the model's own chat
template, so a translator fits on the conversations its user has, as its models see them.

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

from .errors import KvtransError
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
    if Path(path).suffix == ".jsonl":  # rendered by a template other vocabularies may share
        template = str(getattr(tokenizer, "chat_template", None) or "")
        key += "-" + hashlib.sha256(template.encode()).hexdigest()[:8]
    entry = cache_dir() / "tokens" / f"{key}.npy"
    if entry.is_file():
        try:
            return np.load(entry).tolist()
        except (OSError, ValueError):
            pass  # a torn entry: tokenise again
    if Path(path).suffix == ".jsonl":
        ids = [t for number, messages in conversations(raw, path)
               for t in rendered(tokenizer, messages, f"{path}:{number}")]
    else:
        pieces = chunks(raw.decode("utf-8", errors="replace"))
        ids = []
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


def conversations(raw: bytes, path: Path) -> list[tuple[int, list[dict]]]:
    """(line number, messages) of each conversation of a chat log: every message as given
    (tool calls and names included), its content as text (a content given as parts keeps its
    text parts; none is ""). A line that is not one is bad input, named."""
    out = []
    for number, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            out.append((number, [{**m, "role": str(m["role"]),
                                  "content": _text_of(m.get("content"))} for m in messages]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise KvtransError(f"{path}:{number}: not a conversation in OpenAI's messages "
                               f"format ({type(e).__name__}: {e})")
        if not out[-1][1]:
            raise KvtransError(f"{path}:{number}: a conversation without messages")
    return out


def _text_of(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part["text"] for part in content if part.get("type") == "text")


def rendered(tokenizer, messages: list[dict], where: str) -> list[int]:
    """A conversation's token ids in the model's chat template; a template that refuses it (or
    no template) is bad input, named."""
    try:
        return list(tokenizer.apply_chat_template(messages, tokenize=True))
    except Exception as e:  # jinja's TemplateError, a missing template, a tool-call shape
        raise KvtransError(f"{where}: the chat template does not render this conversation "
                           f"({type(e).__name__}: {e})")


def plain_text(path: str | Path) -> str:
    """What a file says as plain text (a chat log: its messages' contents, one per line), for
    the synthetic needles' filler sentences."""
    raw = Path(path).read_bytes()
    if Path(path).suffix == ".jsonl":
        return "\n".join(m["content"] for _, c in conversations(raw, Path(path)) for m in c)
    return raw.decode("utf-8", errors="replace")


def encode_files(tokenizer, paths: list[Path], progress=None) -> list[int]:
    fingerprint = tokenizer_fingerprint(tokenizer)
    return [t for p in paths for t in encode_file(tokenizer, p, progress, fingerprint)]
