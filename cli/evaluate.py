"""`kvtrans eval ...` of translators: fidelity, multi-turn accuracy, answer behaviour, ablation and
the frontier (`needles.py`: needle recall and perplexity of a model)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

import mlx_kvtrans
from mlx_kvtrans.errors import KvtransError

from .needles import NEEDLE_FORMAT_HELP, check_needle_format, needle_maker
from .common import (JSON_HELP, SEEDS, SINK_HELP, FitTable, Limit, default_translator,
                     eval_app, in_range, int_list, load_translator_pair, model_configs, out,
                     position_limit, progress_bar, text_file, translator_models, user_errors)

# Positions each window continues over past its prefix (KL, greedy agreement).
FIDELITY_CONTINUATION = 64
ABLATION_CONTINUATION = 32


@eval_app.command("fidelity")
@user_errors
def eval_fidelity(translator_dir: Path = typer.Option(..., "--translator",
                                                     help="a directory or a shipped name"),
                  text: Path = typer.Option(None, help="held-out text (default: zoo test split)"),
                  prefix_lengths: str = typer.Option("64,256", help="comma-separated"),
                  windows: int = typer.Option(8, min=1, help="held-out windows per length"),
                  source: str = typer.Option(None, "--from", help="override the manifest's"),
                  target: str = typer.Option(None, "--to", help="override the manifest's"),
                  sink: int = typer.Option(None, min=0, help=SINK_HELP),
                  as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """KL and greedy agreement of the target continuing from translated caches, with the
    no-cache floor beside them."""
    from mlx_kvtrans.translators.fidelity import FidelityConfig, fidelity

    source, target = translator_models(translator_dir, source, target)
    lengths = int_list("--prefix-lengths", prefix_lengths, 2, position_limit(
        model_configs(source, target), FIDELITY_CONTINUATION, "the continuation"))
    text = text_file("--text", text, "test")
    translator, src, tgt = load_translator_pair(translator_dir, source, target)
    ids = src.tokenizer.encode(text.read_text(errors="replace"))
    try:
        with progress_bar("fidelity") as progress:
            rows = fidelity(translator, src.model, tgt.model, ids,
                            FidelityConfig(lengths, windows=windows,
                                           continuation=FIDELITY_CONTINUATION, sink=sink),
                            progress=progress)
    except ValueError as e:
        raise KvtransError(str(e))
    if as_json:
        print(json.dumps({"translator": str(translator_dir), "rows": rows}, indent=2))
        return
    table = FitTable(f"fidelity · {translator_dir}")
    for col in ("prefix", "KL nats/token", "KL no cache", "greedy agreement", "agreement no cache"):
        table.add_column(col, right=True)
    for r in rows:
        table.add_row(str(r["prefix_length"]), f"{r['kl']:.4f}", f"{r['kl_no_cache']:.4f}",
                      f"{r['greedy_agreement']:.3f}", f"{r['greedy_agreement_no_cache']:.3f}")
    out.print(table)



def _longest_dialogue(tokenizer, dialogues: int, turns: int) -> int:
    """About the positions the longest held-out dialogue fills: its messages, and every reply
    at the longest the evaluation lets it run."""
    import inspect

    from mlx_kvtrans.evaluation import tasks
    from mlx_kvtrans.evaluation.multiturn import HELD_OUT_DIALOGUES, run_dialogue

    reply = inspect.signature(run_dialogue).parameters["max_tokens"].default + 1  # and a newline
    return max(len(tokenizer.apply_chat_template(
        tasks.dialogue(HELD_OUT_DIALOGUES + d, turns=turns).messages, add_generation_prompt=True))
        for d in range(dialogues)) + turns * reply


@eval_app.command("multiturn")
@user_errors
def eval_multiturn(translator_dir: Path = typer.Option(..., "--translator",
                                                      help="A -> B: a directory or a shipped "
                                                      "name"),
                   back: Path = typer.Option(None, help="B -> A (default: shipped, else re-read)"),
                   dialogues: int = typer.Option(20, min=1, help="held-out dialogues"),
                   turns: int = typer.Option(10, min=2, help="turns per dialogue (the models "
                                             "alternate every turn)"),
                   as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """Per-turn answer accuracy of dialogues alternating models, for segment-wise, naive and
    refresh switching and for re-reading."""
    from mlx_kvtrans.evaluation.multiturn import evaluate
    from mlx_kvtrans.translators import artifact

    names = translator_models(translator_dir)
    if back is not None:
        translator_models(back)  # verified now, loaded once the models are
    limit = position_limit(model_configs(*names))
    in_range("--turns", turns, 2, limit)  # a turn holds a token at least
    forward, src, tgt = load_translator_pair(translator_dir, None, None)
    longest = _longest_dialogue(src.tokenizer, dialogues, turns)
    if longest > limit.value:
        raise KvtransError(f"--turns {turns}: the longest dialogue would reach about "
                           f"{longest:,} positions, past {limit.value:,} ({limit.why})")
    translators = {(src.name, tgt.name): forward}
    back_path = back or default_translator(tgt, src)
    if back_path is not None:
        translators[(tgt.name, src.name)] = artifact.load(back_path, tgt, src)
    with progress_bar("dialogues") as progress:
        table = evaluate({src.name: src, tgt.name: tgt}, translators, dialogues, turns,
                         progress=progress)
    if as_json:
        print(json.dumps({"models": [src.name, tgt.name], "dialogues": dialogues,
                          "accuracy": table}, indent=2))
        return
    turn_keys = sorted({k for row in table.values() for k in row if k.isdigit()}, key=int)
    # a row per turn, a column per strategy: ten turns and more still fit 80 columns
    view = FitTable(f"multi-turn accuracy · {src.name} <-> {tgt.name} · {dialogues} dialogues")
    view.add_column("turn")
    for strategy in table:
        view.add_column(strategy, right=True)
    for k in turn_keys:
        view.add_row(str(int(k) + 1), *(f"{row[k]:.2f}" if k in row else "-"
                                        for row in table.values()))
    view.add_row("all", *(f"{row['all']:.2f}" for row in table.values()), style="bold")
    view.add_row("gate fired", *("-" if row["gate_fired"] is None else f"{row['gate_fired']:.2f}"
                                 for row in table.values()))
    out.print(view)


@eval_app.command("ablate")
@user_errors
def eval_ablate(model: str = typer.Option(None, "--model", help="zoo alias, directory or HF id"),
                translator_dir: Path = typer.Option(None, "--translator",
                                                    help="a translator into the model (a "
                                                    "directory or a shipped name): also the "
                                                    "translation swapped in whole, per layer, "
                                                    "per object and from each layer up"),
                lengths: str = typer.Option("256,1024", help="prompt lengths (comma-separated)"),
                windows: int = typer.Option(4, min=1, help="held-out windows per length"),
                needles: int = typer.Option(20, min=1, help="held-out needles per length"),
                text: Path = typer.Option(None, help="held-out text (default: the zoo's test "
                                          "split)"),
                needle_format: str = typer.Option("auto", help=NEEDLE_FORMAT_HELP),
                as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """What each cache object carries: per layer and object, the model continuing from its own
    cache with that object zeroed (and, with --translator, with only it, only its layer,
    everything, or every layer from one up translated): KL against native, greedy agreement,
    the history's worth recovered (the fidelity bars' measure), needle recall and the copy
    loss (the gate's copy probe read from this cache, minus from the model's own), beside the
    no-cache floor."""
    from mlx_kvtrans.evaluation.ablate import AblateConfig, ablate

    if (model is None) == (translator_dir is None):
        raise KvtransError("give --model, or --translator (its target is the model)")
    check_needle_format(needle_format)
    models = translator_models(translator_dir) if translator_dir is not None else (model,)
    sizes = int_list("--lengths", lengths, 16, position_limit(
        model_configs(*models), ABLATION_CONTINUATION, "the continuation"))
    text = text_file("--text", text, "test")
    translator = src = None
    if translator_dir is not None:
        translator, src, lm = load_translator_pair(translator_dir, None, None)
        model, src = lm.name, src.model
    else:
        lm = mlx_kvtrans.load(model)
    ids = lm.tokenizer.encode(text.read_text(errors="replace"))
    try:
        with progress_bar("ablate") as progress:
            rows = ablate(lm.model, lm.tokenizer.encode, ids,
                          AblateConfig(sizes, windows, needles,
                                       continuation=ABLATION_CONTINUATION),
                          translator=translator, source=src, progress=progress,
                          make=needle_maker(needle_format, 1, lm))
    except ValueError as e:
        raise KvtransError(str(e))
    if as_json:
        print(json.dumps({"model": model, "translator": str(translator_dir or ""),
                          "rows": rows}, indent=2))
        return
    # each prompt length heads its cases, so more lengths add rows, not columns
    table = FitTable(f"ablation · {model} · {windows} windows, {needles} needles per length")
    table.add_column("case")
    for col in ("KL", "greedy agreement", "recovered", "needle recall", "copy loss"):
        table.add_column(col, right=True)
    formats = {"kl": ".3f", "agreement": ".2f", "recovered": ".2f", "recall": ".2f",
               "copy": "+.2f"}
    for n in sizes:
        table.add_row(f"{n:,} tokens", style="bold")
        for r in rows:
            figures = r["lengths"][str(n)]
            table.add_row(r["label"], *("-" if figures[k] is None else format(figures[k], f)
                                        for k, f in formats.items()), style="not bold")
    out.print(table)


# The shortest needle or prose prompt: a needle and its question.
BEHAVIOUR_MIN_PROMPT = 16


@eval_app.command("behaviour")
@user_errors
def eval_behaviour(translator_dir: Path = typer.Option(..., "--translator",
                                                      help="a directory or a shipped name"),
                   prompts: int = typer.Option(20, min=1, help="held-out prompts of each kind "
                                               "(dialogue, needle, prose)"),
                   max_tokens: int = typer.Option(32, min=1, help="tokens per answer at most"),
                   length: int = typer.Option(None, help="tokens of each needle and prose "
                                              "prompt (default: the target's training length)"),
                   text: Path = typer.Option(None, help="held-out prose (default: zoo test "
                                             "split)"),
                   seed: int = typer.Option(0, **SEEDS, help="prose windows and bootstrap "
                                            "resamples"),
                   as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """How the target's answers change when it continues from translated caches: first-token
    agreement, answer length, leading spaces, refusal and "I don't know" phrases, numbers copied
    from the prompt, repetition; translated minus native with 95% paired bootstrap intervals,
    flagged where an interval excludes zero."""
    from mlx_kvtrans.evaluation.behaviour import behaviour, held_out_prompts
    from mlx_kvtrans.translators.translator import translate_cache

    configs = model_configs(*translator_models(translator_dir))
    positions = position_limit(configs)
    in_range("--max-tokens", max_tokens, 1, Limit(
        positions.value - BEHAVIOUR_MIN_PROMPT,
        f"{positions.why}, {BEHAVIOUR_MIN_PROMPT} of them for the prompt"))
    limit = position_limit(configs, max_tokens, "the answers")
    if length is not None:
        in_range("--length", length, BEHAVIOUR_MIN_PROMPT, limit)
    text = text_file("--text", text, "test")
    translator, src, tgt = load_translator_pair(translator_dir, None, None)
    if length is None:
        manifest = tgt.path / "manifest.json"
        trained = json.loads(manifest.read_text())["longest_training_prompt"] \
            if manifest.exists() else 256
        length = min(trained, limit.value)
    ids = tgt.tokenizer.encode(text.read_text(errors="replace"))
    try:
        held_out = held_out_prompts(tgt.tokenizer, prompts, length, ids, seed)
    except ValueError as e:
        raise KvtransError(f"--text {text}: {e}")
    longest = max(held_out, key=lambda p: len(p.ids))
    if len(longest.ids) > limit.value:
        raise KvtransError(f"a held-out {longest.kind} prompt has {len(longest.ids):,} tokens, "
                           f"past {limit.value:,} ({limit.why})")
    with progress_bar("behaviour") as progress:
        rows = behaviour(tgt.model, tgt.tokenizer, held_out,
                         lambda prefix: translate_cache(translator, src.model, tgt.model, prefix),
                         max_tokens, seed=seed, progress=progress)
    if as_json:
        print(json.dumps({"translator": str(translator_dir), "source": src.name,
                          "target": tgt.name, "prompts_per_kind": prompts, "length": length,
                          "max_tokens": max_tokens, "seed": seed, "rows": rows}, indent=2))
        return
    table = FitTable(f"behaviour · {src.name} -> {tgt.name} · {prompts} prompts per kind "
                     f"(dialogue, needle, prose) · answers of at most {max_tokens} tokens")
    table.add_column("metric")
    for col in ("prompts", "native", "translated", "difference", "95% interval", "flagged"):
        table.add_column(col, right=True)
    for r in rows:
        if r["difference"] is None:
            table.add_row(r["label"], "0", "-", "-", "-", "-", "")
            continue
        digits = 1 if r["metric"] == "answer_tokens" else 3
        table.add_row(r["label"], str(r["prompts"]), f"{r['native']:.{digits}f}",
                      f"{r['translated']:.{digits}f}", f"{r['difference']:+.{digits}f}",
                      f"[{r['ci_low']:+.{digits}f}, {r['ci_high']:+.{digits}f}]",
                      "[bold red]yes[/]" if r["flagged"] else "")
    out.print(table)


def _frontier_plan(manifest: dict, names, lengths: str | None, rereads: str | None):
    """The prompt lengths and R settings `eval frontier` measures, refused where they cannot be."""
    from mlx_kvtrans.evaluation import frontier as fr

    limit = position_limit(model_configs(*names), fr.GENERATED, "the continuation")
    fit_length = fr.fitting_length(manifest)
    sizes = int_list("--lengths", lengths, fr.FLOOR_TOKENS + 2, limit) if lengths else \
        [n for n in (fit_length * m for m in fr.MULTIPLES) if n <= limit.value]
    if not sizes:
        raise KvtransError(f"{fit_length:,} tokens, the fitting length, is past {limit.value:,} "
                           f"({limit.why}): give --lengths")
    reads = int_list("--rereads", rereads, 0) if rereads else None
    below = [r for r in reads or () if r < fr.GATE_TOKENS]
    if below:
        raise KvtransError(f"--rereads {below[0]}: {fr.GATE_READS}")
    for n in sizes if reads is not None else ():
        if not any(fr.Setting(r).applies(n) for r in reads):
            raise KvtransError(f"--rereads {rereads}: at {n:,} tokens every R re-reads the "
                               f"whole prompt (R must be below {n - 1:,})")
    return sizes, reads


@eval_app.command("frontier")
@user_errors
def eval_frontier(translator_dir: Path = typer.Option(..., "--translator",
                                                     help="a directory or a shipped name"),
                  lengths: str = typer.Option(None, help="comma-separated prompt lengths in "
                                              "tokens (default: 1x, 2x, 4x, 8x the fitting "
                                              "length)"),
                  rereads: str = typer.Option(None, help="comma-separated R: tokens the target "
                                              "reads itself over the translated prefix, at least "
                                              "the gate's 8 (default: 8, 32, 128, ... below each "
                                              "length)"),
                  recompute: str = typer.Option("0", help="comma-separated k: the target's "
                                                "first layers that read the translated prefix "
                                                "themselves, measured with every R"),
                  prompts: int = typer.Option(16, min=1, help="held-out prose windows per "
                                              "length"),
                  needles: int = typer.Option(16, min=0, help="held-out needles per length "
                                              "(0: no recall)"),
                  repeats: int = typer.Option(3, min=1, help="timed runs per setting (the "
                                              "median is kept)"),
                  text: Path = typer.Option(None, help="held-out text (default: zoo test "
                                            "split)"),
                  needle_format: str = typer.Option("auto", help=NEEDLE_FORMAT_HELP),
                  seed: int = typer.Option(0, **SEEDS, help="prose window starts and "
                                           "needles (0: the held-out needles every benchmark "
                                           "reads; record a frontier with another)"),
                  record: bool = typer.Option(False, "--record", help="write frontier.json "
                                              "into the translator's directory, where sessions "
                                              "read it"),
                  out_file: Path = typer.Option(None, "--out", help="write the frontier as "
                                                "JSON to this file"),
                  force: bool = typer.Option(False, "--force", help="replace an existing "
                                             "--out or recorded frontier.json"),
                  as_json: bool = typer.Option(False, "--json", help=JSON_HELP)):
    """The fidelity frontier: per length and setting (R, the tokens the target re-reads itself),
    teacher-forced agreement with native greedy continuations beside the last-16-tokens floor,
    the history's worth recovered, greedy matches, KL, needle recall and the warm switch's
    speed-up over re-reading, on held-out text and needles."""
    from mlx_kvtrans.evaluation import frontier as fr
    from mlx_kvtrans.translators import artifact
    from mlx_kvtrans.backend.processes import launched_group

    from .common import refuse_existing

    check_needle_format(needle_format)
    manifest = artifact.read_manifest(translator_dir)
    names = manifest["source"]["name"], manifest["target"]["name"]
    sizes, reads = _frontier_plan(manifest, names, lengths, rereads)
    layers = sorted(set(int_list("--recompute", recompute, 0, _layer_limit(names[1]))))
    refuse_existing(out_file, force)
    directory = artifact.resolve(translator_dir)
    refuse_existing(directory / fr.FILE if record else None, force, "--record")
    text = text_file("--text", text, "test")
    src, tgt = mlx_kvtrans.load(names[0]), mlx_kvtrans.load(names[1])
    # across tokenizers the source reads its own tokens of each prompt's text
    translator = artifact.load(directory, src, tgt)
    ids = tgt.tokenizer.encode(text.read_text(errors="replace"))
    group = launched_group()  # under mlx.launch: the windows and needles are shared out
    config = fr.FrontierConfig(sizes, reads, prompts, needles, repeats, seed, recomputes=layers,
                               make=needle_maker(needle_format, 1, tgt))
    try:
        with progress_bar("frontier") as progress:  # silent under mlx.launch (no terminal)
            frontier = fr.measure_translator(directory, src, tgt, translator, ids, config,
                                             progress, group=group)
    except ValueError as e:
        raise KvtransError(f"--text {text}: {e}")
    if group is not None and group.rank() != 0:  # the first process reports and writes
        return
    frontier.settings["text"] = str(text)
    frontier.settings["needle_format"] = "chat" if config.make else "text"
    written = [fr.save(frontier, path, force=True)
               for path in (out_file, directory / fr.FILE if record else None) if path]
    if as_json:
        print(json.dumps(frontier.to_json(), indent=2))
        return
    out.print(_frontier_table(frontier, prompts, needles))
    for path in written:
        out.print(f"wrote {path}")


def _layer_limit(model: str):
    """The target's layer count (from its config), the most layers it can recompute."""
    from .common import Limit

    config = model_configs(model)[model]
    layers = (config.get("text_config") or config)["num_hidden_layers"]
    return Limit(layers, f"{model} has {layers} layers")


