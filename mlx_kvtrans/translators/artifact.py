"""The translator artifact: a directory any version of the library saves and loads one way.

    weights.safetensors   every parameter ("layer<L>.<object>.weight|bias|A|B|k.weight...")
    manifest.json         source/target identity and fingerprints, each object's recipe entry
                          (recipe, capture point, source layers, ...), token identity, fit data
                          hash, library version, metrics
    SHA256SUMS            hashes of the two files above

Loading verifies the hashes and that the given models are the ones it was fitted for; a tampered
file or a wrong pair is refused with a message. Only JSON and safetensors are read: nothing is
unpickled. Format 1 (parameters named "<L>.<object>...", replay shapes beside the objects) is
migrated on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .._version import __version__
from ..errors import KvtransError
from ..files import sha256_file
from ..layouts import CapturePoint
from ..models import lineage_difference, model_identity
from . import frontier
from .recipes import recipe_from_json
from .random_features import RandomFeatures
from .token_identity import TokenIdentity
from .translator import Translator

FORMAT = "mlx-kvtrans-translator"
FORMAT_VERSION = 2
# 3: some maps read no random features (`expand` off), which a version-2 reader would not know
SELECTIVE_EXPANSION_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
INFO_FIELDS = ("fit", "metrics", "source", "target", "stage", "distill", "features", "gate",
               "alignment", "sink", "relay")
FILES = ("weights.safetensors", "manifest.json")


def save(translator: Translator, directory: str | Path, source, target) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # a frontier measured of the weights replaced here no longer says anything
    (directory / frontier.FILE).unlink(missing_ok=True)
    mx.save_safetensors(str(directory / "weights.safetensors"), translator.params)
    manifest = {
        "format": FORMAT, "library_version": __version__,
        "format_version": SELECTIVE_EXPANSION_VERSION if any(
            not getattr(r, "expand", True) for r in translator.recipes) else FORMAT_VERSION,
        "source": model_identity(source), "target": model_identity(target),
        "source_point": int(translator.source_point),
        "token_identity": translator.identity.mode,
        "objects": [recipe.to_json() for recipe in translator.recipes],
        **({"random_features": translator.expansion.to_json()} if translator.expansion else {}),
        **{k: v for k, v in translator.info.items() if k in INFO_FIELDS
           and k not in ("source", "target")},
    }
    _write_manifest(directory, manifest)
    return directory


def store_as(directory: str | Path, out: str | Path, dtype: mx.Dtype = mx.bfloat16) -> Path:
    """A copy of the translator at `directory` in `out` with its float32 matrices stored in
    `dtype` (bfloat16 halves a wide map's bytes; its rounding is far below a map's own error,
    which the frontier measures); vectors stay as they are. Translation reads them as float32.
    The gate's calibration is copied: recalibrate (`calibrate_directory`) to judge the copy's
    own translations."""
    directory, out = resolve(directory), Path(out)
    params = mx.load(str(directory / "weights.safetensors"))
    params = {k: v.astype(dtype) if v.ndim >= 2 and v.dtype == mx.float32 else v
              for k, v in params.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / frontier.FILE).unlink(missing_ok=True)
    mx.save_safetensors(str(out / "weights.safetensors"), params)
    _write_manifest(out, read_manifest(directory))
    return out


def _write_manifest(directory: Path, manifest: dict) -> None:
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    sums = "".join(f"{sha256_file(directory / name)}  {name}\n" for name in FILES)
    (directory / "SHA256SUMS").write_text(sums)


def update_manifest(directory: str | Path, **fields) -> Path:
    """Set manifest `fields` (of INFO_FIELDS, not the model identities) of a verified translator
    directory, in the format version it was written in; weights.safetensors is left byte for
    byte, SHA256SUMS rewritten."""
    unknown = set(fields) - set(INFO_FIELDS) | set(fields) & {"source", "target"}
    if unknown:
        raise ValueError(f"not manifest info fields: {', '.join(sorted(unknown))}")
    directory = resolve(directory)
    manifest = read_manifest(directory)
    manifest.update(fields)
    _write_manifest(directory, manifest)
    return directory


def shipped_names() -> list[str]:
    from ..models import weights_dir

    root = weights_dir() / "translators"
    return sorted(p.name for p in root.iterdir() if (p / "manifest.json").is_file()) \
        if root.is_dir() else []


def resolve(name: str | Path) -> Path:
    """A translator directory, or the name of a shipped one (`kimi-linear__kimi-vl-distilled`)."""
    from ..models import weights_dir

    path = Path(name)
    if path.is_dir():
        return path
    if not path.exists() and str(name) in shipped_names():
        return weights_dir() / "translators" / str(name)
    if path.exists():
        raise KvtransError(f"translator {name} is a file, not a translator directory")
    raise KvtransError(f"translator {name} not found: not a directory nor a shipped translator "
                       f"({', '.join(shipped_names()) or 'none shipped'})")


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a translator directory (or shipped name), after checking every file
    against SHA256SUMS."""
    directory = resolve(directory)
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
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KvtransError(f"translator {directory}: manifest.json is not valid JSON ({e})")
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise KvtransError(f"{directory} is not an {FORMAT} artifact")
    if version not in READABLE_VERSIONS:
        raise KvtransError(f"{directory} is format version {version!r}; this library reads "
                           f"versions {', '.join(map(str, READABLE_VERSIONS))} (upgrade "
                           "mlx-kvtrans to read a newer one)")
    return manifest


