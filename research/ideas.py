"""Ideas for translators that hold at length, each measured on the frontier and kept or dropped
on its figures.

An idea distils (stage 2) a shipped translator further, or fits its pair afresh (stage 1,
`fit`) and distils that: its options against the shipped ones. Each is measured beside the
translator it starts from, through a `Session` at R = 8 (the gate's own tail, the cheapest
setting), at 256 and 512 tokens (where the bars are read), on the validation split with a draw
of needles other than the held-out ones (seed 1): the test split and the held-out needles stay
for reporting (`research/frontier.py`, `benchmarks/bars.py`). An idea is kept where the
history's worth it recovers over its base, paired on the same windows (64 per length by
default, with 32 needles), rises with a 95% interval above 0, and needle recall, over both
lengths together, does not fall. `--served` also measures the ideas named and their starts at
1,024 and 2,048 tokens (rows added to those already measured; the keep rule still reads 256 and
512).

    python research/ideas.py [--ideas NAME,NAME] [--prompts 64] [--needles 32] [--served]
    python research/ideas.py --tabulate
    python research/ideas.py --ship NAME   # a kept idea replaces its direction's translator

`--ship` puts the idea's translator in weights/translators/ (SOURCE__TARGET-distilled, in place
of the direction's shipped one), calibrates its gate as `kvtrans calibrate` does, and records
its frontier beside it as the shipped ones are (`kvtrans eval frontier --record` on the
validation split: 8 windows, no needles, R = 8, 32, 128, at 256-2,048 tokens), which a
session's dial reads.

An idea starts from the translator shipped when it runs, and is compared with that translator
measured beside it (its results key names the weights' digest, `base`). Once a kept idea has
replaced it, the figures in ideas.json stay those measured before; a run anew would start from
the replacement (and an idea whose start no longer ships stops with that reason).

The ideas themselves are listed in `research/idea_list.py`. Translators are written to
runs/ideas/NAME (a run stopped part-way resumes from its
checkpoint there); figures to research/results/ideas.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import mlx_kvtrans  # noqa: F401  first: fast BLAS
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bars.py, common.py

from bars import LENGTHS as BAR_LENGTHS
from frontier import ZOO_LENGTHS, loaded
from idea_list import IDEAS, REREAD, Idea
from mlx_kvtrans.training.calibrate import CalibrationConfig, calibrate_directory
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.evaluation import frontier as fr
from mlx_kvtrans.evaluation.intervals import paired_gain
from mlx_kvtrans.files import sha256_file
from mlx_kvtrans.models import held_out_split, weights_dir
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.training.workflows import distill_translator, fit_translator

OUT = Path(__file__).resolve().parent / "results"
RUNS = Path("runs/ideas")
SEED = 1  # prose windows and needles: not the held-out draw (seed 0)
LENGTHS = BAR_LENGTHS  # where the bars are read, and the keep rule
LEGACY = {"prompts": 16, "needles": 16}  # what every idea was measured on before
SERVED = (1024, 2048)  # `--served`: the longer lengths a long fit or distillation aims at


def measure(name: str, directory: Path | str, models: dict, args,
            lengths: tuple[int, ...] | None = None) -> dict:
    try:
        artifact.resolve(directory)
    except KvtransError:
        raise SystemExit(f"{directory} is not shipped any more (an idea replaced it): its "
                         "figures in ideas.json were measured while it was")
    translator, src, tgt = loaded(directory, models)
    ids = tgt.tokenizer.encode(held_out_split("validation").read_text())
    frontier = fr.measure_translator(artifact.resolve(directory), src, tgt, translator, ids,
                                     fr.FrontierConfig(list(lengths or wanted_lengths(args)),
                                                       [REREAD], args.prompts, args.needles,
                                                       repeats=1, seed=SEED))
    return {"name": name, "source": src.name, "target": tgt.name,
            "weights_mb": weights_mb(artifact.resolve(directory)),
            "settings": settings_of(args), "rows": [row.to_json() for row in frontier.rows]}


def settings_of(args) -> dict:
    return {"prompts": args.prompts, "needles": args.needles}


def wanted_lengths(args) -> tuple[int, ...]:
    return LENGTHS + (SERVED if args.served else ())


def add_lengths(result: dict, directory: Path | str, models: dict, args) -> None:
    """Measure `result`'s translator at the wanted lengths it lacks, adding their rows."""
    missing = tuple(n for n in wanted_lengths(args)
                    if n not in {row["length"] for row in result["rows"]})
    if missing:
        rows = result["rows"] + measure(result["name"], directory, models, args, missing)["rows"]
        result["rows"] = sorted(rows, key=lambda row: row["length"])


