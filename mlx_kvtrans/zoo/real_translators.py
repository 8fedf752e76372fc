"""Translators between the real family's members, both ways, fitted and distilled at the lengths
users send, on text rendered in the family's chat template: `kvtrans zoo real-translators DIR`.

Each direction SOURCE__TARGET is fitted in closed form (`workflows.fit_translator`, windows of
every served length, layers assigned by best fit; between members of different depths, each map
reads the `depth_nu` source layers around its relative depth instead), then distilled against
the target reading its own cache (`workflows.distill_translator`, keeping the parameters of the
lowest held-out KL, the closed-form start included), and written to
DIR/translators/SOURCE__TARGET. Stage 1 and the distillation's checkpoints live in
DIR/.build/translators/SOURCE__TARGET until then, so a stopped run resumes where it stopped;
stage 1 stays there (`stage1`), so what stage 2 changed can be measured;
DIR/translators/record.json keeps what each direction cost.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import KvtransError
from .real import CONTINUED, DSA, GDN, KDA, MLA, PARENT, SIBLING, chat_text

PAIRS = ((PARENT, SIBLING), (PARENT, CONTINUED), (PARENT, MLA), (PARENT, GDN), (MLA, KDA),
         (MLA, DSA))
DIRECTIONS = tuple(f"{a}__{b}" for pair in PAIRS for a, b in (pair, pair[::-1]))
RECORD = "record.json"


@dataclass(frozen=True)
class TranslatorConfig:
    lengths: tuple[int, ...] = (256, 512, 1024, 2048)  # fitting windows of every served length
    tokens: int = 32_768  # fitting tokens, spread over the lengths
    assign: str = "best"  # each target layer's source layer: the one that fits it best
    # members of different depths: the target layers past a dropped block read none of the
    # source's layers alone as well as three around their relative depth (docs/real-checkpoints.md)
    depth_nu: int = 3
    distill_steps: int = 20  # stage 2 within a few minutes a direction on 2 cores
    distill_batch: int = 4
    distill_max_prefix: int = 512
    validate_every: int = 5
    validation_windows: int = 16  # held-out windows of the distillation's KL
    # held-out switches per kind and band calibrating the gate, fit and distillation each: a
    # real pair's switch takes about a second here, and the default's 256 take minutes
    gate_windows: int = 24
    extra: dict = field(default_factory=dict)  # FitConfig fields beyond these


def chat_files(family: Path, tokenizer, work: Path, text: Path | None = None
               ) -> tuple[Path, Path]:
    """(train, validation): `text` (default the corpus's train split) and the validation split
    rendered by `chat_text` into `work`."""
    from ..models import held_out_split
    from .real import train_split

    work.mkdir(parents=True, exist_ok=True)
    out = []
    for name, source in (("train", text or train_split(family / ".build", None)),
                         ("validation", held_out_split("validation"))):
        path = work / f"chat-{name}.txt"
        if not path.is_file():
            path.write_text(chat_text(tokenizer, Path(source).read_text(errors="replace")))
        out.append(path)
    return out[0], out[1]


def missing_members(family: Path, directions) -> list[str]:
    wanted = {m for d in directions for m in d.split("__")}
    return sorted(m for m in wanted if not (family / m / "config.json").is_file())


def build(family: Path, directions=DIRECTIONS, config: TranslatorConfig = TranslatorConfig(),
          force: bool = False, log=print, progress=None, text: Path | None = None) -> dict:
    """Fit and distil `directions` into family/translators/NAME, keeping those already there
    (`force` redoes them); returns the record (family/translators/RECORD).
    `progress(stage, done, total, what)` follows each fit and distillation; `text`: the fitting
    text before rendering (default: the corpus's train split)."""
    from .. import load
    from ..training.distill import DistillConfig
    from ..training.fit import FitConfig
    from ..training.workflows import distill_translator, fit_translator

    unknown = [d for d in directions if d not in DIRECTIONS]
    if unknown:
        raise KvtransError(f"{unknown[0]}: choose among {', '.join(DIRECTIONS)}")
    missing = missing_members(family, directions)
    if missing:
        raise KvtransError(f"{family} lacks {', '.join(missing)}: build them first with "
                           f"`kvtrans zoo real {family}`")
    log = log or (lambda line: None)
    family = family.resolve()  # the manifests name the models by path, from anywhere
    out, work = family / "translators", family / ".build" / "translators"
    record_file = out / RECORD
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    record["config"] = asdict(config)
    record.setdefault("directions", {})
    out.mkdir(parents=True, exist_ok=True)
    train, validation = None, None
    for name in directions:
        final, build_dir = out / name, work / name
        if force:
            for path in (final, build_dir):
                shutil.rmtree(path, ignore_errors=True)
            record["directions"].pop(name, None)
        if (final / "manifest.json").is_file():
            log(f"{name}: kept ({final})")
            continue
        source, target = (load(str(family / m)) for m in name.split("__"))
        if train is None:
            train, validation = chat_files(family, source.tokenizer, work, text)
        stage1 = build_dir / "stage1"
        entry = record["directions"].setdefault(name, {})
        if not (stage1 / "manifest.json").is_file():
            log(f"{name}: fitting")
            started = time.perf_counter()
            depths = {len(m.model.layers) for m in (source, target)}
            layers = ({"assign": config.assign} if len(depths) == 1 else
                      {"assign": "relative", "nu": config.depth_nu})
            fit = FitConfig(**{"windows": config.tokens // config.lengths[0],
                               "length": config.lengths[0], "mix": tuple(config.lengths),
                               **layers, **config.extra})
            # no gate for stage 1: the distilled translator is calibrated as it is saved
            fit_translator(source, target, [train], fit, out=stage1,
                           workdir=build_dir / "fit",
                           resume=(build_dir / "fit").is_dir(),
                           progress=progress)
            entry["fit_minutes"] = round((time.perf_counter() - started) / 60, 2)
            record_file.write_text(json.dumps(record, indent=2) + "\n")
        log(f"{name}: distilling")
        started = time.perf_counter()
        workdir = build_dir / "distill"
        distilled = distill_translator(
            stage1, [train], validation,
            DistillConfig(steps=config.distill_steps, batch=config.distill_batch,
                          max_prefix=config.distill_max_prefix, keep="best",
                          validate_every=config.validate_every,
                          validation_windows=config.validation_windows),
            out=final, workdir=workdir, resume=(workdir / "state.json").is_file(),
            gate_windows=config.gate_windows, progress=progress)
        summary = distilled.summary
        entry.update({"distill_minutes": round((time.perf_counter() - started) / 60, 2),
                      "validation_kl": [summary["validation_kl_before"],
                                        summary["best"]["validation_kl"]],
                      "kept_step": summary["best"]["step"], "trained": summary["trained"]})
        record_file.write_text(json.dumps(record, indent=2) + "\n")
        for checkpoints in (build_dir / "fit", workdir):
            shutil.rmtree(checkpoints, ignore_errors=True)
        log(f"{name}: written to {final}")
    return record