def _frontier_table(frontier, prompts: int, needles: int) -> FitTable:
    """The frontier in 80 columns: short headers, their legend in the caption."""
    from mlx_kvtrans.evaluation import frontier as fr

    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    table = FitTable(f"fidelity frontier · {frontier.source} -> {frontier.target} · {prompts} "
                     f"windows, {needles} needles per length", caption=(
                         f"agree: teacher-forced agreement with native's {fr.GENERATED} greedy "
                         f"tokens; floor: the target reading the last {fr.FLOOR_TOKENS} tokens "
                         "only; kept: history recovered; ties: of the positions parted from "
                         "native, the share native itself nearly ties; match: greedy tokens equal "
                         "to native's; "
                         "1st: first token; KL: nats/token; recall: native/switched; applied: "
                         "switches the gate let stand; x: speed-up over re-reading; R kK: K "
                         "first layers recomputed"),
                     caption_justify="left")
    for col in ("L", "R", "agree", "floor", "kept", "ties", "match", "1st", "KL", "recall",
                "applied", "x"):
        table.add_column(col, right=True)
    for r in frontier.rows:  # R, and k where layers were recomputed: "8 k2"
        table.add_row(f"{r.length:,}", str(r.setting.reread) + (
                          f" k{r.setting.recompute}" if r.setting.recompute else ""),
                      f"{r.agreement:.3f}",
                      f"{r.agreement_last16:.3f}", cell(r.history_recovered, ".2f"),
                      cell(r.near_ties, ".2f"), f"{r.greedy_match:.1f}", f"{r.first_token:.2f}",
                      f"{r.kl:.4f}",
                      f"{cell(r.recall_native, '.2f')}/{cell(r.recall_translated, '.2f')}",
                      cell(r.applied, ".2f"), f"{r.speedup:.1f}")
    return table
