"""The fidelity gate: how often it fires on faulty translations (catch rate) and on good ones
(false alarms), per shipped pair.

Every window is a `Session` switch (`calibrate.window_switch`): the source reads a prefix (kind
"read") or reads it and writes a reply (kind "generated"), then switches. Beside each verdict,
what the fault really cost: the damage, the target's NLL on the tail from the translated cache
minus its NLL reading the whole window itself (nats/token).

- held-out: the zoo corpus's test split, prefixes of 32-512 tokens (as calibrated), and of
  768-1024 (past them): false alarms, every shipped translator;
- held-out needles (`--needles`): a fact among filler turns of another domain's prose, then
  its question, in the target's chat template, switched once the source has read the question:
  false alarms on the tails users send (across tokenizers too: no damage is computed there,
  the two models reading different tokens of the tail);
- noise: every weight plus Gaussian noise of `scale` times its own standard deviation;
- wrong pair: a translator fitted for another pair of the same shapes, forced past the
  fingerprint check;
- random tokens, digits: text far from the fitting data;
- cut short: the first half of the translated span zeroed (the target has lost it).

`--behaviour` measures (and adds to the files) whether a gate can tell a user that the answer
will differ: per direction, switches at its default R on prose windows of 1x and 2x the fitting
length, each with the gate's reading (the tail's NLL gap and the share of the tail's tokens both
models predict alike) beside what the switched target then does (teacher-forced agreement with
the native greedy continuation, `evaluation/frontier.py`). Rules that fire on "agreement < 0.8"
are calibrated on the validation split and their catch and false-alarm rates read on the test
split.

Faults run on the translator a session uses per direction (distilled where one ships). Writes
benchmarks/results/gate.{json,md}.

    python benchmarks/gate.py [--windows 8]
    python benchmarks/gate.py --behaviour [--behaviour-windows 24]
    python benchmarks/gate.py --tabulate
    python benchmarks/gate.py --translators DIR,NAME --results DIR   # these, every case, there

`--translators` measures the named translators (directories or shipped names: a calibration
under trial beside the shipped one) with every case, and writes where `--results` says, keeping
the rows there of other shipped translators measured with the same settings.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS
import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_kvtrans.evaluation.chat_needles import ChatNeedles
from mlx_kvtrans.evaluation.needles import HELD_OUT_SEED, held_out_filler, needle_prompt_tokens
from mlx_kvtrans.training import calibrate
from mlx_kvtrans.translators import gate
from mlx_kvtrans.layouts.linear_attention import RecurrentInputs
from mlx_kvtrans.models import weights_dir, zoo_aliases
from mlx_kvtrans.translators import artifact

OUT = Path(__file__).resolve().parent / "results"
NOISE = (0.1, 0.3, 1.0, 3.0, 10.0)
PREFIX = (calibrate.BANDS[0][0], calibrate.BANDS[-1][1])  # the calibrated prefixes
LONG = (768, 1024)  # past them


class CutShort:
    """A translator whose output lacks the first half of the span: those tokens' per-token
    objects are zeros (fixed-size states it builds are kept)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prepare(self):
        self.inner.prepare()
        return self

    def translate(self, source, *args, **kwargs):
        objects, points = self.inner.translate(source, *args, **kwargs)
        cut = source.length // 2
        return [{name: _zero_front(value, cut, source.length) for name, value in layer.items()}
                for layer in objects], points


def _zero_front(value, cut: int, length: int):
    if isinstance(value, RecurrentInputs):
        if value.length != length:
            return value
        front = type(value)(*(mx.zeros_like(x) for x in value.slice(0, cut).arrays()))
        return type(value).concatenate([front, value.slice(cut, length)])
    if value.ndim == 3 and value.shape[1] == length:
        return mx.concatenate([mx.zeros_like(value[:, :cut]), value[:, cut:]], axis=1)
    return value  # a fixed-size object, or conv rows of the last tokens only


