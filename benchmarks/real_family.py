"""The real family's native figures: every member of `kvtrans zoo real` measured as a model.

Per member: architecture, parameters, cache objects and bytes per token; the healing spent
(from the family's record); perplexity on the corpus's test split and on a held-out text of
another domain (Python's reference documentation, `chat_needles.other_domain_prose`), each
against the parent's; chat needle recall (`chat_needles.ChatNeedles`: one fact per prompt length,
with 95% Wilson intervals, and three facts with one asked for at two lengths); and for the
hybrids what the recurrent states carry (`evaluation.ablate`: KL over 32 continuation tokens
and chat needle recall with every recurrent state, or every conv history, zeroed).

Per translator of `kvtrans zoo real-translators` (FAMILY/translators/SOURCE__TARGET), through a
`Session` at its default setting, and with the target's first k layers recomputed (`--recompute`):
the history's worth recovered, first token, greedy match of 32 and chat needle recall native /
switched per length, the share of switches applied and the switch's speed-up over re-reading.
Beside them, each target's own cache quantized as mlx-lm's `--kv-bits 8` and `4` quantize it
from the first token (`--quantized-kv-start 0`), scored on the same windows
(`frontier.quantized_reference`): the fidelity users already accept for memory.

The issue's bars are checked beside the figures: perplexity within 1.3x of the parent's on both
texts, chat recall within 0.1 of the parent's at every length, zeroed states costing KL or
recall measurably. Each member's figures are kept in FAMILY/bench.json as they are measured, with
the build they measured, so a stopped run resumes and a rebuilt member is measured again; the
results go to benchmarks/results/real-family.{json,md}. A member this run does not measure keeps
the figures the results file holds where it is not on disk or is built as they record (so a
family rebuilt in part is measured in part), and so does a direction between such members
whose translator is not on disk or is the one measured: its weights and its gate's calibration,
which decides which switches apply.

    python benchmarks/real_family.py [--family runs/real-family] [--lengths 128,256,512,1024,2048]
                                     [--multi-lengths 256,1024] [--needles 12] [--windows 16]
                                     [--ablate-lengths 256,1024] [--members a,b]
                                     [--directions A__B,...] [--direction-lengths 256,...]
                                     [--prompts 8] [--recompute 0,2] [--kv-bits 8,4]
                                     [--kv-lengths 256,512,1024] [--kv-prompts 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS

import numpy as np
from mlx.utils import tree_flatten

from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.evaluation.ablate import AblateConfig, ablate
from mlx_kvtrans.evaluation.chat_needles import ChatNeedles, other_domain_prose
from mlx_kvtrans.evaluation.intervals import wilson
from mlx_kvtrans.evaluation.needles import NeedleConfig, needle_report
from mlx_kvtrans.evaluation.perplexity import perplexity
from mlx_kvtrans.layouts import layout_of
from mlx_kvtrans.models import held_out_split
from mlx_kvtrans.files import sha256_file
from mlx_kvtrans.zoo.real import MEMBERS, PARENT, RECORD
from mlx_kvtrans.zoo.real_translators import DIRECTIONS

OUT = Path(__file__).resolve().parent / "results"
PPL_BAR, RECALL_BAR = 1.3, 0.1
STATE_KINDS = ("recurrent_state", "conv_history")


def parameters(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def measure(path: Path, args) -> dict:
    lm = kv.load(str(path))
    layout = layout_of(lm.model)
    encode = lm.tokenizer.encode
    test = np.asarray(encode(held_out_split("test").read_text()), dtype=np.int32)
    other = np.asarray(encode(" ".join(other_domain_prose())), dtype=np.int32)
    row = {"model_type": lm.config["model_type"], "parameters": parameters(lm.model),
           "cache_objects": sorted(k.value for k in layout.kinds()),
           "bytes_per_token": layout.bytes_per_token, "fixed_bytes": layout.fixed_bytes,
           "perplexity": {"test": perplexity(lm.model, test, 256, args.windows),
                          "other_domain": perplexity(lm.model, other, 256, args.windows)},
           "recall": {}}
    for facts, lengths in ((1, args.lengths), (3, args.multi_lengths)):
        make = ChatNeedles(lm.tokenizer, facts=facts)
        row["recall"][str(facts)] = {
            str(n): needle_report(lm.model, encode, n, NeedleConfig(args.needles),
                                  make=make)["recall"]
            for n in lengths}
    kinds = [k for k in STATE_KINDS if k in row["cache_objects"]]
    if kinds:
        labels = {"native"} | {f"zero every {k}" for k in kinds}
        rows = ablate(lm.model, encode, other.tolist(),
                      AblateConfig(args.ablate_lengths, windows=4, needles=args.needles,
                                   only=labels), make=ChatNeedles(lm.tokenizer))
        row["states_zeroed"] = {r["label"]: {n: {"kl": v["kl"], "recall": v["recall"]}
                                             for n, v in r["lengths"].items()} for r in rows}
    return row


def measure_direction(family: Path, name: str, args) -> list[dict]:
    """A translator of FAMILY/translators through a `Session` at its default setting, and with
    each of `args.recompute` first layers recomputed: per setting and length, the frontier's
    figures on the other-domain text and chat needles."""
    from mlx_kvtrans.evaluation.frontier import GATE_TOKENS, FrontierConfig, measure_translator
    from mlx_kvtrans.session.dial import default_reread
    from mlx_kvtrans.translators import artifact

    source, target = (kv.load(str(family / m)) for m in name.split("__"))
    path = family / "translators" / name
    translator = artifact.load(path, source, target)
    other = target.tokenizer.encode(" ".join(other_domain_prose()))
    reread = max(GATE_TOKENS, default_reread(translator)[0])  # a Session's default setting
    frontier = measure_translator(path, source, target, translator, other, FrontierConfig(
        lengths=args.direction_lengths, rereads=[reread], prompts=args.prompts,
        needles=args.needles, recomputes=args.recompute, make=ChatNeedles(target.tokenizer)))
    keys = ("history_recovered", "agreement", "agreement_last16", "greedy_match",
            "first_token", "kl", "recall_native", "recall_translated", "applied", "speedup")
    return [{"stage": translator.info.get("stage", 1), "sink": translator.info.get("sink"),
             "relay": (translator.info.get("relay") or {}).get("chosen"),
             "reread": reread, "recompute": k,
             "lengths": {str(r.length): {key: r.to_json()[key] for key in keys}
                         for r in frontier.rows if r.setting.recompute == k}}
            for k in args.recompute]


def measure_kv_bits(path: Path, args) -> dict:
    """The member's own cache at mlx-lm's KV quantization, no translation, on the windows a
    direction into it reads: per bits and length, what `quantized_reference` gives."""
    from mlx_kvtrans.evaluation.frontier import quantized_reference

    lm = kv.load(str(path))
    other = lm.tokenizer.encode(" ".join(other_domain_prose()))
    out = {}
    for bits in args.kv_bits:
        try:
            out[str(bits)] = {str(n): figures for n, figures in quantized_reference(
                lm.model, other, args.kv_lengths, bits, args.kv_prompts).items()}
        except (ValueError, NotImplementedError) as e:  # mlx-lm cannot quantize this cache
            out[str(bits)] = {"error": str(e).splitlines()[0]}
    return out


def kv_scope(args) -> dict:
    """What a target's own-cache reference was measured over: kept with it, to match."""
    return {"lengths": args.kv_lengths, "prompts": args.kv_prompts}


