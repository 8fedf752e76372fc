"""Workflows: what `kvtrans fit` and `kvtrans distill` do, as one library call each.

The stages take token arrays and return translators: `training.fit` (stage 1, closed form)
and `training.distill` (stage 2, KL through the target). A workflow takes what a user names
(models, text files, a translator directory) and does the whole job around a stage:

    fit_translator      load the pair, plan and refuse a plan too big for this machine, read
                        the text, draw windows (needles among them), assign layers, fit,
                        calibrate the fidelity gate on held-out text, save
    distill_translator  load a saved translator and its pair, read the text, distil (resumable,
                        shared among `mlx.launch` processes), calibrate the gate anew, save

Calibration (`calibrate.py`) runs whole `Session` switches, so it is added here, above the
session and both stages. `progress(stage, done, total, what)` follows every long step; a
command draws its bars from it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .calibrate import WINDOWS, CalibrationConfig, calibrate
from .relay_choice import choose as choose_relay
from ..errors import KvtransError
from .machines import Machine, this_machine
from ..models import LoadedModel, embedding_dims, load, model_identity
from ..translators import artifact
from .attention_weights import attention_sink
from .distill import CHECKPOINT_FILES, DistillConfig, Distiller
from .fit import FIT_BATCH, FitConfig, fit, mixed_windows, token_windows
from .fit_checkpoint import FitCheckpoint
from ..backend.processes import launched_group, summed
from ..tokens import plain_text
from ..translators.translator import Translator

Progress = Callable[[str, int, "int | None", str], None]  # (stage, done, total, what)
ASSIGNMENTS = ("relative", "best")  # layer assignment: by relative depth, or best single fit


def loaded(model: str | Path | LoadedModel) -> LoadedModel:
    """A model as the workflows hold it: a zoo alias, directory or HF id is loaded."""
    return model if isinstance(model, LoadedModel) else load(str(model))


def same_tokenizer(a: LoadedModel, b: LoadedModel) -> bool:
    """Whether two models read the same token ids. From configs alone (no tokenizer loaded,
    `models.load_config_only`), vocabularies of different sizes cannot be the same one, and
    equal sizes are taken to be."""
    if a.tokenizer is None or b.tokenizer is None:
        from ..models import input_embedding

        return (input_embedding(a.model).weight.shape[0]
                == input_embedding(b.model).weight.shape[0])
    return a.tokenizer.get_vocab() == b.tokenizer.get_vocab()


def for_pair(src: LoadedModel, tgt: LoadedModel, config: FitConfig) -> FitConfig:
    """`config` as a fit of this pair runs it: across tokenizers, `across_tokenizers`'s."""
    return config if same_tokenizer(src, tgt) else across_tokenizers(src, tgt, config)


def read_ids(tokenizer, files: Sequence[str | Path], progress: Progress | None = None
             ) -> list[int]:
    """The token ids of text files (cached by `tokens`), refused when there are none."""
    from ..tokens import encode_files

    def step(done, total=None, what=""):
        if progress:
            progress("reading", done, total, what)

    ids = encode_files(tokenizer, [Path(f) for f in files], step)
    if not ids:
        raise KvtransError(f"no text in {', '.join(map(str, files))}")
    return ids


def fitting_text_tokens(source: LoadedModel, files: Sequence[str | Path],
                        config: FitConfig) -> int:
    """The tokens of `files` a fit with `config` draws its windows from, read as `kvtrans fit`
    reads them (tokenized once, then cached, so the fit a plan projects finds them read); a
    text shorter than one window is refused, as the fit refuses it."""
    from ..models import tokenizer_of

    ids = read_ids(tokenizer_of(source), files)
    if len(ids) <= config.length:
        raise KvtransError(f"the fitting text has {len(ids)} tokens: fewer than one window of "
                           f"{config.length}")
    return len(ids)


def training_needles(encode, texts: Sequence[str], length: int, count: int = 2000,
                     as_text: bool = False) -> list[list[int]] | list[str]:
    """Synthetic needles (training seeds) of at least `length` tokens, their filler sentences
    drawn from the training `texts`: the rows `needle_share` mixes into fitting windows and
    distillation batches, question and answer last (`as_text`: the needles' text)."""
    from ..evaluation.needles import filler_sentences, needle_rows, needle_texts

    make = needle_texts if as_text else needle_rows
    return make(encode, filler_sentences(list(texts), limit=20_000), length, count=count)


