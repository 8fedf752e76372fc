"""The translator artifact: a directory any version of the library saves and loads one way.

    weights.safetensors   every parameter ("<layer>.<object>.weight|bias|A|B")
    manifest.json         source/target identity and fingerprints, recipe and capture point per
                          object, layer assignment, fit data hash, library version, metrics
    SHA256SUMS            hashes of the two files above

Loading verifies the hashes and that the given models are the ones it was fitted for; a tampered
file or a wrong pair is refused with a message. Only JSON and safetensors are read: nothing is
unpickled.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx

from ..errors import KvtransError
from ..files import sha256_file
from .translator import ObjectSpec, Translator

FORMAT = "mlx-kvtrans-translator"
FORMAT_VERSION = 1
FILES = ("weights.safetensors", "manifest.json")


def config_fingerprint(config: dict) -> str:
    """sha256 of the model's config.json, canonicalised (key order and path fields ignored)."""
    clean = {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}
    return hashlib.sha256(json.dumps(clean, sort_keys=True).encode()).hexdigest()


def weights_fingerprint(path: Path) -> str:
    """Cheap identity of a checkpoint's weights: file names, sizes and their first MiB."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def model_identity(lm) -> dict:
    """What a translator records of a model (a `LoadedModel`)."""
    return {"name": lm.name, "model_type": lm.model_type,
            "config_fingerprint": config_fingerprint(lm.config),
            "weights_fingerprint": weights_fingerprint(lm.path)}


def save(translator: Translator, directory: str | Path, source, target) -> Path:
    from .. import __version__

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "weights.safetensors"), translator.params)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "library_version": __version__,
        "source": model_identity(source), "target": model_identity(target),
        "source_point": translator.source_point, "token_identity": translator.token_identity,
        "objects": [spec.to_json() for spec in translator.specs],
        **translator.info,
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    sums = "".join(f"{sha256_file(directory / name)}  {name}\n" for name in FILES)
    (directory / "SHA256SUMS").write_text(sums)
    return directory


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a translator directory, after checking every file against SHA256SUMS."""
    directory = Path(directory)
    if not directory.is_dir():
        raise KvtransError(f"translator {directory} not found")
    sums_file = directory / "SHA256SUMS"
    if not sums_file.is_file():
        raise KvtransError(f"{directory} has no SHA256SUMS: not a translator directory")
    expected = {}
    for line in sums_file.read_text().splitlines():
        digest, _, name = line.partition("  ")
        expected[name] = digest
    for name in FILES:
        path = directory / name
        if name not in expected or not path.is_file():
            raise KvtransError(f"translator {directory} is incomplete: {name} missing")
        if sha256_file(path) != expected[name]:
            raise KvtransError(f"translator {directory}: {name} does not match SHA256SUMS "
                               "(modified or corrupt); refusing to load it")
    manifest = json.loads((directory / "manifest.json").read_text())
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise KvtransError(f"{directory} is not a version-{FORMAT_VERSION} {FORMAT} artifact")
    return manifest


def check_pair(manifest: dict, source, target) -> None:
    """Refuse a model pair the translator was not fitted for."""
    for role, lm in (("source", source), ("target", target)):
        want, have = manifest[role], model_identity(lm)
        for key in ("config_fingerprint", "weights_fingerprint"):
            if want[key] != have[key]:
                raise KvtransError(
                    f"this translator was fitted with {role} {want['name']!r} "
                    f"({want['model_type']}); {lm.name!r} is a different model "
                    f"({key.replace('_', ' ')} differs)")


def load(directory: str | Path, source=None, target=None) -> Translator:
    """Load a verified translator; with `source`/`target` given, also check they are its pair."""
    manifest = read_manifest(directory)
    if source is not None and target is not None:
        check_pair(manifest, source, target)
    params = mx.load(str(Path(directory) / "weights.safetensors"))
    specs = [ObjectSpec.from_json(s) for s in manifest["objects"]]
    info = {k: manifest[k] for k in ("fit", "metrics", "source", "target", "replay_shapes",
                                     "stage", "distill")
            if k in manifest}
    return Translator(manifest["source_point"], manifest["token_identity"], specs, params, info)


def shipped(source: str, target: str) -> Path | None:
    """The translator shipped under weights/translators for a zoo pair, distilled first."""
    from ..models import weights_dir

    for name in (f"{source}__{target}-distilled", f"{source}__{target}"):
        if (weights_dir() / "translators" / name / "manifest.json").exists():
            return weights_dir() / "translators" / name
    return None