def update_kv_bits(cache: dict, cache_file: Path, args, built: dict) -> None:
    """Measure into `cache` (kept in `cache_file` as it goes) the own-cache reference of each
    target of a built direction asked for, where its build has not been measured."""
    targets = {n.split("__")[1] for n in args.directions.split(",")
               if (args.family / "translators" / n / "weights.safetensors").is_file()}
    asked = {str(b) for b in args.kv_bits}
    scope = kv_scope(args)
    for name in sorted(targets) if asked else ():
        entry = cache.setdefault("kv_bits", {}).get(name, {})
        if (entry.get("built") == built.get(name) and set(entry.get("bits", {})) == asked
                and entry.get("scope") == scope):
            continue
        print(f"{name}, own cache at {'/'.join(sorted(asked))} bits ...", flush=True)
        cache["kv_bits"][name] = {"bits": measure_kv_bits(args.family / name, args),
                                  "built": built.get(name), "scope": scope}
        cache_file.write_text(json.dumps(cache, indent=2) + "\n")


def speedup_as_used(figures: dict) -> float:
    """A length's switch speed-up over re-reading as a user gets it: the applied share at the
    warm switch's speed-up, the rest at a re-read's (what a switch the gate re-reads costs,
    within its attempt)."""
    applied = 1.0 if figures["applied"] is None else figures["applied"]
    return 1.0 / (applied / figures["speedup"] + 1.0 - applied)