def chat_training_needles(tokenizer, texts: Sequence[str], length: int,
                          count: int = 500) -> list[list[int]]:
    """`training_needles` in `tokenizer`'s chat template (a fact in a user turn among others,
    the question in the last, the answer after it), at least `length` tokens each: what a chat
    model answers, where a plain-text needle may ask what it never learned to answer."""
    from ..evaluation.chat_needles import ChatNeedles
    from ..evaluation.needles import NEEDLE_SEED, filler_sentences

    try:
        make = ChatNeedles(tokenizer, prose=filler_sentences(list(texts), limit=20_000))
    except ValueError as e:
        raise KvtransError(f"--needle-form chat: {e}") from None
    rows = [prompt + answer for prompt, answer in
            (make(NEEDLE_SEED + i, 2 * length) for i in range(count))]
    rows = [row for row in rows if len(row) >= length]
    if not rows:
        raise KvtransError(f"--needle-form chat: no chat needle reaches {length} tokens")
    return rows


# -- stage 1 ----------------------------------------------------------------------------------
def plan_and_cost(src: LoadedModel, tgt: LoadedModel, config: FitConfig,
                  machine: Machine | None = None):
    """(the recipes `config` plans for the pair, what they cost on `machine`, by default this
    one, measured). The models may be config-only (`models.load_config_only`): nothing is
    computed on weights."""
    from ..layouts import layout_of
    from .cost import plan_cost

    try:
        recipes = config.plan(layout_of(src.model), layout_of(tgt.model))
    except ValueError as e:
        raise KvtransError(str(e))
    identity = embedding_dims(tgt.model) \
        if config.token_identity != "off" else 0
    machine = machine or this_machine()
    return recipes, plan_cost(src, tgt, recipes, config.point, identity, machine.matmul_gflops,
                              machine.bandwidth_gbs, memory_bytes=machine.memory_bytes,
                              expansion_width=config.random_features)


def refuse_unless_it_fits(src: LoadedModel, tgt: LoadedModel, config: FitConfig, cost,
                          machine: Machine | None = None) -> None:
    """A fit whose projected peak passes the machine's memory (by default this one's) is
    refused before any work, naming the smaller feature design that would fit."""
    from .cost import ALTERNATIVES, fits, gib

    if fits(cost):
        return
    hint = "no smaller feature design fits either"
    if not fits(replace(cost, fit_peak_bytes=cost.weights_bytes)):
        hint = "the two models' weights alone do not fit: fit on a machine with more memory"
    for change in ALTERNATIVES if hint.startswith("no") else ():
        _, other = plan_and_cost(src, tgt, replace(config, **change), machine)
        if fits(other):
            hint = ("it would fit with " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                    for k, v in change.items())
                    + f" (projected {gib(other.fit_peak_bytes)})")
            break
    raise KvtransError(f"this plan's fit would need about {gib(cost.fit_peak_bytes)} "
                       f"(moments {gib(cost.moments_bytes)}, weights "
                       f"{gib(cost.weights_bytes)}) of "
                       f"{machine.name if machine else 'this machine'}'s "
                       f"{gib(cost.machine_bytes)}; {hint}")


def across_tokenizers(src: LoadedModel, tgt: LoadedModel, config: FitConfig) -> FitConfig:
    """The fit of a pair that tokenizes differently (`translators.cross_tokenizer`): its
    recurrent states replayed; what has no meaning across tokenizers refused, saying why."""
    from ..layouts import layout_of
    from ..translators.cross_tokenizer import RECIPES

    state_recipe = config.recipes.get("recurrent_state", "replay")
    refused = [f"{what} ({why})" for what, asked, why in (
        ("--token-identity codebook", config.token_identity == "codebook",
         "the target reads its own ids, so token identity is the target's"),
        ("--capture 3 or --point ...=3", 3 in (int(config.point), *config.points.values()),
         "keys there are rotated at the source's own positions, which pooling would mix"),
        (f"--recipe recurrent_state={state_recipe}", state_recipe in ("copy", "bilinear"),
         "a state read over other tokens: it is replayed over the target's"))
        if asked]
    if refused:
        raise KvtransError(f"{src.name} and {tgt.name} tokenize differently: "
                           f"{'; '.join(refused)}")
    kinds = {o.kind.value for layer in layout_of(tgt.model).layers for o in layer.objects}
    replayed = {kind: recipe for kind, recipe in RECIPES.items() if kind in kinds}
    return replace(config, recipes={**replayed, **config.recipes})