def noised(translator, scale: float, seed: int = 0):
    params = {}
    for i, (name, w) in enumerate(sorted(translator.params.items())):
        spread = float(mx.std(w.astype(mx.float32))) if w.size > 1 else 1.0
        noise = mx.random.normal(w.shape, key=mx.random.key(seed * 100_003 + i)) * scale * spread
        params[name] = (w.astype(mx.float32) + noise).astype(w.dtype)
    return replace(translator, params=params)


def shapes(lm) -> dict:
    return {k: v.shape for k, v in tree_flatten(lm.model.parameters())}


def damage(session, src, tgt) -> float | None:
    """The target's NLL on the gated tail from the translated cache minus its NLL reading the
    conversation itself (from the gap and both models' own NLL on the same tokens); None across
    tokenizers, where the two read different tokens of the tail."""
    status = session.switches[-1]
    if status.gate_gap is None or session.conversation.across("source", "target"):
        return None
    n = session.lines["source"].seen
    start = n - status.gate_tokens  # the next token is known: every row of the tail scores
    ids = mx.array(session.tokens[:n + 1])
    targets = ids[start + 1:n + 1]

    def nll(model):
        logits = model(ids[None, :n])[0, start:n].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return float(-mx.take_along_axis(logp, targets[:, None], axis=-1).mean())

    return status.gate_gap + nll(src.model) - nll(tgt.model)


def switch_row(session, src, tgt) -> dict:
    status = session.switches[-1]
    return {"gate": status.gate, "gap": status.gate_gap, "threshold": status.gate_threshold,
            "status": status.status, "gate_ms": status.gate_seconds * 1000,
            "damage": damage(session, src, tgt), "copy_gap": status.copy_gap,
            "by_copy": status.gate == "fired" and copy_over(status)}


def copy_over(status) -> bool:
    """Whether this switch's copy gap crossed its threshold (a translator refused as a rule by
    its calibrated copy loss reads no probe at a switch, and is not counted)."""
    return (status.copy_gap is not None and status.copy_threshold is not None
            and status.copy_gap > status.copy_threshold)


def summary(rows: list[dict]) -> dict:
    """windows, judged, fired, mean gap, mean damage and the gate's median ms of `rows`."""
    judged = [r for r in rows if r["gate"] in ("passed", "fired")]
    gaps = [r["gap"] for r in rows if r["gap"] is not None]
    harm = [r["damage"] for r in rows if r["damage"] is not None]
    return {"windows": len(rows), "judged": len(judged),
            "fired": sum(r["gate"] == "fired" for r in rows),
            "by_copy": sum(bool(r.get("by_copy")) for r in rows),
            "gap_mean": round(statistics.mean(gaps), 3) if gaps else None,
            "damage_mean": round(statistics.mean(harm), 3) if harm else None,
            "gate_ms_median": (round(statistics.median(r["gate_ms"] for r in rows), 2)
                               if rows else None),
            "verdicts": sorted({r["gate"] for r in rows})}


def run_case(translator, src, tgt, token_ids, windows: int, prefix, seed: int) -> dict:
    """`windows` of each kind over the target's `token_ids`; per kind: windows, fired, mean
    gap, mean damage."""
    rng = random.Random(seed)
    out = {}
    for kind in gate.KINDS:
        rows = []
        for _ in range(windows):
            length = rng.randint(*prefix)
            begin = rng.randrange(0, len(token_ids) - length - gate.GATE_TOKENS - 2)
            window = token_ids[begin:begin + length + gate.GATE_TOKENS + 2]
            session = calibrate.window_switch(translator, src, tgt, window, length, kind)
            rows.append(switch_row(session, src, tgt))
        out[kind] = summary(rows)
    return out