def weights_mb(directory: Path) -> float:
    """What the translator's weights take on disk, MB (the budget `weights/` ships under)."""
    return round((directory / "weights.safetensors").stat().st_size / 1e6, 2)


def validation_kl(directory: Path) -> list | None:
    """[before, after] of the distillation that made a translator (its manifest's record)."""
    run = artifact.read_manifest(directory).get("distill") or {}
    return [run["validation_kl_before"], run["validation_kl_after"]] \
        if run.get("validation_kl_before") is not None else None


def measured_sizes(results: dict) -> None:
    """Fill in what results measured before it was recorded (the weights' size, an idea's
    validation KL before and after its distillation) from the translators still on disk (an
    idea's run, or the shipped weights of the digest measured)."""
    for key, r in results.items():
        if r.get("config") and "validation_kl" not in r and (RUNS / key).is_dir():
            r["validation_kl"] = validation_kl(RUNS / key)
        if "weights_mb" in r:
            continue
        if key.startswith("shipped:"):
            start, _, digest = key.removeprefix("shipped:").partition("@")
            try:
                found = artifact.resolve(start)
            except KvtransError:
                continue
            if digest and sha256_file(found / "weights.safetensors")[:12] != digest:
                continue
        else:
            found = next((d for d in (RUNS / key, RUNS / f"{key}-stage1")
                          if (d / "weights.safetensors").is_file()), None)
            if found is None or (r.get("config") and not (RUNS / key).is_dir()):
                continue
        r["weights_mb"] = weights_mb(found)


def run_idea(idea: Idea, models: dict, args) -> dict:
    out, workdir = RUNS / idea.name, RUNS / f"{idea.name}-checkpoints"
    started = time.perf_counter()
    start = idea.start
    if idea.fit is not None:
        start = RUNS / f"{idea.name}-stage1"
        if not (start / "weights.safetensors").is_file():
            manifest = artifact.read_manifest(idea.start)
            fit_translator(manifest["source"]["name"], manifest["target"]["name"],
                           [held_out_split("train")],
                           replace(idea.fit, needle_share=idea.fit_needle_share),
                           validation=held_out_split("validation"), out=start, gate_windows=32)
    stored = idea.stored != "float32"
    made = out.with_name(out.name + "-float32") if stored else out  # before it is stored
    if idea.config is None:  # as fitted
        made = start
    elif not (made / "weights.safetensors").is_file():
        resume = (workdir / "state.json").is_file()
        run = distill_translator(start, [held_out_split("train")],
                                 held_out_split("validation"), idea.config, out=made,
                                 workdir=workdir, resume=resume, gate_windows=32)
        if not run.finished:
            raise SystemExit(f"{idea.name} stopped part-way; run again to resume")
    if not stored:
        out = made
    elif not (out / "weights.safetensors").is_file():
        artifact.store_as(made, out, getattr(mx, idea.stored))
        calibrate_directory(out, config=CalibrationConfig(windows=32))  # the gate judges the stored weights
    minutes = artifact.read_manifest(out).get("distill", {}).get("minutes", 0.0)
    result = measure(idea.name, out, models, args)
    return {**result, "start": idea.start, "what": idea.what,
            "config": asdict(idea.config) if idea.config else None,
            "distill_minutes": minutes,
            "validation_kl": validation_kl(out) if idea.config else None,
            "measure_minutes": round((time.perf_counter() - started) / 60, 2)}


def built(idea: Idea) -> Path:
    """Where the idea's translator is (distilled, or as fitted)."""
    return RUNS / (idea.name if idea.config or idea.stored != "float32"
                   else f"{idea.name}-stage1")