def with_as_used(row: dict) -> dict:
    """A direction's setting row with each length's `speedup_as_used`."""
    return {**row, "lengths": {n: {**f, "speedup_as_used": speedup_as_used(f)}
                               for n, f in row["lengths"].items()}}


def direction_bars(row: dict) -> dict:
    """#58's bars for one direction: recovered >= 0.9 to 1,024 tokens, recall within 0.05 of
    native where native >= 0.5, first token >= 0.95, greedy match >= 24 of 32, applied >= 0.9,
    the switch >= x5 over re-reading at 2,048 tokens as used (fallbacks re-read)."""
    lengths = row["lengths"]
    at = lambda n: lengths.get(str(n))  # noqa: E731
    return {
        "recovered": all(at(n) is None or (at(n)["history_recovered"] or 0) >= 0.9
                         for n in (256, 512, 1024)),
        "recall": all(r["recall_native"] < 0.5 or
                      r["recall_translated"] >= r["recall_native"] - 0.05
                      for r in lengths.values()),
        "first_token": all(r["first_token"] >= 0.95 for r in lengths.values()),
        "greedy_match": all(r["greedy_match"] >= 24 for r in lengths.values()),
        "applied": all((r["applied"] or 0) >= 0.9 for r in lengths.values()),
        "speedup": at(2048) is None or speedup_as_used(at(2048)) >= 5}


def bars(rows: dict) -> dict:
    parent = rows[PARENT]
    out = {}
    for name, row in rows.items():
        if name == PARENT:
            continue
        ratios = {k: row["perplexity"][k] / parent["perplexity"][k] for k in row["perplexity"]}
        gaps = {f: max(parent["recall"][f][n] - row["recall"][f][n] for n in row["recall"][f])
                for f in row["recall"]}
        check = {"perplexity_ratio": ratios, "recall_gap": gaps,
                 "perplexity_met": all(r <= PPL_BAR for r in ratios.values()),
                 "recall_met": all(g <= RECALL_BAR for g in gaps.values())}
        if "states_zeroed" in row:
            native = row["states_zeroed"]["native"]
            costs = {label: {n: {"kl": v["kl"] - native[n]["kl"],
                                 "recall": native[n]["recall"] - v["recall"]}
                             for n, v in cases.items()}
                     for label, cases in row["states_zeroed"].items() if label != "native"}
            check["states_cost"] = costs
            check["states_alive"] = all(c["kl"] > 0.01 or c["recall"] > RECALL_BAR
                                        for c in costs["zero every recurrent_state"].values())
        out[name] = check
    return out