def run_needles(translator, src, tgt, count: int, prefix, seed: int) -> dict:
    """`count` held-out needles (a fact among filler, then its question; in the target's
    chat template where it has one), each switched once the source has read the question, so
    the gate reads a question's tail: the "read" kind, and none "generated"."""
    rng = random.Random(seed)
    if getattr(tgt.tokenizer, "chat_template", None):
        make = ChatNeedles(tgt.tokenizer)
    else:
        filler = held_out_filler()
        make = lambda s, n: needle_prompt_tokens(tgt.tokenizer.encode, s, n, filler)  # noqa: E731
    rows = []
    for i in range(count):
        prompt, answer = make(HELD_OUT_SEED + seed * 1000 + i, rng.randint(*prefix))
        session = calibrate.window_switch(translator, src, tgt, prompt + answer, len(prompt),
                                          "read")
        rows.append(switch_row(session, src, tgt))
    return {"read": summary(rows), "generated": summary([])}


BAD = 0.8  # a switch whose continuation agrees with native less than this went wrong


def behaviour_windows(translator, src, tgt, split: str, windows: int, seed: int) -> list[dict]:
    """Per window: the gate's reading of a switch at the default R (the translation always
    stands: the gate reads, the rule is applied afterwards) and the agreement that followed."""
    from mlx_kvtrans.evaluation import frontier as fr
    from mlx_kvtrans.session import dial

    reread, _ = dial.default_reread(translator)
    silent = replace(translator, info={k: v for k, v in translator.info.items() if k != "gate"})
    switch = fr.SessionSwitch(silent.prepare(), src, tgt)
    ids = tgt.tokenizer.encode((weights_dir() / "corpus" / f"{split}.txt").read_text())
    length = fr.fitting_length(translator.info)
    rows = []
    for n in (length, 2 * length):
        for start in fr.window_starts(ids, n, windows, seed):
            ref = fr.reference(switch, ids[start:start + n])
            setting = fr.Setting(reread)
            agree = fr.score(switch, setting, ref)["agree"]
            status = switch.statuses.pop(setting)[-1]
            if status.gate_gap is None:  # the gate could not read this switch
                continue
            threshold, _ = gate.threshold(translator.info.get("gate"), gate.GATE_TOKENS, 0.0,
                                          n - 1)
            rows.append({"length": n, "reread": reread, "agreement": agree,
                         "gap": status.gate_gap, "tail_agreement": status.gate_agreement,
                         "threshold": threshold})
    return rows


def best_cut(rows: list[dict], key: str, fires_above: bool) -> float:
    """The cut on `key` that best separates bad switches from good ones on `rows` (largest
    catch rate minus false-alarm rate; the rule fires above it, or below with fires_above
    False)."""
    values = sorted({r[key] for r in rows})
    candidates = [(a + b) / 2 for a, b in zip(values, values[1:])]
    candidates = [values[0] - 1, *candidates, values[-1] + 1]

    def score(cut):
        rates = rule_rates(rows, lambda r: r[key] > cut if fires_above else r[key] < cut)
        return rates["catch"] - rates["false_alarm"], -abs(cut)
    return max(candidates, key=score)


def rule_rates(rows: list[dict], fires) -> dict:
    bad = [r for r in rows if r["agreement"] < BAD]
    good = [r for r in rows if r["agreement"] >= BAD]
    return {"bad": len(bad), "good": len(good),
            "caught": sum(map(fires, bad)), "false_alarms": sum(map(fires, good)),
            "catch": sum(map(fires, bad)) / len(bad) if bad else 0.0,
            "false_alarm": sum(map(fires, good)) / len(good) if good else 0.0}


def behaviour(translator, src, tgt, windows: int) -> dict:
    validation = behaviour_windows(translator, src, tgt, "validation", windows, 1)
    test = behaviour_windows(translator, src, tgt, "test", windows, 0)
    gap_cut = best_cut(validation, "gap", True)
    tail_cut = best_cut(validation, "tail_agreement", False)
    rules = {
        "shipped gate (gap over its threshold)": lambda r: r["gap"] > r["threshold"],
        f"gap over {gap_cut:+.2f}": lambda r: r["gap"] > gap_cut,
        f"tail agreement under {tail_cut:.2f}": lambda r: r["tail_agreement"] < tail_cut,
    }
    return {"reread": test[0]["reread"], "windows": test,
            "rules": {name: rule_rates(test, fires) for name, fires in rules.items()}}


