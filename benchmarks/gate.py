"""The fidelity gate: how often it fires on faulty translations (catch rate) and on good ones
(false alarms), per shipped pair.

Every window is a `Session` switch (`calibrate.window_switch`): the source reads a prefix (kind
"read") or reads it and writes a reply (kind "generated"), then hands over. Beside each verdict,
what the fault really cost: the damage, the target's NLL on the tail from the translated cache
minus its NLL reading the whole window itself (nats/token).

- held-out: the zoo corpus's test split, prefixes of 32-512 tokens (as calibrated), and of
  768-1024 (past them): false alarms, every shipped translator;
- noise: every weight plus Gaussian noise of `scale` times its own standard deviation;
- wrong pair: a translator fitted for another pair of the same shapes, forced past the
  fingerprint check;
- random tokens, digits: text far from the fitting data;
- cut short: the first half of the translated span zeroed (the target has lost it).

Faults run on the translator a session uses per direction (distilled where one ships). Writes
benchmarks/results/gate.{json,md}.

    python benchmarks/gate.py [--windows 8]
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

from mlx_kvtrans import calibrate, gate
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
        front = RecurrentInputs(*(mx.zeros_like(x) for x in value.slice(0, cut).arrays()))
        return RecurrentInputs.concatenate([front, value.slice(cut, length)])
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
    conversation itself (from the gap and both models' own NLL on the same tokens)."""
    status = session.switches[-1]
    if status.gate_gap is None:
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


def run_case(translator, src, tgt, token_ids, windows: int, prefix, seed: int) -> dict:
    """`windows` of each kind; per kind: windows, fired, mean gap, mean damage."""
    rng = random.Random(seed)
    out = {}
    for kind in gate.KINDS:
        rows = []
        for _ in range(windows):
            length = rng.randint(*prefix)
            begin = rng.randrange(0, len(token_ids) - length - gate.GATE_TOKENS - 2)
            window = token_ids[begin:begin + length + gate.GATE_TOKENS + 2]
            session = calibrate.window_switch(translator, src, tgt, window, length, kind)
            status = session.switches[-1]
            rows.append({"gate": status.gate, "gap": status.gate_gap,
                         "threshold": status.gate_threshold, "status": status.status,
                         "gate_ms": status.gate_seconds * 1000,
                         "damage": damage(session, src, tgt)})
        judged = [r for r in rows if r["gate"] in ("passed", "fired")]
        gaps = [r["gap"] for r in rows if r["gap"] is not None]
        harm = [r["damage"] for r in rows if r["damage"] is not None]
        out[kind] = {"windows": len(rows), "judged": len(judged),
                     "fired": sum(r["gate"] == "fired" for r in rows),
                     "gap_mean": round(statistics.mean(gaps), 3) if gaps else None,
                     "damage_mean": round(statistics.mean(harm), 3) if harm else None,
                     "gate_ms_median": round(statistics.median(r["gate_ms"] for r in rows), 2),
                     "verdicts": sorted({r["gate"] for r in rows})}
    return out


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
    args = parser.parse_args()
    started = time.perf_counter()
    loaded: dict = {}

    def model(name):
        if name not in loaded:
            loaded[name] = kv.load(name)
        return loaded[name]

    test = (weights_dir() / "corpus" / "test.txt").read_text()
    result = {"windows_per_kind": args.windows, "gate_tokens": gate.GATE_TOKENS,
              "prefix_lengths": list(PREFIX), "noise": list(NOISE), "translators": {}}
    names = artifact.shipped_names()
    for name in names:
        manifest = artifact.read_manifest(name)
        src, tgt = model(manifest["source"]["name"]), model(manifest["target"]["name"])
        translator = artifact.load(name, src, tgt)
        ids = src.tokenizer.encode(test)
        record = {"source": src.name, "target": tgt.name,
                  "threshold": [b["threshold"] for b in translator.info["gate"]["bands"]],
                  "held-out": run_case(translator, src, tgt, ids, args.windows, PREFIX, 1)}
        print(name, "held-out", record["held-out"], flush=True)
        if artifact.shipped(src.name, tgt.name).name == name:  # what a session uses
            record["held-out, long prefix"] = run_case(translator, src, tgt, ids, args.windows,
                                                       LONG, 2)
            for scale in NOISE:
                record[f"noise {scale}"] = run_case(noised(translator, scale), src, tgt, ids,
                                                    args.windows, PREFIX, 3)
            for kind in ("random tokens", "digits"):
                record[kind] = run_case(translator, src, tgt, far_text(src.tokenizer, kind, 4),
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
        result["translators"][name] = record
    result["seconds"] = round(time.perf_counter() - started, 1)
    OUT.mkdir(exist_ok=True)
    (OUT / "gate.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "gate.md").write_text(markdown(result))
    print(f"wrote {OUT / 'gate.json'} and {OUT / 'gate.md'} ({result['seconds']:.0f} s)")


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
        "(nats/token; what the fault really cost). Gate ms: the tail the target reads itself and "
        "the comparison, the part of a switch the gate adds.",
        "",
        "## False alarms on held-out text (test split)",
        "",
        "| translator | thresholds read / generated, per band of prefixes "
        f"({', '.join(f'{lo}-{hi}' for lo, hi in calibrate.BANDS)}) | "
        f"prefixes {PREFIX[0]}-{PREFIX[1]} | "
        f"prefixes {LONG[0]}-{LONG[1]} | gate ms (median) |",
        "|---|---|---|---|---|",
    ]
    for name, r in result["translators"].items():
        t = ", ".join(f"{b['read']:+.2f} / {b['generated']:+.2f}" for b in r["threshold"])
        long = _cell(r["held-out, long prefix"]) if "held-out, long prefix" in r else ""
        ms = statistics.median(r["held-out"][k]["gate_ms_median"] for k in gate.KINDS)
        lines.append(f"| {name} | {t} | "
                     f"{_cell(r['held-out'])} | {long} | {ms:.1f} |")
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
    total = {k: [0, 0] for k in ("held-out", "faults", "far")}
    for r in result["translators"].values():
        for key, case in cases(r).items():
            bucket = ("held-out" if key.startswith("held-out") else
                      "far" if key in ("random tokens", "digits") else "faults")
            for kind in gate.KINDS:
                total[bucket][0] += case[kind]["fired"]
                total[bucket][1] += case[kind]["windows"]
    lines += ["", f"In all: false alarms {total['held-out'][0]}/{total['held-out'][1]}; "
                  f"faulty translations (noise, cut short, wrong pair) caught "
                  f"{total['faults'][0]}/{total['faults'][1]}; far text (random tokens, digits) "
                  f"sent to a re-read {total['far'][0]}/{total['far'][1]} "
                  f"({result['seconds']:.0f} s).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