def write_markdown(results: dict, path: Path) -> None:
    rows, lengths, checks = results["members"], results["lengths"], results["bars"]
    family = results["family_record"]["members"]
    lines = ["# The real family",
             "",
             f"Every member of `kvtrans zoo real` ({results['family_record']['source']}), "
             f"measured as a model. Perplexity on 256-token windows ({results['windows']} a "
             "text) of the corpus's test split and of Python's reference documentation (a "
             "domain the corpus lacks); chat needle recall on "
             f"{results['needles']} held-out needles per length in each model's chat template "
             "(one fact, or three with one asked for; 95% Wilson interval of the one-fact "
             "recall). Regenerate with `python benchmarks/real_family.py`.",
             "", f"BLAS: {results['blas']}. {results['minutes']} min.", "",
             "| member | model_type | parameters | cache objects | bytes / token | healing "
             "(tokens) | ppl test | ppl other domain |",
             "|---|---|---|---|---|---|---|---|"]
    parent = rows[PARENT]["perplexity"]
    for name, row in rows.items():
        healing = family.get(name, {}).get("healing", {})
        tokens = f"{healing['tokens']:,}" if healing else "-"
        ppl = row["perplexity"]
        lines.append(
            f"| {name} | {row['model_type']} | {row['parameters'] / 1e6:.1f}M | "
            f"{', '.join(row['cache_objects'])} | {row['bytes_per_token']:,} | {tokens} | "
            f"{ppl['test']:.1f} ({ppl['test'] / parent['test']:.2f}x) | "
            f"{ppl['other_domain']:.1f} ({ppl['other_domain'] / parent['other_domain']:.2f}x) |")
    lines += ["", "Chat needle recall, one fact [95% interval] / three facts (at "
              f"{', '.join(f'{n:,}' for n in results['multi_lengths'])} tokens):", "",
              "| member | " + " | ".join(f"{n:,}" for n in lengths) + " |",
              "|---|" + "---|" * len(lengths)]
    for name, row in rows.items():
        cells = []
        for n in lengths:
            one, three = row["recall"]["1"][str(n)], row["recall"]["3"].get(str(n))
            low, high = wilson(one, results["needles"])
            cells.append(f"{one:.2f} [{low:.2f}, {high:.2f}]" +
                         (f" / {three:.2f}" if three is not None else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    hybrids = [n for n, r in rows.items() if "states_zeroed" in r]
    if hybrids:
        lines += ["", "What the hybrids' states carry: KL (nats/token, 32 continuation tokens "
                  "of the other-domain text) and chat needle recall, native and with every "
                  "state of a kind zeroed:", "",
                  "| member | case | " + " | ".join(f"KL @{n} | recall @{n}"
                                                  for n in results["ablate_lengths"]) + " |",
                  "|---|---|" + "---|---|" * len(results["ablate_lengths"])]
        for name in hybrids:
            for label, cases in rows[name]["states_zeroed"].items():
                lines.append(f"| {name} | {label} | " + " | ".join(
                    f"{cases[str(n)]['kl']:.3f} | {cases[str(n)]['recall']:.2f}"
                    for n in results["ablate_lengths"]) + " |")
    if results.get("unmeasured"):
        lines += ["", "Built but not measured since: " + ", ".join(results["unmeasured"]) + "."]
    lines += ["", f"Bars: perplexity within {PPL_BAR}x of the parent's on both texts; chat "
              f"recall within {RECALL_BAR} of the parent's at every length; zeroing a hybrid's "
              "states costs KL (> 0.01) or recall.", "",
              "| member | ppl ratio test / other | worst recall gap 1 / 3 facts | ppl | recall | "
              "states alive |", "|---|---|---|---|---|---|"]
    mark = lambda ok: "met" if ok else "missed"  # noqa: E731
    for name, c in checks.items():
        r, g = c["perplexity_ratio"], c["recall_gap"]
        lines.append(f"| {name} | {r['test']:.2f} / {r['other_domain']:.2f} | "
                     f"{g['1']:+.2f} / {g['3']:+.2f} | {mark(c['perplexity_met'])} | "
                     f"{mark(c['recall_met'])} | "
                     f"{mark(c['states_alive']) if 'states_alive' in c else '-'} |")
    write_directions(results, lines)
    write_kv_bits(results, lines)
    path.write_text("\n".join(lines) + "\n")


def write_directions(results: dict, lines: list[str]) -> None:
    """Each direction's figures per setting and length, and the bars it misses."""
    directions = results.get("directions", {})
    if not directions:
        return
    shown = results["direction_lengths"]
    lines += ["", "## Translators between the members", "",
              "`kvtrans zoo real-translators` fits and distils each direction; measured "
              "through a `Session` at the default setting (the gate's 8 tokens re-read, "
              "the target's measured sink) on the other-domain text "
              f"({results['prompts']} windows a length) and {results['needles']} chat "
              "needles a length. Recovered: the history's worth kept over what the last 16 "
              "tokens give; match: greedy tokens of 32 equal to native's; recall native / "
              "switched; relay: the target's layers that read the span again from the "
              "source's hidden state entering the layer named (`relay`); k: the target's "
              "first layers that read the span themselves.", "",
              "| direction | stage | sink tokens | relay | k | " + " | ".join(
                  f"recovered / first / match / recall @{n:,}" for n in shown) +
              " | applied | speed-up @2,048 (a fallback re-reads) | bars missed |",
              "|---|---|---|---|---|" + "---|" * len(shown) + "---|---|---|"]
    for name, row in ((n, r) for n, rows in directions.items() for r in rows["settings"]):
        cells = []
        for n in shown:
            r = row["lengths"].get(str(n))
            cells.append("-" if r is None else
                         f"{r['history_recovered']:.2f} / {r['first_token']:.2f} / "
                         f"{r['greedy_match']:.1f} / {r['recall_native']:.2f} / "
                         f"{r['recall_translated']:.2f}")
        applied = min((r["applied"] or 0) for r in row["lengths"].values())
        long = row["lengths"].get("2048")
        speedup = f"{speedup_as_used(long):.1f}x" if long else "-"
        missed = [k for k, ok in direction_bars(row).items() if not ok]
        sink = (row["sink"] or {}).get("tokens", 0)
        chosen = row.get("relay")
        relay = "-" if not chosen else f"{chosen[0]}-{chosen[1]} from {chosen[2]}"
        lines.append(f"| {name} | {row['stage']} | {sink} | {relay} | {row['recompute']} | " +
                     " | ".join(cells) +
                     f" | {applied:.2f} | {speedup} | {', '.join(missed) or 'none'} |")


def write_kv_bits(results: dict, lines: list[str]) -> None:
    """The targets' own caches at mlx-lm's KV quantization, beside the directions' table."""
    references, shown = results.get("kv_bits", {}), results.get("kv_lengths", [])
    if not references:
        return
    lines += ["", "Beside them, each target's own cache quantized as mlx-lm's `--kv-bits B "
              "--quantized-kv-start 0` quantizes it (groups of 64, no translation), scored on "
              f"the first {results['kv_prompts']} of the same windows a length: the "
              "fidelity users already trade for memory.", "",
              "| target | own cache | " + " | ".join(
                  f"recovered / first / match / KL @{n:,}" for n in shown) + " |",
              "|---|---|" + "---|" * len(shown)]
    for name, per_bits in references.items():
        for bits, figures in per_bits.items():
            if "error" in figures:
                error = figures["error"].replace("|", "\\|")
                lines.append(f"| {name} | {bits}-bit | {error} |")
                continue
            cells = ["{history_recovered:.2f} / {first_token:.2f} / {greedy_match:.1f} / "
                     "{kl:.4f}".format(**figures[str(n)]) for n in shown]
            lines.append(f"| {name} | {bits}-bit | " + " | ".join(cells) + " |")


def translator_digest(directory: Path) -> str | None:
    """What a direction's figures are of: its translator's weights, its gate's calibration
    (which decides what applies) and its relay; None when it is not on disk."""
    weights, manifest = directory / "weights.safetensors", directory / "manifest.json"
    if not (weights.is_file() and manifest.is_file()):
        return None
    found = json.loads(manifest.read_text())
    relay = (found.get("relay") or {}).get("chosen")
    chosen = [found.get("gate"), relay] if relay else found.get("gate")
    return hashlib.sha256((sha256_file(weights) + json.dumps(chosen, sort_keys=True)).encode()
                          ).hexdigest()


def measured(family: Path, name: str, entry: dict) -> bool:
    """Whether a direction's figures `entry` are those of its translator on disk (if any)."""
    digest = translator_digest(family / "translators" / name)
    return digest is None or entry.get("translator") == digest


def with_earlier_figures(results: dict, results_file: Path, family: Path) -> dict:
    """`results` beside the figures `results_file` holds, measured with the same settings, of
    the members this run did not measure that are not on disk or are built as those figures
    record, and of the directions between such members whose translators are not on disk or
    are the ones measured; their build records come along."""
    previous = json.loads(results_file.read_text()) if results_file.is_file() else {}
    if not previous:
        return results
    same_members = all(previous.get(k) == results[k] for k in
                       ("lengths", "multi_lengths", "ablate_lengths", "needles", "windows"))
    same_directions = all(previous.get(k) == results[k] for k in
                          ("direction_lengths", "prompts", "needles"))
    now = results["family_record"]["members"]
    then = previous["family_record"]["members"]
    same = {n for n in MEMBERS if now.get(n) is None or now.get(n) == then.get(n)}
    members = {n: previous["members"][n] for n in MEMBERS if same_members and n in same
               and n in previous["members"] and n not in results["members"]}
    directions = {n: previous["directions"][n] for n in DIRECTIONS if same_directions
                  and n in previous["directions"] and n not in results["directions"]
                  and set(n.split("__")) <= same and measured(family, n, previous["directions"][n])}
    same_kv = same_directions and all(previous.get(k) == results[k]
                                      for k in ("kv_lengths", "kv_prompts"))
    kv_bits = {n: previous.get("kv_bits", {})[n] for n in MEMBERS if same_kv
               and n in same and n in previous.get("kv_bits", {})
               and n not in results["kv_bits"]}
    record = {**results["family_record"],
              "members": {**{n: then[n] for n in members if n not in now}, **now}}
    members, directions = {**results["members"], **members}, {**results["directions"], **directions}
    return {**results, "family_record": record,
            "members": {n: members[n] for n in MEMBERS if n in members},
            "directions": {n: directions[n] for n in DIRECTIONS if n in directions},
            "kv_bits": {**results["kv_bits"], **kv_bits}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", type=Path, default=Path("runs/real-family"))
    parser.add_argument("--lengths", default="128,256,512,1024,2048")
    parser.add_argument("--multi-lengths", default="256,1024", help="three-fact needles")
    parser.add_argument("--ablate-lengths", default="256,1024")
    parser.add_argument("--needles", type=int, default=12)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--members", default=",".join(MEMBERS),
                        help="measure these members (comma-separated); the others' figures kept")
    parser.add_argument("--direction-lengths", default="256,512,1024,2048")
    parser.add_argument("--prompts", type=int, default=8, help="text windows per length")
    parser.add_argument("--recompute", default="0,2",
                        help="k: the target's first layers recomputed, per measured setting")
    parser.add_argument("--directions", default=",".join(DIRECTIONS),
                        help="measure these translators of FAMILY/translators where built")
    parser.add_argument("--kv-bits", default="8,4",
                        help="each target's own cache at these mlx-lm KV bits ('': none)")
    # mlx-lm's quantized attention decodes slowly here (25 s a 1,024-token window)
    parser.add_argument("--kv-lengths", default="256,512,1024")
    parser.add_argument("--kv-prompts", type=int, default=2,
                        help="the first of the directions' text windows a length")
    args = parser.parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.ablate_lengths = [int(n) for n in args.ablate_lengths.split(",")]
    args.multi_lengths = [int(n) for n in args.multi_lengths.split(",")]
    args.direction_lengths = [int(n) for n in args.direction_lengths.split(",")]
    args.recompute = [int(k) for k in args.recompute.split(",")]
    args.kv_bits = [int(b) for b in args.kv_bits.split(",") if b]
    args.kv_lengths = [int(n) for n in args.kv_lengths.split(",")]
    return args


def main() -> None:
    args = parse_args()
    record_file = args.family / RECORD
    if not record_file.is_file():
        raise SystemExit(f"no family in {args.family}: build it with `kvtrans zoo real "
                         f"{args.family}`")
    started = time.perf_counter()
    cache_file = args.family / "bench.json"
    per_direction = ("direction_lengths", "prompts", "recompute", "needles")
    settings = {k: v for k, v in vars(args).items()
                if k not in ("family", "members", "directions", *per_direction[:3],
                             "kv_bits", "kv_lengths", "kv_prompts")}
    direction_settings = {k: getattr(args, k) for k in per_direction}
    cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    if cache.get("settings") != settings:
        cache = {"settings": settings, "members": {}}
    if cache.get("direction_settings") != direction_settings:
        cache.update(direction_settings=direction_settings, directions={}, kv_bits={})
    built = json.loads(record_file.read_text())["members"]
    for name in args.members.split(","):
        if not (args.family / name / "config.json").is_file():
            continue
        if cache["members"].get(name, {}).get("built") == built.get(name):
            continue  # measured since it was last built
        print(f"{name} ...", flush=True)
        cache["members"][name] = {**measure(args.family / name, args), "built": built.get(name)}
        cache_file.write_text(json.dumps(cache, indent=2) + "\n")
    for name in args.directions.split(","):
        digest = translator_digest(args.family / "translators" / name)
        if digest is None or cache["directions"].get(name, {}).get("translator") == digest:
            continue  # not built, or measured since it was last fitted and calibrated
        print(f"{name} ...", flush=True)
        cache["directions"][name] = {"settings": measure_direction(args.family, name, args),
                                     "translator": digest}
        cache_file.write_text(json.dumps(cache, indent=2) + "\n")
    update_kv_bits(cache, cache_file, args, built)
    # figures of a member rebuilt since they were measured are not its own: left out, named
    rows = {n: cache["members"][n] for n in MEMBERS
            if cache["members"].get(n, {}).get("built", False) == built.get(n)}
    results = {"family_record": json.loads(record_file.read_text()), "lengths": args.lengths,
               "multi_lengths": args.multi_lengths,
               "ablate_lengths": args.ablate_lengths, "needles": args.needles,
               "windows": args.windows, "blas": str(blas_report()), "members": rows,
               "direction_lengths": args.direction_lengths, "prompts": args.prompts,
               "directions": {n: {"settings": [{**with_as_used(row), "bars": direction_bars(row)}
                                               for row in cache["directions"][n]["settings"]],
                                  "translator": cache["directions"][n]["translator"]}
                              for n in DIRECTIONS if n in cache["directions"]
                              and measured(args.family, n, cache["directions"][n])},
               "kv_lengths": args.kv_lengths, "kv_prompts": args.kv_prompts,
               "kv_bits": {n: entry["bits"] for n, entry in cache.get("kv_bits", {}).items()
                           if entry["built"] == built.get(n)
                           and entry.get("scope") == kv_scope(args)}}
    results = with_earlier_figures(results, OUT / "real-family.json", args.family)
    results.update(bars=bars(results["members"]) if PARENT in results["members"] else {},
                   unmeasured=[n for n in MEMBERS if n in built and n not in results["members"]],
                   minutes=round((time.perf_counter() - started) / 60, 1))
    OUT.mkdir(exist_ok=True)
    (OUT / "real-family.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, OUT / "real-family.md")
    print((OUT / "real-family.md").read_text())


if __name__ == "__main__":
    main()
