"""One resolver for every command: a zoo alias, a local directory or a Hugging Face id -> a loaded
mlx-lm model, with errors a user can act on instead of tracebacks."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import KvtransError, ModelNotFoundError
from .layouts import SUPPORTED_FAMILIES, check_supported

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model")


def weights_dir() -> Path:
    """Where the shipped zoo lives: `$KVTRANS_WEIGHTS`, else `weights/` of the checkout, else
    the copy installed with the package (`mlx_kvtrans/weights`)."""
    if env := os.environ.get("KVTRANS_WEIGHTS"):
        return Path(env)
    checkout = Path(__file__).resolve().parent.parent / "weights"
    if checkout.is_dir():
        return checkout
    return Path(__file__).resolve().parent / "weights"


def held_out_split(name: str) -> Path | None:
    """The zoo corpus's held-out `name` split ("validation" or "test"): the copy shipped with
    the package, else a local build in runs/corpus; None when neither exists."""
    for path in (weights_dir() / "corpus" / f"{name}.txt", Path("runs/corpus") / f"{name}.txt"):
        if path.is_file():
            return path
    return None


def zoo_aliases() -> dict[str, Path]:
    root = weights_dir()
    if not root.is_dir():
        return {}
    return {p.name: p for p in sorted(root.iterdir()) if (p / "config.json").is_file()}


def _looks_like_hf_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def resolve(name: str) -> Path:
    """The local directory of model `name`: zoo alias, existing directory, or HF id (cached, or
    downloaded unless HF_HUB_OFFLINE is set)."""
    aliases = zoo_aliases()
    if name in aliases:
        return aliases[name]
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(f"{name} is a file, not a model directory")
        return path
    if _looks_like_hf_id(name):
        return _hf_snapshot(name)
    known = ", ".join(aliases) or "none shipped yet"
    raise ModelNotFoundError(f"model {name!r} not found: not a zoo alias ({known}), a directory "
                             "or a Hugging Face id")


def _hf_snapshot(repo: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt",
                "*.jinja"]
    try:
        return Path(snapshot_download(repo, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo, allow_patterns=patterns))
    except Exception as err:
        raise ModelNotFoundError(f"model {repo!r} is not a zoo alias or directory and could not "
                                 f"be fetched from the Hugging Face hub "
                                 f"({type(err).__name__})") from None


def _hf_config(repo: str) -> Path:
    from huggingface_hub import hf_hub_download

    for local in (True, False):
        try:
            return Path(hf_hub_download(repo, "config.json", local_files_only=local))
        except Exception as err:
            error = err
    raise ModelNotFoundError(f"no config.json for {repo!r}: not in the local Hugging Face cache "
                             f"and not downloadable ({type(error).__name__})") from None


def read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{path} has no config.json: not a model directory")
    return _read_json_config(config_file)


def _read_json_config(config_file: Path) -> dict[str, Any]:
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise KvtransError(f"{config_file} is not valid JSON ({err.msg}, line {err.lineno})") from None
    if "model_type" not in config:
        raise KvtransError(f"{config_file} has no model_type")
    return config


@dataclass
class LoadedModel:
    name: str  # as the user gave it
    path: Path
    model: Any  # the mlx-lm nn.Module
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    config: dict[str, Any]

    @property
    def model_type(self) -> str:
        return self.config["model_type"]


def check_model_dir(path: Path) -> dict[str, Any]:
    """Validate a model directory before loading anything heavy; returns its config."""
    config = read_config(path)
    check_supported(config["model_type"])
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise KvtransError(f"{path} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if not (path / "tokenizer_config.json").is_file():
        # transformers then builds an empty tokenizer that encodes every text to [].
        raise KvtransError(f"{path} has no tokenizer_config.json: its tokenizer would be empty")
    if not any(path.glob("model*.safetensors")):
        raise KvtransError(f"{path} has no model*.safetensors weights")
    return config


def load(name: str, dtype=None, lazy: bool = False) -> LoadedModel:
    """Load model `name` (zoo alias, directory or HF id) with mlx-lm.

    `dtype`: compute dtype. By default half-precision checkpoints compute in float32 on a CPU
    (bf16 matmuls are ~8x slower there) and in their own dtype on a GPU. `lazy`: the weights
    are read from disk only when first computed with (mlx-lm's `lazy`).
    """
    import mlx_lm
    from transformers.utils import logging as hf_logging

    path = resolve(str(name))
    config = check_model_dir(path)
    hf_logging.set_verbosity_error()  # tokenizer loading warns about unrelated config fields
    try:
        model, tokenizer = mlx_lm.load(str(path), lazy=lazy)
    except Exception as err:  # a malformed checkpoint is bad input, not an internal failure
        raise KvtransError(f"mlx-lm could not load {path}: {type(err).__name__}: {err}") from None
    if not tokenizer.encode("hello world"):
        raise KvtransError(f"the tokenizer of {path} encodes text to nothing: it is unusable")
    _set_compute_dtype(model, dtype)
    return LoadedModel(str(name), path, model, tokenizer, config)


def load_config_only(name: str) -> LoadedModel:
    """A model built from `config.json` alone, for planning: `name` is a config.json file, a
    directory holding one (weights need not be there), a zoo alias or a Hugging Face id in the
    local cache. Its modules are lazy: nothing is allocated, and it must not be run."""
    from mlx_lm.utils import _get_classes

    given = Path(str(name)).expanduser()
    if given.is_file():
        path, config = given.parent, _read_json_config(given)
    elif name not in zoo_aliases() and not given.exists() and _looks_like_hf_id(str(name)):
        config_file = _hf_config(str(name))  # the config alone: never the weights
        path, config = config_file.parent, _read_json_config(config_file)
    else:
        path = given if given.is_dir() else resolve(str(name))
        config = read_config(path)
    check_supported(config["model_type"])
    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    except Exception as err:
        raise KvtransError(f"mlx-lm could not build a model from {path}'s config: "
                           f"{type(err).__name__}: {err}") from None
    return LoadedModel(str(name), path, model, None, config)


def tokenizer_of(lm: LoadedModel):
    """`lm`'s tokenizer, read from its directory when it was loaded from its config alone
    (`load_config_only`)."""
    if lm.tokenizer is not None:
        return lm.tokenizer
    from mlx_lm.utils import load_tokenizer

    if not any((Path(lm.path) / f).is_file() for f in TOKENIZER_FILES):
        raise KvtransError(f"{lm.path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): give "
                           "a model directory to read --data with")
    try:
        return load_tokenizer(Path(lm.path))
    except Exception as err:
        raise KvtransError(f"could not read the tokenizer of {lm.path}: "
                           f"{type(err).__name__}: {err}") from None


def cast_parameters(model, dtype) -> None:
    """Cast floating parameters to `dtype`, except those the model keeps in float32 (mlx-lm's
    `cast_predicate`, e.g. A_log, dt_bias, router biases)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    keep = getattr(model, "cast_predicate", lambda key: True)
    params = [(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and keep(k) else v)
              for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))