def behaviour_markdown(result: dict) -> list[str]:
    lines = ["## Predicting behaviour", "",
             "Can the gate tell that the switched target's answer will differ? Per direction, "
             f"{result['behaviour_windows']} prose windows at 1x and 2x its translator's "
             "fitting length, switched at the default R; **bad**: teacher-forced agreement "
             f"with the native greedy continuation under {BAD}. A rule's cut is chosen on the "
             "validation split (largest catch minus false-alarm rate), its rates read here on "
             "the test split: caught / bad, false alarms / good (a cut outside the values' "
             "range never fires: validation held no bad switch it could separate). Measured "
             "by `python benchmarks/gate.py --behaviour`.", "",
             "| translator | R | bad | rule | caught | false alarms |",
             "|---|---|---|---|---|---|"]
    totals: dict = {}
    for name, b in result["behaviour"].items():
        for rule, r in b["rules"].items():
            lines.append(f"| {name} | {b['reread']} | {r['bad']}/{r['bad'] + r['good']} | "
                         f"{rule} | {r['caught']}/{r['bad']} | "
                         f"{r['false_alarms']}/{r['good']} |")
            kind = rule.split(" under ")[0].split(" over ")[0].split(" (")[0]
            t = totals.setdefault(kind, [0, 0, 0, 0])
            for i, v in enumerate((r["caught"], r["bad"], r["false_alarms"], r["good"])):
                t[i] += v
    lines += ["", "In all: " + "; ".join(f"{kind}: caught {c}/{b}, false alarms {f}/{g}"
                                        for kind, (c, b, f, g) in totals.items()) + ".", ""]
    return lines