def ship(idea: Idea, models: dict) -> Path:
    made = built(idea)
    if not (made / "weights.safetensors").is_file():
        raise SystemExit(f"{idea.name} is not built: run --ideas {idea.name} first")
    manifest = artifact.read_manifest(made)
    source, target = manifest["source"]["name"], manifest["target"]["name"]
    place = weights_dir() / "translators" / f"{source}__{target}-distilled"
    old = artifact.shipped(source, target)
    staging = place.with_name(place.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(made, staging)
    if old is not None:
        shutil.rmtree(old)  # one translator per direction
    shutil.rmtree(place, ignore_errors=True)
    staging.rename(place)
    calibrate_directory(place)  # on as many windows as a shipped gate (the idea's used fewer)
    translator, src, tgt = loaded(place, models)
    text = held_out_split("validation")
    frontier = fr.measure_translator(place, src, tgt, translator,
                                     tgt.tokenizer.encode(text.read_text()),
                                     fr.FrontierConfig(ZOO_LENGTHS, [8, 32, 128], prompts=8,
                                                       needles=0, repeats=3, seed=0))
    root = Path(__file__).resolve().parents[1]
    frontier.settings["text"] = str(text.relative_to(root) if text.is_relative_to(root) else text)
    fr.save(frontier, place, force=True)
    path = OUT / "ideas.json"
    if path.is_file():  # the table says which idea ships
        saved = json.loads(path.read_text())
        if idea.name in saved["results"]:
            saved["results"][idea.name]["shipped_as"] = place.name
            path.write_text(json.dumps(saved, indent=1))
            write_markdown(saved["results"], OUT)
    print(f"shipped {idea.name} as {place} (in place of {old.name if old else 'none'}); "
          "recorded its frontier")
    return place


def shipped_key(start: str, settings: dict) -> tuple[str, str]:
    """(the results key of the translator `start` as shipped now, measured with `settings`,
    its weights' digest): an idea is measured against the weights it started from, which a
    kept idea may replace, on the same windows and needles."""
    digest = sha256_file(artifact.resolve(start) / "weights.safetensors")[:12]
    key = f"shipped:{start}@{digest}"
    return (key if settings == LEGACY else f"{key}/{settings['prompts']}x"
            f"{settings['needles']}"), digest


def by_length(r: dict) -> dict[int, dict]:
    return {row["length"]: row for row in r["rows"]}


def gain(idea: dict, base: dict) -> tuple[float, float, float] | None:
    """The idea's paired gain in recovered share over its base at the bars' lengths, with its
    95% interval (`intervals.paired_gain`), where both kept their windows' figures."""
    mine, theirs = by_length(idea), by_length(base)
    pairs = [(mine[n].get("window_agreement"), theirs[n].get("window_agreement"),
              theirs[n].get("window_floor")) for n in LENGTHS if n in mine and n in theirs]
    if not pairs or any(p is None for pair in pairs for p in pair):
        return None
    return paired_gain(pairs)


def kept(idea: dict, base: dict) -> bool:
    """Recall over the lengths together does not fall, and the recovered share rises: by a
    paired gain whose 95% interval lies above 0 where the windows' figures were kept, else
    (ideas measured before) at every length."""
    mine, theirs = by_length(idea), by_length(base)
    bars = [n for n in LENGTHS if n in theirs]
    paired = gain(idea, base)
    rises = (paired[1] > 0 if paired is not None else
             all(mine[n]["history_recovered"] > theirs[n]["history_recovered"] for n in bars))
    return rises and (sum(mine[n]["recall_translated"] or 0 for n in bars)
                      >= sum(theirs[n]["recall_translated"] or 0 for n in bars))


def write_markdown(results: dict, out: Path) -> None:
    lines = ["# Ideas for translators that hold at length\n",
             "Each idea distils a shipped translator further (or refits its pair, then distils); "
             "it is measured beside that "
             f"translator through a `Session` at R = {REREAD} (the gate's own tail) at "
             f"{' and '.join(map(str, LENGTHS))} tokens, on the validation split with needles "
             f"of another draw (seed {SEED}), **n** windows and needles per length (the "
             "same windows for an idea and its base). **Recovered**: the history's worth "
             "kept, (agreement - floor) / (1 - floor), teacher-forced on the native greedy "
             "continuation; **match**: greedy tokens of 32 equal to native's; **first**: "
             "first-token agreement; **recall**: needle recall, native / switched; "
             "**applied**: switches the gate let stand; **MB**: the translator's weights "
             "(blank: not recorded when it was measured); **speed-up**: the warm switch at "
             f"R = {REREAD} over re-reading, one timed run of each, side by side. **Gain**: "
             "the recovered share over "
             "the base's, paired on the same windows and averaged over both lengths, with its "
             "95% interval (`intervals.paired_gain`; blank for ideas measured before the "
             "windows' figures were kept). **Kept**: the gain's interval lies above 0 (before: "
             "recovered rises at both lengths) and recall over both lengths together does not "
             "fall (rows at 1,024 and 2,048, where `--served` measured them, inform and do not "
             "decide). Regenerate with `python research/ideas.py`.\n",
             "| direction | translator | what | n | L | recovered | first | match | KL | recall "
             "| applied | speed-up | MB | gain | kept |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        # ideas measured before bases carried digests name theirs by the start alone
        base = results.get(r.get("base") or f"shipped:{r.get('start')}")
        verdict = "" if base is None or key.startswith("shipped:") else (
            "yes" if kept(r, base) else "no")
        if r.get("shipped_as"):
            verdict += f", shipped as `{r['shipped_as']}`"
        what = r.get("what", "as shipped before")
        size = f"{r['weights_mb']:.1f}" if "weights_mb" in r else ""
        paired = None if base is None or key.startswith("shipped:") else gain(r, base)
        paired = "" if paired is None else "{:+.2f} [{:+.2f}, {:+.2f}]".format(*paired)
        n = "{prompts} / {needles}".format(**r.get("settings", LEGACY))
        for row in r["rows"]:
            lines.append(
                f"| {r['source']} -> {r['target']} | {r['name']} | {what} | {n} | "
                f"{row['length']:,} "
                f"| {row['history_recovered']:.2f} | "
                f"{row['first_token']:.2f} | {row['greedy_match']:.1f} | {row['kl']:.4f} | "
                f"{row['recall_native']:.2f} / {row['recall_translated']:.2f} | "
                f"{row['applied']:.2f} | {row['speedup']:.1f}x | {size} | {paired} | {verdict} |")
    out.joinpath("ideas.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ideas", help="comma-separated idea names (default: all)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--needles", type=int, default=32)
    parser.add_argument("--results", type=Path, default=OUT)
    parser.add_argument("--tabulate", action="store_true",
                        help="rebuild ideas.md from ideas.json")
    parser.add_argument("--ship", help="put this idea's translator in weights/translators/")
    parser.add_argument("--served", action="store_true",
                        help="also measure at 1,024 and 2,048 tokens (added to what was)")
    args = parser.parse_args()
    if args.ship:
        by_name = {i.name: i for i in IDEAS}
        if args.ship not in by_name:
            raise SystemExit(f"unknown idea: {args.ship}")
        return ship(by_name[args.ship], {})
    path = args.results / "ideas.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    results = saved.get("results", {})
    for r in results.values():  # measured before each result kept its own settings
        r.setdefault("settings", saved.get("settings") or LEGACY)
    if args.tabulate:
        measured_sizes(results)
        path.write_text(json.dumps({"results": results}, indent=1))
        return write_markdown(results, args.results)
    wanted = set(args.ideas.split(",")) if args.ideas else {i.name for i in IDEAS}
    unknown = wanted - {i.name for i in IDEAS}
    if unknown:
        raise SystemExit(f"unknown ideas: {', '.join(sorted(unknown))}")
    models, settings = {}, settings_of(args)
    for idea in [i for i in IDEAS if i.name in wanted]:
        base, digest = shipped_key(idea.start, settings)
        if base not in results:
            results[base] = {**measure(idea.start, idea.start, models, args), "digest": digest,
                             "what": f"as shipped (weights sha256 {digest}...)"}
        add_lengths(results[base], idea.start, models, args)
        if args.served and idea.name in results:  # the rows it lacks, of what was built
            add_lengths(results[idea.name], built(idea), models, args)
        else:
            if idea.name in results and results[idea.name]["settings"] != settings:
                results.pop(idea.name)  # measured again, on these windows: the end of the table
            results[idea.name] = {**run_idea(idea, models, args), "base": base}
        args.results.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"results": results}, indent=1))
    write_markdown(results, args.results)


if __name__ == "__main__":
    main()