def _set_compute_dtype(model, dtype) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if dtype is None:
        if mx.default_device() != mx.cpu:
            return
        floats = {v.dtype for _, v in tree_flatten(model.parameters())}
        if not floats & {mx.bfloat16, mx.float16}:
            return
        dtype = mx.float32
    cast_parameters(model, dtype)


# -- identity: what a translator records of the models it was fitted for ----------------------
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


# what a conversion may change in config.json without changing the model
CONVERSION_KEYS = ("quantization", "quantization_config", "torch_dtype", "dtype",
                   "vision_config")  # mlx-lm's conversion keeps the text model alone
LINEAGE_COLUMNS = 128  # values of each tensor's recorded row: a multiple of every group size
CONVERSION_DTYPES = ("float32", "bfloat16", "float16")  # what mlx-lm converts to
REQUANTIZED_COSINE = 0.98  # rows quantized two ways (4-bit vs 8-bit: about 0.99)


def architecture_fingerprint(config: dict) -> str:
    """`config_fingerprint` without what quantizing or casting a checkpoint changes."""
    return config_fingerprint({k: v for k, v in config.items() if k not in CONVERSION_KEYS})


def input_embedding(model) -> Any:
    """The token embedding of an mlx-lm model (the first embedding in its module tree)."""
    for _, module in model.named_modules():
        if type(module).__name__ in ("Embedding", "QuantizedEmbedding"):
            return module
    raise ValueError("the model has no token embedding")