def far_text(tokenizer, kind: str, seed: int) -> list[int]:
    rng = random.Random(seed)
    if kind == "random tokens":
        vocab = len(tokenizer.get_vocab())
        return [rng.randrange(vocab) for _ in range(4000)]
    digits = " ".join("".join(rng.choice("0123456789") for _ in range(rng.randint(2, 8)))
                      for _ in range(3000))
    return tokenizer.encode(digits)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8, help="windows of each kind per case")
    parser.add_argument("--needles", type=int, default=48,
                        help="held-out needles per translator (false alarms on questions)")
    parser.add_argument("--behaviour", action="store_true",
                        help="measure only how the gate predicts behaviour (added to the files)")
    parser.add_argument("--behaviour-windows", type=int, default=24,
                        help="prose windows per length and split for --behaviour")
    parser.add_argument("--tabulate", action="store_true", help="only rebuild gate.md")
    parser.add_argument("--translators", help="a,b: these (directories or shipped names), "
                        "every case (default: every shipped translator)")
    parser.add_argument("--results", type=Path, default=OUT, help="where to write gate.*")
    args = parser.parse_args()
    if args.tabulate:
        (OUT / "gate.md").write_text(markdown(json.loads((OUT / "gate.json").read_text())))
        return
    started = time.perf_counter()
    loaded: dict = {}

    def model(name):
        if name not in loaded:
            loaded[name] = kv.load(name)
        return loaded[name]

    if args.behaviour:
        return main_behaviour(args, model)

    test = (weights_dir() / "corpus" / "test.txt").read_text()
    result = {"windows_per_kind": args.windows, "needles": args.needles,
              "gate_tokens": gate.GATE_TOKENS,
              "prefix_lengths": list(PREFIX), "noise": list(NOISE), "translators": {}}
    names = args.translators.split(",") if args.translators else artifact.shipped_names()
    for name in names:
        manifest = artifact.read_manifest(name)
        src, tgt = model(manifest["source"]["name"]), model(manifest["target"]["name"])
        translator = artifact.load(name, src, tgt)
        ids = tgt.tokenizer.encode(test)  # a switch gives the target its own tokens
        record = {"source": src.name, "target": tgt.name,
                  "threshold": [b["threshold"] for b in translator.info["gate"]["bands"]],
                  "held-out": run_case(translator, src, tgt, ids, args.windows, PREFIX, 1),
                  "held-out needles": run_needles(translator, src, tgt, args.needles, PREFIX,
                                                  8)}
        print(name, "held-out", record["held-out"], flush=True)
        # every case for what a session uses, or for the translators named
        if args.translators or artifact.shipped(src.name, tgt.name).name == name:
            record["held-out, long prefix"] = run_case(translator, src, tgt, ids, args.windows,
                                                       LONG, 2)
            for scale in NOISE:
                record[f"noise {scale}"] = run_case(noised(translator, scale), src, tgt, ids,
                                                    args.windows, PREFIX, 3)
            for kind in ("random tokens", "digits"):
                record[kind] = run_case(translator, src, tgt, far_text(tgt.tokenizer, kind, 4),
                                        args.windows, PREFIX, 5)
            record["cut short"] = run_case(CutShort(translator), src, tgt, ids, args.windows,
                                           PREFIX, 6)
            for other in sorted(zoo_aliases()):
                for other_target in sorted(zoo_aliases()):
                    pair = (other, other_target)
                    if other == other_target or pair == (src.name, tgt.name):
                        continue
                    if shapes(model(other)) != shapes(src) or \
                            shapes(model(other_target)) != shapes(tgt):
                        continue
                    record[f"wrong pair: on {other} -> {other_target}"] = run_case(
                        translator, model(other), model(other_target), ids, args.windows,
                        PREFIX, 7)
            print(name, {k: _rate(v) for k, v in cases(record).items()}, flush=True)
        result["translators"][Path(name).name] = record
    result["seconds"] = round(time.perf_counter() - started, 1)
    out = args.results
    if args.translators:
        result = with_earlier_rows(result, out / "gate.json")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gate.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "gate.md").write_text(markdown(result))
    print(f"wrote {out / 'gate.json'} and {out / 'gate.md'} ({result['seconds']:.0f} s)")


def with_earlier_rows(result: dict, results_file: Path) -> dict:
    """`result` beside the rows `results_file` holds of other shipped translators measured with
    the same settings (its time stays this run's)."""
    previous = json.loads(results_file.read_text()) if results_file.exists() else {}
    settings = ("windows_per_kind", "needles", "gate_tokens", "prefix_lengths", "noise")
    if any(previous.get(k) != result[k] for k in settings):
        return result
    shipped = set(artifact.shipped_names())
    kept = {k: v for k, v in previous["translators"].items()
            if k in shipped and k not in result["translators"]}
    return {**result, "translators": dict(sorted({**kept, **result["translators"]}.items()))}