def _migrate_v1(manifest: dict, params: dict) -> tuple[dict, dict]:
    """Format 1 -> 2: "<L>.<object>..." names become "layer<L>.<object>...", and replay shapes
    move into their objects' entries."""
    def renamed(key: str) -> str:
        layer, _, rest = key.partition(".")
        return f"layer{layer}.{rest}" if layer.isdigit() else key

    manifest = dict(manifest)
    shapes = manifest.pop("replay_shapes", {})
    manifest["objects"] = [
        {**entry, **({"shapes": shapes[f"{entry['layer']}.{entry['name']}"]}
                     if f"{entry['layer']}.{entry['name']}" in shapes else {})}
        for entry in manifest["objects"]]
    manifest["metrics"] = {renamed(k): v for k, v in manifest.get("metrics", {}).items()}
    manifest["format_version"] = FORMAT_VERSION
    return manifest, {renamed(k): v for k, v in params.items()}


def check_pair(manifest: dict, source, target, identities: tuple | None = None) -> str:
    """Refuse a model pair the translator was not fitted for. A model may be a quantization (or
    other conversion) of the checkpoint it was fitted on: the same architecture, and every
    tensor's recorded row held as it would be rounded or quantized
    (`models.lineage_difference`). Returns "" for the very checkpoints, else a note naming the
    converted ones. `identities`: the two models' `model_identity`, when already taken."""
    notes = []
    identities = identities or tuple(model_identity(lm, with_lineage=False)
                                     for lm in (source, target))
    for role, lm, have in (("source", source, identities[0]), ("target", target, identities[1])):
        want = manifest[role]
        differs = next((key for key in ("config_fingerprint", "weights_fingerprint")
                        if want[key] != have[key]), None)
        same_architecture = want.get("architecture_fingerprint") == \
            have["architecture_fingerprint"]
        rows = want.get("lineage", {}).get("rows")
        changed = lineage_difference(want["lineage"], lm.model) if same_architecture and rows \
            else None
        if differs is None and not changed:
            continue
        if changed == "":
            notes.append(f"{role} {lm.name} is {_conversion(have)} of {want['name']}, which it "
                         f"was fitted on")
            continue
        why = (f"the same architecture with other weights: {changed} differs" if changed
               else f"{differs.replace('_', ' ')} differs")
        raise KvtransError(
            f"this translator was fitted with {role} {want['name']!r} "
            f"({want['model_type']}); {lm.name!r} is a different model ({why})")
    return "; ".join(notes)


def _conversion(identity: dict) -> str:
    q = identity.get("quantization")
    if not q:
        return "a conversion"
    return (f"a {q.get('bits', '?')}-bit {q.get('mode', 'affine')} quantization (group "
            f"{q.get('group_size', '?')})")


def load(directory: str | Path, source=None, target=None) -> Translator:
    """Load a verified translator. With `source` (a LoadedModel) a codebook translator loads
    the source's codebook when first needed; with `target` too, the pair is checked, and a
    translator between models that tokenize differently learns their tokenizers
    (`translate_cache` then reads the source's own tokens of a text)."""
    directory = resolve(directory)
    manifest = read_manifest(directory)
    conversion = ""
    if source is not None and target is not None:
        try:
            conversion = check_pair(manifest, source, target)
        except (KeyError, TypeError) as e:
            raise KvtransError(f"translator {directory}: its manifest does not name its models "
                               f"({type(e).__name__}: {e})")
    try:
        params = dict(mx.load(str(directory / "weights.safetensors")))
    except (RuntimeError, ValueError) as e:  # consistent sums, unreadable file
        raise KvtransError(f"translator {directory}: weights.safetensors is unreadable ({e})")
    try:
        if manifest["format_version"] == 1:
            manifest, params = _migrate_v1(manifest, params)
        identity = TokenIdentity(manifest["token_identity"])
        recipes = [recipe_from_json(entry) for entry in manifest["objects"]]
        point = CapturePoint(manifest["source_point"])
        expansion = RandomFeatures.from_json(manifest.get("random_features"))
    except (KeyError, TypeError, ValueError) as e:
        raise KvtransError(f"translator {directory}: its manifest is incomplete or garbled "
                           f"({type(e).__name__}: {e})")
    if source is not None:
        identity.bind(source)
    info = {k: manifest[k] for k in INFO_FIELDS if k in manifest}
    translator = Translator(point, identity, recipes, params, info, expansion=expansion)
    if conversion:
        translator.info["fitted_on"] = conversion
    if "alignment" in manifest and source is not None and target is not None:
        translator.tokenizers = (source.tokenizer, target.tokenizer)
    if (directory / frontier.FILE).is_file():  # what the fidelity dial chooses from
        try:
            translator.frontier = frontier.load(directory)
        except KvtransError as e:  # the translator still works; its dial falls back to R = 0
            translator.info["frontier_problem"] = str(e)
    return translator


def shipped(source: str, target: str) -> Path | None:
    """The translator shipped under weights/translators for a zoo pair, distilled first."""
    from ..models import weights_dir

    for name in (f"{source}__{target}-distilled", f"{source}__{target}"):
        if (weights_dir() / "translators" / name / "manifest.json").exists():
            return weights_dir() / "translators" / name
    return None


def shipped_for(source, target) -> Path | None:
    """The shipped translator for two loaded models: by their zoo names, else the one fitted on
    the checkpoints they are quantizations of (`check_pair`)."""
    from ..models import weights_dir

    found = shipped(source.name, target.name)
    if found is not None:
        return found
    identities = tuple(model_identity(lm, with_lineage=False) for lm in (source, target))
    for name in sorted(shipped_names(), key=lambda n: not n.endswith("-distilled")):
        directory = weights_dir() / "translators" / name
        try:
            manifest = read_manifest(directory)
            if (manifest["source"].get("architecture_fingerprint") is None
                    or manifest["target"].get("architecture_fingerprint") is None):
                continue
            check_pair(manifest, source, target, identities)
        except (KvtransError, KeyError, TypeError):
            continue
        return directory
    return None