def vocabulary_rows(model) -> int:
    """How many token ids `model` embeds: its config's `vocab_size` (which stays when a server
    unloads the weights), else its embedding's rows."""
    found = model.__dict__.get("_kvtrans_vocabulary")
    if found is None:
        sizes = (getattr(getattr(m, "args", None), "vocab_size", None)
                 for m in [model] + [m for _, m in model.named_modules()])
        found = next((v for v in sizes if isinstance(v, int)), None)
        found = model.__dict__["_kvtrans_vocabulary"] = (
            found if found is not None else input_embedding(model).weight.shape[0])
    return found


def embedding_dims(model) -> int:
    """Width of the model's token embedding (a quantized one packs its weight's columns)."""
    embed = input_embedding(model)
    return getattr(embed, "dims", None) or embed.weight.shape[-1]


def _quantized_modules(model) -> dict[str, Any]:
    """Path -> module for every quantized module (QuantizedLinear, QuantizedEmbedding,
    mlx-lm's QuantizedSwitchLinear...): they hold packed `weight`, `scales` and `biases`."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "scales") and hasattr(m, "bits") and hasattr(m, "group_size")}


def _row(value, row: int | None = None):
    """(row index, its first LINEAGE_COLUMNS values) of a tensor seen as (rows, last dim)."""
    flat = value.reshape(-1, value.shape[-1]) if value.ndim > 1 else value.reshape(1, -1)
    row = flat.shape[0] // 2 if row is None else row
    return row, flat[row]


def _packed_row(module, params: dict, owner: str, row: int | None = None):
    """(row, [packed weight, scales, biases] of that row's first LINEAGE_COLUMNS columns)."""
    columns = LINEAGE_COLUMNS // module.group_size
    parts = [params[f"{owner}.weight"], params[f"{owner}.scales"], params.get(f"{owner}.biases")]
    widths = [LINEAGE_COLUMNS * module.bits // 32, columns, columns]
    found = []
    for part, width in zip(parts, widths):
        if part is not None:
            row, values = _row(part, row)
            found.append(values[:width])
    return row, found


def _logical_shape(value, module=None) -> list[int]:
    """(rows, columns) of a tensor seen as (rows, last dim), columns unpacked if quantized."""
    rows = value.size // value.shape[-1] if value.ndim > 1 else 1
    return [rows, value.shape[-1] * 32 // module.bits if module is not None else value.shape[-1]]


def _quantization(module) -> dict:
    return {"bits": module.bits, "group_size": module.group_size,
            "mode": getattr(module, "mode", "affine")}


def _dequantized(quantization: dict, parts):
    import mlx.core as mx

    w, scales, *biases = [p[None] for p in parts]
    return mx.dequantize(w, scales, biases[0] if biases else None, quantization["group_size"],
                         quantization["bits"], mode=quantization["mode"])[0]


def _encode(a) -> str:
    import base64

    import mlx.core as mx
    import numpy as np

    a = a if a.dtype == mx.uint32 else a.astype(mx.float32)
    return base64.b64encode(np.asarray(a).tobytes()).decode()


def _decode(text: str, packed: bool = False):
    import base64

    import mlx.core as mx
    import numpy as np

    return mx.array(np.frombuffer(base64.b64decode(text),
                                  dtype=np.uint32 if packed else np.float32))


def lineage(model) -> dict:
    """A fixed row of every parameter tensor (its first LINEAGE_COLUMNS values) as the
    checkpoint holds it: its packed weight, scales and biases where the module is quantized.
    `lineage_difference` re-rounds or re-quantizes these rows to tell a checkpoint's
    conversions from any other weights, one changed matrix included."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    quantized = _quantized_modules(model)
    rows = {}
    for name, value in sorted(params.items()):
        owner, _, leaf = name.rpartition(".")
        if owner in quantized and leaf in ("scales", "biases"):
            continue  # read with their weight
        if owner in quantized and leaf == "weight":
            row, parts = _packed_row(quantized[owner], params, owner)
            rows[name] = {"row": row, "shape": _logical_shape(value, quantized[owner]),
                          "quantization": _quantization(quantized[owner]),
                          "packed": [_encode(p) for p in parts]}
        else:
            row, values = _row(value)
            rows[name] = {"row": row, "shape": _logical_shape(value),
                          "values": _encode(values[:LINEAGE_COLUMNS])}
    return {"rows": rows}


def _same_packed(quantized: list, packed: list) -> bool:
    import mlx.core as mx

    return len(quantized) == len(packed) and all(
        mx.array_equal(a.astype(b.dtype), b).item() for a, b in zip(quantized, packed))


def lineage_difference(recorded: dict, model) -> str:
    """"" when `model` holds every row `recorded` (a `lineage`): the same values rounded to a
    float dtype (a conversion's, before the loader widens them), or quantized as the other
    side is, which reproduces the packed rows exactly; else the name of the first tensor that
    differs. A sharded model is read for the tensors it holds whole."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    quantized = _quantized_modules(model)
    dtypes = [getattr(mx, name) for name in CONVERSION_DTYPES]

    def requantized(values, q) -> list:  # the row quantized from each float dtype
        return [[a[0] for a in mx.quantize(values.astype(dtype)[None], q["group_size"],
                                           q["bits"], mode=q["mode"])] for dtype in dtypes]

    for name, entry in recorded["rows"].items():
        owner, _, leaf = name.rpartition(".")
        module = quantized.get(owner) if leaf == "weight" else None
        if name not in params or _logical_shape(params[name], module) != entry.get(
                "shape", _logical_shape(params[name], module)):
            continue  # a shard's (mlx-lm's pipeline or tensor sharding): held elsewhere
        recorded_q = entry.get("quantization")
        if recorded_q:
            want = [_decode(p, packed=i == 0) for i, p in enumerate(entry["packed"])]
        else:
            want = _decode(entry["values"])
        if module is not None:
            _, have = _packed_row(module, params, owner, entry["row"])
            have_q = _quantization(module)
            if recorded_q is None:
                same = any(_same_packed(q, have) for q in requantized(want, have_q))
            elif recorded_q == have_q:
                same = _same_packed(have, want)
            else:  # quantized two ways: only near
                a, b = (_dequantized(recorded_q, want), _dequantized(have_q, have))
                cosine = (a * b).sum() / (mx.linalg.norm(a) * mx.linalg.norm(b))
                same = cosine.item() >= REQUANTIZED_COSINE
        else:
            _, have = _row(params[name], entry["row"])
            have = have[:LINEAGE_COLUMNS]
            if recorded_q:  # the recorded model was quantized, this one not
                same = any(_same_packed(q, want) for q in requantized(have, recorded_q))
            else:
                same = any(mx.array_equal(want.astype(dtype).astype(have.dtype), have).item()
                           for dtype in dtypes)
        if not same:
            return name
    return ""


def model_identity(lm, with_lineage: bool = True) -> dict:
    """What a translator records of a model (a `LoadedModel`): its exact checkpoint, and what
    lets the checkpoint's quantizations be told from other weights (`lineage`; a check reads
    the model itself against the recorded one, so it takes the identity without it)."""
    identity = {"name": lm.name, "model_type": lm.model_type,
                "config_fingerprint": config_fingerprint(lm.config),
                "weights_fingerprint": weights_fingerprint(lm.path),
                "architecture_fingerprint": architecture_fingerprint(lm.config),
                "quantization": lm.config.get("quantization")}
    return {**identity, "lineage": lineage(lm.model)} if with_lineage else identity


__all__ = ["LoadedModel", "SUPPORTED_FAMILIES", "architecture_fingerprint", "config_fingerprint",
           "embedding_dims", "input_embedding", "lineage", "lineage_difference", "load",
           "load_config_only", "model_identity", "resolve", "weights_dir", "weights_fingerprint",
           "zoo_aliases"]