def main_behaviour(args, model) -> None:
    result = json.loads((OUT / "gate.json").read_text())
    result["behaviour_windows"], result["behaviour"] = args.behaviour_windows, {}
    pairs = {(m["source"]["name"], m["target"]["name"])
             for m in map(artifact.read_manifest, artifact.shipped_names())}
    for pair in sorted(pairs):
        name = artifact.shipped(*pair).name  # what a session uses
        src, tgt = model(pair[0]), model(pair[1])
        translator = artifact.load(name, src, tgt)
        result["behaviour"][name] = behaviour(translator, src, tgt, args.behaviour_windows)
        print(name, result["behaviour"][name]["rules"], flush=True)
    (OUT / "gate.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "gate.md").write_text(markdown(result))
    print(f"wrote {OUT / 'gate.json'} and {OUT / 'gate.md'}")


def cases(record: dict) -> dict:
    """The measured cases of a translator's record (name -> per kind)."""
    return {k: v for k, v in record.items() if isinstance(v, dict)
            and isinstance(v.get("read"), dict)}


def _rate(case: dict, kinds=gate.KINDS) -> str:
    fired = sum(case[k]["fired"] for k in kinds)
    windows = sum(case[k]["windows"] for k in kinds)
    return f"{fired}/{windows}"


def _cell(case: dict) -> str:
    harm = [case[k]["damage_mean"] for k in gate.KINDS if case[k]["damage_mean"] is not None]
    return _rate(case) + (f" ({statistics.mean(harm):+.2f})" if harm else "")


def markdown(result: dict) -> str:
    n = result["windows_per_kind"]
    lines = [
        "# Fidelity gate: catch rate and false alarms",
        "",
        "Written by `python benchmarks/gate.py` (see its docstring). Each cell: switches whose "
        f"gate fired / switches ({n} where the source read the tail, {n} where it wrote it), "
        "every one a `Session` switch on the zoo with the gate's tail of "
        f"{result['gate_tokens']} tokens; in brackets, the mean damage: the target's NLL on "
        "the tail from the translated cache minus its NLL reading the conversation itself "
        "(nats/token; what the fault really cost). Gate ms: the tail the target reads itself, "
        "the comparison and the copy probe (where the calibration judges one switch by it), the "
        "part of a switch the gate adds.",
        "",
        "## False alarms on held-out text (test split)",
        "",
        "| translator | thresholds read / generated, per band of prefixes "
        f"({', '.join(f'{lo}-{hi}' for lo, hi in calibrate.BANDS)}) | "
        f"prefixes {PREFIX[0]}-{PREFIX[1]} | "
        f"prefixes {LONG[0]}-{LONG[1]} | needles, the question read last | gate ms (median) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["translators"].items():
        t = ", ".join(f"{b['read']:+.2f} / {b['generated']:+.2f}" for b in r["threshold"])
        long = _cell(r["held-out, long prefix"]) if "held-out, long prefix" in r else ""
        ms = statistics.median(r["held-out"][k]["gate_ms_median"] for k in gate.KINDS)
        needles = (_rate(r["held-out needles"], ("read",)) if "held-out needles" in r else "")
        lines.append(f"| {name} | {t} | "
                     f"{_cell(r['held-out'])} | {long} | {needles} | {ms:.1f} |")
    faults = [f"noise {s}" for s in result["noise"]] + ["random tokens", "digits", "cut short"]
    lines += ["", "## Catch rate on faulty translations", "",
              "| translator | " + " | ".join(faults) + " | wrong pair |",
              "|---|" + "---|" * (len(faults) + 1)]
    for name, r in result["translators"].items():
        if "cut short" not in r:
            continue
        wrong = [f"{k.split(': on ')[1]}: {_cell(v)}" for k, v in r.items()
                 if k.startswith("wrong pair")]
        lines.append(f"| {name} | " + " | ".join(_cell(r[f]) for f in faults) + " | "
                     + ("; ".join(wrong) or "none of the same shapes") + " |")
    total = {k: [0, 0, 0] for k in ("held-out", "faults", "far")}
    for r in result["translators"].values():
        for key, case in cases(r).items():
            bucket = ("held-out" if key.startswith("held-out") else
                      "far" if key in ("random tokens", "digits") else "faults")
            for kind in gate.KINDS:
                total[bucket][0] += case[kind]["fired"]
                total[bucket][1] += case[kind]["windows"]
                total[bucket][2] += case[kind].get("by_copy", 0)

    def count(bucket):
        fired, windows, by_copy = total[bucket]
        return f"{fired}/{windows} ({by_copy} by the copy probe)"

    lines += ["", f"In all: false alarms {count('held-out')}; faulty translations (noise, cut "
                  f"short, wrong pair) caught {count('faults')}; far text (random tokens, "
                  f"digits) sent to a re-read {count('far')} ({result['seconds']:.0f} s).", ""]
    if "behaviour" in result:
        lines += behaviour_markdown(result)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