def fit_translator(source: str | Path | LoadedModel, target: str | Path | LoadedModel,
                   data: Sequence[str | Path], config: FitConfig = FitConfig(), *,
                   validation: str | Path | None = None, out: str | Path | None = None,
                   gate_windows: int = WINDOWS, progress: Progress | None = None,
                   workdir: str | Path | None = None, resume: bool = False) -> Translator:
    """Stage 1 as `kvtrans fit` runs it: `config.windows` windows of `config.length` tokens of
    the `data` text files (with `config.needle_share`, about that share of them synthetic
    needles), fitted in closed form, layers assigned as `config.assign` says. With `validation`
    (a held-out text file) the fidelity gate is calibrated on it over `gate_windows` windows per
    kind and band; with `out` the translator is saved there (replacing what is there: a
    command refuses first). With `workdir` the running sums are checkpointed there (Ctrl-C
    stops after the batch in flight, raising KeyboardInterrupt) and `resume` continues from
    them; the checkpoint goes once the translator is saved. Under `mlx.launch` the batches are
    dealt among the processes, each checkpointing its own sums, the gate's windows are dealt
    among them too, and the first process saves (`processes`). Models that tokenize
    differently each read their own tokens of every window's text (`across_tokenizers`), and
    the manifest's `alignment` records how the groups were pooled.
    Bad input raises KvtransError before any heavy work it can precede."""
    assign = config.assign
    if assign not in ASSIGNMENTS:
        raise KvtransError(f"--assign must be {' or '.join(ASSIGNMENTS)}, not {assign!r}")
    src, tgt = loaded(source), loaded(target)
    across = not same_tokenizer(src, tgt)
    if across:
        config = across_tokenizers(src, tgt, config)
    recipes, cost = plan_and_cost(src, tgt, config)
    refuse_unless_it_fits(src, tgt, config, cost)  # before the text is even read
    codebook = None
    if config.token_identity == "codebook":
        from ..translators.token_identity import codebook_of

        try:
            codebook = codebook_of(src)
        except ValueError as e:
            raise KvtransError(str(e))
    batches = fitting_batches(src, tgt, data, config, across, progress)
    if assign == "best":  # a quarter of the windows choose each target layer's source layer
        from ..translators.recipes import assign_best_single

        recipes, _ = assign_best_single(src.model, tgt.model,
                                        batches[: max(1, len(batches) // 4)], recipes,
                                        config.point)

    # the target's attention sink, which its switches (and the gate calibrated below) read
    sink = attention_sink(tgt.model, [getattr(b, "target", b) for b in batches[:2]])
    fitted = _fit_progress(progress, len(batches))
    group = launched_group()
    rank, size = (0, 1) if group is None else (group.rank(), group.size())
    checkpoint = None if workdir is None else FitCheckpoint(
        workdir, resume, context=json.dumps([model_identity(lm) for lm in (src, tgt)],
                                            sort_keys=True), rank=rank, size=size)
    translator = fit(src.model, tgt.model, batches, recipes, config, codebook=codebook,
                     progress=fitted if rank == 0 and progress else None,
                     checkpoint=checkpoint, group=group)
    translator.info["fit"].update(processes=size, assign=assign)
    translator.info["sink"] = sink
    if rank:
        translator.info["fit"]["rank"] = rank  # not saved: the first process saves
    if validation is not None:  # every process calibrates its share
        held_out = tgt.tokenizer.encode(Path(validation).read_text(errors="replace"))
        translator.info["gate"] = gate_of(translator, src, tgt, held_out, gate_windows,
                                          progress if rank == 0 else None, group)
    failure = None
    if rank == 0 and out is not None:
        try:
            artifact.save(translator, out, src, tgt)
        except BaseException as e:  # the others wait for it below: tell them, then raise
            failure = e
    if group is not None:  # every process keeps its sums until the translator is saved
        saved = summed(np.array([failure is None]), group)[0]
        if failure is None and saved < size:
            raise KvtransError("the first process failed to save the translator; "
                               "every process's sums are kept in --workdir")
    if failure is not None:
        raise failure
    if checkpoint is not None:
        checkpoint.clear()
    return translator


def fitting_batches(src: LoadedModel, tgt: LoadedModel, data: Sequence[str | Path],
                    config: FitConfig, across: bool, progress: Progress | None = None) -> list:
    """The fit's windows of the `data` text files: `config.windows` of `config.length` tokens
    (or the same tokens spread over the lengths of `config.mix`), about `config.needle_share`
    of them synthetic needles; `across` tokenizers, each model's own tokens of each window's
    text (`AlignedText`)."""
    needle_share = config.needle_share
    ids = [] if across else read_ids(src.tokenizer, data, progress)
    texts = [plain_text(f) for f in data] if needle_share or across else []

    def needles_of(length: int, windows: int) -> list[list[int]] | None:
        return training_needles(src.tokenizer.encode, texts, length,
                                count=max(1, round(windows * needle_share))) if texts else None
    try:
        if across:  # each model reads its own tokens of each window's text
            from ..translators.cross_tokenizer import aligned_windows

            batches = []
            lengths = config.mix or [config.length]  # the same tokens, spread over each
            for length in lengths:
                windows = max(1, config.windows * config.length // len(lengths) // length)
                needles = training_needles(tgt.tokenizer.encode, texts, length, max(
                    1, round(windows * needle_share)), as_text=True) if needle_share else None
                batches += aligned_windows(src.tokenizer, tgt.tokenizer, "\n".join(texts),
                                           windows, length, config.pooling, needles,
                                           needle_share)
        elif config.mix:  # the lengths served: the same tokens, spread over every length
            tokens = config.windows * config.length
            batches = mixed_windows(
                ids, config.mix, tokens, FIT_BATCH * min(config.mix),
                lambda n: needles_of(n, tokens // len(config.mix) // n), needle_share)
        else:
            batches = list(token_windows(ids, config.length, config.windows, batch=FIT_BATCH,
                                         needles=needles_of(config.length, config.windows),
                                         needle_share=needle_share))
    except ValueError as e:
        raise KvtransError(str(e))
    return batches


def _fit_progress(progress: Progress | None, total: int):
    """The fit's progress callback: batches done, tokens read, the rate since this run's first
    batch (a resumed fit starts past 0) and peak memory."""
    first: list = []  # (time, tokens) at this run's first batch

    def fitted(done: int, tokens: int) -> None:
        import mlx.core as mx

        if not first:
            first.append((time.perf_counter(), tokens))
        seconds, since = time.perf_counter() - first[0][0], tokens - first[0][1]
        rate = f", {since / seconds:,.0f} tokens/s" if since else ""
        progress("fitting", done, total, f"{tokens:,} tokens{rate}, peak "
                 f"{mx.get_peak_memory() / 2**30:.1f} GiB")
    return fitted


def gate_of(translator: Translator, src: LoadedModel, tgt: LoadedModel, held_out: list[int],
            windows: int = WINDOWS, progress: Progress | None = None, group=None) -> dict:
    """The fidelity gate's calibration on held-out token ids, its windows followed (dealt
    among `group`'s processes, when given), under the relay measured on them first
    (`relay.choose`, recorded in `translator.info["relay"]`)."""
    def step(done: int, total: int) -> None:
        if progress:
            progress("calibrating", done, total, "held-out switches")

    translator.info["relay"] = choose_relay(
        translator, src.model, tgt.model, held_out,
        progress=progress and (lambda done, total: progress("choosing a relay", done, total,
                                                            "held-out windows")))
    return calibrate(translator, src, tgt, held_out, CalibrationConfig(windows=windows),
                     progress=step, group=group)


# -- stage 2 ----------------------------------------------------------------------------------
@dataclass
class Distillation:
    """What `distill_translator` did: `translator` is the distilled one (saved to `out` when
    given), None when the run stopped early (resumable from `workdir`) or on a process other
    than the first."""

    translator: Translator | None
    summary: dict  # the run: steps, held-out KL before and after, curve, minutes, peak memory
    workdir: Path  # its checkpoints
    out: Path | None
    resumed_at: int | None  # the checkpoint's step it continued from
    main_process: bool = True

    @property
    def finished(self) -> bool:
        return self.summary["steps"] >= self.summary["config"]["steps"]


def distill_paths(translator: str | Path) -> tuple[Path, Path]:
    """(the distilled translator's default directory, NAME-distilled beside it; the default
    checkpoint directory, runs/distill/NAME)."""
    path = Path(translator)
    return path.with_name(path.name + "-distilled"), Path("runs") / "distill" / path.resolve().name


def check_workdir(workdir: Path, resume: bool) -> None:
    """Refuse a checkpoint directory distillation may not write into: one holding a checkpoint
    unless resuming it, or one holding other files (a translator, say)."""
    if (workdir / "state.json").exists() and not resume:
        raise KvtransError(f"{workdir} holds a checkpoint: pass --resume to continue it, or "
                           "another --workdir")
    others = sorted(p.name for p in workdir.iterdir() if p.name not in CHECKPOINT_FILES) \
        if workdir.is_dir() else []
    if others:
        raise KvtransError(f"--workdir {workdir} holds other files ({', '.join(others[:3])}): "
                           "give a new or empty directory for the checkpoints")


def load_pair(translator: str | Path) -> tuple[Translator, LoadedModel, LoadedModel]:
    """A saved translator and the models its manifest names, checked against it."""
    manifest = artifact.read_manifest(translator)
    src, tgt = load(manifest["source"]["name"]), load(manifest["target"]["name"])
    return artifact.load(translator, src, tgt), src, tgt


def with_earlier_runs(summary: dict, earlier: dict | None) -> dict:
    """A distillation's record; one of a translator distilled before keeps, under "earlier",
    each earlier run's record (its curve left out), first run first: what it was built by."""
    if not earlier:
        return summary
    runs = list(earlier.get("earlier", []))
    runs.append({k: v for k, v in earlier.items() if k not in ("curve", "earlier")})
    return {**summary, "earlier": runs}


def distill_translator(translator: str | Path, data: Sequence[str | Path], validation: str | Path,
                       config: DistillConfig = DistillConfig(), *, out: str | Path | None = None,
                       workdir: str | Path | None = None, resume: bool = False,
                       gate_windows: int = WINDOWS,
                       progress: Progress | None = None,
                       note: Callable[[str], None] | None = None) -> Distillation:
    """Stage 2 as `kvtrans distill` runs it: the saved `translator` (a directory or shipped
    name) distilled on the `data` text files against the held-out `validation` file, with
    checkpoints in `workdir` (default `distill_paths`; one there is continued only with
    `resume`). Under `mlx.launch` the batch is shared among the processes. When the run
    finishes, the gate is calibrated anew on `validation` (its windows dealt among the
    processes) and the first process saves the translator to `out`
    (replacing what is there: a command refuses first). `note(text)` hears what a user
    should know on the way (a translator distilled again, a resumed run)."""
    import mlx.core as mx

    workdir = Path(workdir) if workdir is not None else distill_paths(translator)[1]
    check_workdir(workdir, resume)
    trained, src, tgt = load_pair(translator)
    if trained.info.get("stage") == 2 and note:
        note(f"{translator} is already distilled; distilling it further")
    texts = [plain_text(f) for f in data]
    # the windows are the target's tokens; across tokenizers the source reads its own
    tokenizers = None if same_tokenizer(src, tgt) else (src.tokenizer, tgt.tokenizer)
    train_ids = read_ids(tgt.tokenizer, data, progress)
    validation_ids = tgt.tokenizer.encode(Path(validation).read_text(errors="replace"))
    span = config.max_prefix + config.continuation
    needles = None if not config.needle_share else (
        chat_training_needles(tgt.tokenizer, texts, span) if config.needle_form == "chat"
        else training_needles(tgt.tokenizer.encode, texts, span))
    group = mx.distributed.init()
    run = Distiller(trained, src.model, tgt.model, train_ids, validation_ids, config, workdir,
                    group if group.size() > 1 else None, needles, tokenizers)
    main_process = run.rank == 0
    report = progress if main_process else None  # one process draws the bars
    resumed_at = run.state["step"] if resume and run.resume() else None
    if resumed_at is not None and note:
        note(f"resuming at step {resumed_at} of {config.steps}")

    def on_step(record: dict) -> None:
        if report:
            held_out = record.get("validation_kl")
            report("distilling", record["step"], config.steps, f"KL {record['kl']:.4f}"
                   + (f"  held-out {held_out:.4f}" if held_out is not None else ""))

    summary = run.run(on_step=on_step, max_minutes=config.max_minutes)
    result = Distillation(None, summary, workdir, Path(out) if out is not None else None,
                          resumed_at, main_process)
    if not result.finished:
        return result
    summary["data_sha256"] = hashlib.sha256(
        "".join(f"{len(t)}:{t}" for t in texts).encode()).hexdigest()
    distilled = run.distilled()  # the same on every process
    distilled.info["stage"] = 2
    distilled.info["distill"] = with_earlier_runs(summary, trained.info.get("distill"))
    distilled.info["gate"] = gate_of(distilled, src, tgt, validation_ids, gate_windows, report,
                                     run.group)
    if not main_process:
        return result
    if out is not None:
        artifact.save(distilled, out, src, tgt)
    result.translator = distilled
    return result
