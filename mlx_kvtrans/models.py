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
LINEAGE_SAMPLES = 16  # embedding rows and columns sampled
NORM_TOLERANCE = 1e-2  # relative: a norm rounded to bfloat16 moves by at most 2^-8
EMBEDDING_COSINE = 0.9  # 4-bit affine, group 32: 0.997 on the zoo; other weights: about 0


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


def lineage(model) -> dict:
    """What a checkpoint's quantizations keep of its weights: the norms' scales (mlx-lm never
    quantizes them; a conversion at most rounds them to its dtype) and a fixed sample of the
    token embedding, dequantized. Other weights of the same config differ in one or the other:
    a fine-tune moves its norms, another seed its embedding."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    embed = input_embedding(model)
    rng = np.random.default_rng(0)
    rows = np.sort(rng.choice(embed.weight.shape[0], LINEAGE_SAMPLES, replace=False))
    values = embed(mx.array(rows)).astype(mx.float32)
    cols = np.sort(rng.choice(values.shape[-1], LINEAGE_SAMPLES, replace=False))
    norms = [v for k, v in sorted(tree_flatten(model.parameters())) if v.ndim == 1 and "norm" in k]
    norms = [norms[i].reshape(-1)[:4].astype(mx.float32)  # 4 values of at most 64 norms
             for i in np.unique(np.linspace(0, len(norms) - 1, min(len(norms), 64)).round()
                                .astype(int))] if norms else []
    def floats(x):
        return [float(f"{v:.6g}") for v in np.array(x).ravel()]
    return {"norms": floats(mx.concatenate(norms)) if norms else [],
            "embedding": floats(values[:, mx.array(cols)])}


def same_lineage(recorded: dict, have: dict) -> bool:
    """Whether two `lineage` readings are of one checkpoint's weights (quantized or not)."""
    import numpy as np

    a, b = (np.array(recorded["norms"]), np.array(have["norms"]))
    e, f = (np.array(recorded["embedding"]), np.array(have["embedding"]))
    if a.shape != b.shape or e.shape != f.shape or not e.size:
        return False
    close = np.abs(a - b) <= NORM_TOLERANCE * np.maximum(np.abs(a), np.abs(b)) + 1e-6
    cosine = float(e @ f / max(np.linalg.norm(e) * np.linalg.norm(f), 1e-30))
    return bool(close.all()) and cosine >= EMBEDDING_COSINE


def model_identity(lm) -> dict:
    """What a translator records of a model (a `LoadedModel`): its exact checkpoint, and what
    lets the checkpoint's quantizations be told from other weights (`lineage`)."""
    return {"name": lm.name, "model_type": lm.model_type,
            "config_fingerprint": config_fingerprint(lm.config),
            "weights_fingerprint": weights_fingerprint(lm.path),
            "architecture_fingerprint": architecture_fingerprint(lm.config),
            "quantization": lm.config.get("quantization"),
            "lineage": lineage(lm.model)}


__all__ = ["LoadedModel", "SUPPORTED_FAMILIES", "architecture_fingerprint", "config_fingerprint",
           "embedding_dims", "input_embedding", "lineage", "load", "load_config_only",
           "model_identity", "resolve", "same_lineage", "weights_dir", "weights_fingerprint",
           "zoo_aliases"]
