"""How much of the history a token-wise map can carry: the capacity of stage 1's map family.

Every shipped translator builds each target position's keys and values from that position's
source features alone (per-token maps). This probe asks whether a richer map of the same
inputs would keep more of the history: on attention pairs (GQA keys and values, capture point
(1)), maps fitted by ridge regression on the train split from

- the 2 source layers nearest each target layer's depth, with the target's embedding of the
  token id (the shipped plan's features, without needle windows or attention weighting);
- every source layer and the token id;
- every source layer and the token id, plus H random ReLU features of them (relu(x P), P fixed
  Gaussian): a closed-form nonlinear map, H = 1,024 and 4,096;
- every source layer and the token id, with the previous token's beside them: whether a
  position's map lacks what its neighbour's features hold;
- every source layer and the token id, with their running means over the window so far beside
  them (decayed by 0.95 a token, and plain): whether a position's map lacks the context a
  summary of the earlier features holds;
- every source layer and the token id, plus 512 hidden units learned by Adam on the squared
  error of every target layer's keys and values (each layer's scaled to unit variance), from
  the linear fit: whether a learned nonlinearity reaches what random features do at a fraction
  of the width,

each measured on held-out windows of the validation split: held-out R^2 of the keys and
values, and the history's worth recovered, (agreement - floor) / (1 - floor), with the
target reading the last R = 0, 8 and 32 prompt tokens itself (`evaluation.frontier`'s
measures, teacher-forced on the native greedy continuation). Fits here are stage 1 only. This
probes the map family with plain ridge regression and z-scored ReLU features; the library's
own option (`kvtrans fit --random-features`, `translators/random_features.py`) is measured
through a session by `research/ideas.py`.

    python research/capacity.py [--pairs qwen3-large:qwen3-small,...] [--windows 256]
                                  [--prompts 32] [--only NAME] [--tabulate]

Writes research/results/capacity.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.capture import capture
from mlx_kvtrans.evaluation import frontier as fr
from mlx_kvtrans.translators.install import install
from mlx_kvtrans.layouts import layout_of
from mlx_kvtrans.models import held_out_split, input_embedding
from mlx_kvtrans.training.plan import relative_depth

OUT = Path(__file__).resolve().parent / "results"
LENGTH = 256  # fitting and measuring windows, the shipped translators' fitting length
REREADS = (0, 8, 32)
SEED = 7  # validation windows: not any other benchmark's draw
RIDGE = 1e-3  # relative to the mean diagonal of the features' second moments
# (name, source layers: "nearest" 2 or "every", hidden units, kind: random features, the
# previous token's features beside each position's, running means of the window so far beside
# them, or hidden units learned by Adam)
VARIANTS = [("linear, 2 nearest layers", "nearest", 0, "random"),
            ("linear, every layer", "every", 0, "random"),
            ("linear, every layer and the previous token's", "every", 0, "previous"),
            ("linear, every layer and its running means", "every", 0, "context"),
            ("1,024 random ReLU features, every layer", "every", 1024, "random"),
            ("4,096 random ReLU features, every layer", "every", 4096, "random"),
            ("512 learned GELU units, every layer", "every", 512, "learned")]
LEARNED_STEPS, LEARNED_BATCH, LEARNED_LR = 1500, 4096, 1e-3  # Adam, cosine to a twentieth
PREDICT_ROWS = 8192  # rows per forward of the learned map: the hidden units of every row at once
# would take gigabytes


def per_token(cap, layer: int) -> list[np.ndarray]:
    """A capture's keys and values of `layer` at (1), (T, width) each."""
    objects = cap.layer(layer, 1)
    return [np.array(objects[name][0], dtype=np.float32) for name in ("keys", "values")]


class Pair:
    def __init__(self, source: str, target: str):
        self.src, self.tgt = kv.load(source), kv.load(target)
        self.name = f"{source} -> {target}"
        self.tl = layout_of(self.tgt.model)
        self.n_source = len(layout_of(self.src.model).layers)
        self.n_target = len(self.tl.layers)
        self.embed = input_embedding(self.tgt.model)
        probe = capture(self.tgt.model, mx.array([[0, 1]]), points=(1,))
        self.key_widths = [per_token(probe, j)[0].shape[1] for j in range(self.n_target)]

    def features(self, ids: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
        """(per source layer (T, width), the token ids' target embedding (T, d))."""
        w = mx.array(ids)[None]
        cap = capture(self.src.model, w, points=(1,))
        layers = [np.concatenate(per_token(cap, s), -1) for s in range(self.n_source)]
        return layers, np.array(self.embed(w)[0].astype(mx.float32))

    def targets(self, ids: list[int]) -> list[np.ndarray]:
        cap = capture(self.tgt.model, mx.array(ids)[None], points=(1,))
        return [np.concatenate(per_token(cap, j), -1) for j in range(self.n_target)]

    def sources(self, layer: int, which: str) -> tuple[int, ...]:
        if which == "every":
            return tuple(range(self.n_source))
        return relative_depth(self.n_source, self.n_target, layer, 2)


def previous(x: np.ndarray, window: int) -> np.ndarray:
    """Each row beside the row before it in its `window` of rows (zeros before a window's
    first)."""
    w = x.reshape(-1, window, x.shape[-1])
    before = np.concatenate([np.zeros_like(w[:, :1]), w[:, :-1]], axis=1)
    return np.concatenate([w, before], -1).reshape(len(x), -1)


CONTEXT_DECAYS = (0.95, 1.0)  # running means: a recent one (half-life ~14 tokens) and all


def running_means(x: np.ndarray, window: int) -> np.ndarray:
    """Each row beside the means of its `window`'s rows up to and including it, each earlier
    row weighted by decay^distance (1: the plain mean of the rows so far)."""
    w = x.reshape(-1, window, x.shape[-1]).astype(np.float64)
    parts = [w]
    for decay in CONTEXT_DECAYS:
        total, weight = np.zeros_like(w[:, 0]), 0.0
        means = np.empty_like(w)
        for t in range(window):
            total, weight = decay * total + w[:, t], decay * weight + 1.0
            means[:, t] = total / weight
        parts.append(means)
    return np.concatenate(parts, -1).astype(np.float32).reshape(len(x), -1)


class Map:
    """Per target layer, a ridge fit of keys and values on the variant's features."""

    def __init__(self, pair: Pair, which: str, hidden: int, data, kind: str = "random"):
        self.pair, self.which, self.hidden, self.kind = pair, which, hidden, kind
        layers, identity, targets = data
        self.norms, self.proj, self.weights = {}, {}, {}
        for j in range(pair.n_target):
            x = self._raw(layers, identity, j)
            mean, std = x.mean(0), x.std(0) + 1e-6
            self.norms[j] = (mean, std)
            if hidden:
                rng = np.random.default_rng(j)
                self.proj[j] = (rng.standard_normal((x.shape[1], hidden)) /
                                np.sqrt(x.shape[1])).astype(np.float32)
            f = self._expand(x, j)
            gram = (f.T @ f).astype(np.float64)
            gram += RIDGE * np.trace(gram) / len(gram) * np.eye(len(gram))
            self.weights[j] = np.linalg.solve(gram, (f.T @ targets[j]).astype(np.float64)
                                              ).astype(np.float32)

    def _raw(self, layers, identity, j, window: int = LENGTH):
        x = np.concatenate([layers[s] for s in self.pair.sources(j, self.which)] + [identity],
                           -1)
        if self.kind == "context":
            return running_means(x, window)
        return previous(x, window) if self.kind == "previous" else x

    def _expand(self, x, j):
        mean, std = self.norms[j]
        z = (x - mean) / std
        parts = [z] + ([np.maximum(z @ self.proj[j], 0)] if self.hidden else [])
        return np.concatenate(parts + [np.ones((len(z), 1), np.float32)], -1)

    def predict(self, layers, identity, window: int = LENGTH) -> list[np.ndarray]:
        """Per target layer, the keys and values of rows stacked in windows of `window`."""
        return [self._expand(self._raw(layers, identity, j, window), j) @ self.weights[j]
                for j in range(self.pair.n_target)]

    def cache(self, ids: list[int]) -> list:
        """The target's cache of `ids`, keys and values from the map."""
        out = self.predict(*self.pair.features(ids), window=len(ids))
        objects, points = [], []
        for y, width in zip(out, self.pair.key_widths):
            objects.append({"keys": mx.array(y[None, :, :width]),
                            "values": mx.array(y[None, :, width:])})
            points.append({"keys": 1, "values": 1})
        return install(self.pair.tl, objects, points)


class Learned(Map):
    """Every target layer's keys and values from one hidden layer of the standardized input
    of every source layer and the id: y = x W + gelu(x U + c) D, W from the linear ridge fit,
    U drawn, D zero, then all trained by Adam on the squared error."""

    def __init__(self, pair: Pair, which: str, hidden: int, data, kind: str = "learned"):
        if which != "every":
            raise ValueError("the learned map reads every source layer: one input for all")
        super().__init__(pair, which, 0, data)  # the linear ridge fit it starts from
        self.kind = kind
        layers, identity, targets = data
        z = mx.array(self._expand(self._raw(layers, identity, 0), 0))  # the same for every j
        self.widths = [t.shape[1] for t in targets]
        # each layer's error counts alike: its outputs scaled by their RMS about the mean
        self.scale = np.concatenate([np.full(t.shape[1], t.std()) for t in targets]
                                    ).astype(np.float32)
        linear = np.concatenate([self.weights[j] for j in range(pair.n_target)], -1)
        self.net = HiddenLayer(linear / self.scale, hidden)
        y = mx.array(np.concatenate(targets, -1) / self.scale)
        schedule = optim.cosine_decay(LEARNED_LR, LEARNED_STEPS, LEARNED_LR / 20)
        optimizer = optim.Adam(learning_rate=schedule)
        step = nn.value_and_grad(self.net, lambda net, zb, yb: ((net(zb) - yb) ** 2).mean())
        rng = np.random.default_rng(0)
        for _ in range(LEARNED_STEPS):
            rows = mx.array(rng.integers(0, z.shape[0], LEARNED_BATCH))
            _, grads = step(self.net, z[rows], y[rows])
            optimizer.update(self.net, grads)
            mx.eval(self.net.parameters(), optimizer.state)

    def predict(self, layers, identity, window: int = LENGTH) -> list[np.ndarray]:
        z = mx.array(self._expand(self._raw(layers, identity, 0, window), 0))
        y = np.concatenate([np.array(self.net(z[i:i + PREDICT_ROWS]))
                            for i in range(0, z.shape[0], PREDICT_ROWS)]) * self.scale
        edges = np.cumsum([0] + self.widths)
        return [y[:, a:b] for a, b in zip(edges[:-1], edges[1:])]


class HiddenLayer(nn.Module):
    """z W + gelu(z U + c) D: `linear` is W. The input z carries the ridge fit's ones column,
    so W holds the intercept (and c only repeats what U can do with that column)."""

    def __init__(self, linear: np.ndarray, hidden: int):
        super().__init__()
        self.linear = mx.array(linear)
        self.up = nn.Linear(linear.shape[0], hidden)
        self.down = mx.zeros((hidden, linear.shape[1]))

    def __call__(self, z):
        return z @ self.linear + nn.gelu(self.up(z)) @ self.down


def windows_of(text_ids: list[int], count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [text_ids[s:s + LENGTH] for s in rng.integers(0, len(text_ids) - LENGTH, count)]


def stacked(pair: Pair, windows: list[list[int]]):
    """(per source layer, the identity, per target layer): every window's rows stacked."""
    read = [(*pair.features(w), pair.targets(w)) for w in windows]
    return ([np.concatenate(x) for x in zip(*(f for f, _, _ in read))],
            np.concatenate([e for _, e, _ in read]),
            [np.concatenate(y) for y in zip(*(t for _, _, t in read))])


def r2_layers(pred: list[np.ndarray], truth: list[np.ndarray]) -> list[float]:
    """Per target layer, 1 - residual / total sum of squares."""
    return [float(1 - ((p - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())
            for p, y in zip(pred, truth)]


def r2(pred: list[np.ndarray], truth: list[np.ndarray]) -> float:
    """Mean over target layers of 1 - residual / total sum of squares."""
    return float(np.mean(r2_layers(pred, truth)))


def measure(pair: Pair, args) -> dict:
    train_ids = pair.tgt.tokenizer.encode(Path("runs/corpus/train.txt").read_text())
    val_ids = pair.tgt.tokenizer.encode(held_out_split("validation").read_text())
    start = time.perf_counter()
    data = stacked(pair, windows_of(train_ids, args.windows, 0))
    held = stacked(pair, windows_of(val_ids, 16, 1))
    switch = fr.Switch(None, pair.src.model, pair.tgt.model)
    prompts = [list(val_ids[s:s + LENGTH])
               for s in fr.window_starts(val_ids, LENGTH, args.prompts, SEED)]
    refs = [fr.reference(switch, p) for p in prompts]
    floor = float(np.mean([r.floor for r in refs]))
    rows = []
    for name, which, hidden, kind in VARIANTS:
        if args.only and args.only not in name:
            continue
        began = time.perf_counter()
        fitted = (Learned if kind == "learned" else Map)(pair, which, hidden, data, kind)
        row = {"variant": name, "fit_s": round(time.perf_counter() - began, 1),
               "r2_train": r2(fitted.predict(data[0], data[1]), data[2]),
               "r2_held_out_layers": r2_layers(fitted.predict(held[0], held[1]), held[2])}
        row["r2_held_out"] = float(np.mean(row["r2_held_out_layers"]))
        for R in REREADS:
            agree = []
            for ref in refs:
                n = len(ref.prefix) - R
                cache = fitted.cache(ref.prefix[:n])
                if R:
                    pair.tgt.model(mx.array(ref.prefix[n:])[None], cache=cache)
                logits = pair.tgt.model(ref.inputs, cache=cache)[0]
                agree.append(float((mx.argmax(logits, -1) == mx.array(ref.tokens)).mean()))
            share = [(a - floor) / (1 - floor) for a in agree]
            row[f"recovered_R{R}"] = float(np.mean(share))
            row[f"recovered_R{R}_se"] = float(np.std(share) / np.sqrt(len(share)))
        rows.append(row)
        print(f"{pair.name}: {name}: R^2 {row['r2_train']:.3f} / {row['r2_held_out']:.3f}, "
              + ", ".join(f"R={R} {row[f'recovered_R{R}']:.2f}" for R in REREADS), flush=True)
    return {"pair": pair.name, "windows": args.windows, "tokens": args.windows * LENGTH,
            "prompts": args.prompts, "floor": floor, "rows": rows,
            "minutes": round((time.perf_counter() - start) / 60, 1)}


def tabulate(results: dict) -> str:
    lines = ["# Capacity of token-wise maps\n",
             "Can a richer map of the same per-token inputs carry more of the history? Stage-1 "
             "maps of attention pairs' keys and values (capture point (1)) fitted by ridge "
             "regression on windows of 256 tokens of the train split, from the source layers "
             "named, the token id's target embedding beside them, and for the nonlinear rows H "
             "random ReLU features of those inputs (or hidden units learned by Adam, or the "
             "previous token's features beside them, or their running means over the window "
             "so far, decayed by 0.95 a token and plain). **R^2**: mean over target layers, "
             "fitting windows / 16 held-out windows; **by layer**: held out, per target layer, "
             "first to last. **Recovered**: the history's worth kept, "
             "(agreement - floor) / (1 - floor), teacher-forced on the native greedy "
             "continuation of held-out prompts of 256 tokens (validation split) with the target "
             "reading the last R prompt tokens itself (mean over prompts, standard error in "
             "brackets). Regenerate with `python research/capacity.py`.\n",
             f"BLAS: {results['blas']}\n"]
    for p in results["pairs"]:
        lines += [f"## {p['pair']}\n",
                  f"{p['tokens']:,} fitting tokens, {p['prompts']} prompts, floor "
                  f"{p['floor']:.3f}; {p['minutes']} min.\n",
                  "| map | R^2 fit / held out | by layer | "
                  + " | ".join(f"recovered, R = {R}" for R in REREADS) + " |",
                  "|---|---|---|" + "---|" * len(REREADS)]
        for r in p["rows"]:
            layers = " / ".join(f"{x:.2f}" for x in r.get("r2_held_out_layers", []))
            lines.append(f"| {r['variant']} | {r['r2_train']:.3f} / {r['r2_held_out']:.3f} | "
                         f"{layers or '-'} | " + " | ".join(f"{r[f'recovered_R{R}']:.2f} "
                                      f"({r[f'recovered_R{R}_se']:.2f})" for R in REREADS)
                         + " |")
        lines.append("")
    return "\n".join(lines)


def merged(old: dict, new: dict) -> dict:
    """`old`'s results with `new`'s rows in place of (or beside) theirs, in VARIANTS order
    (rows of variants no longer listed last); a pair measured with other windows or prompts
    is replaced whole."""
    order = [v[0] for v in VARIANTS]
    pairs = {p["pair"]: p for p in old["pairs"]}
    for p in new["pairs"]:
        before = pairs.get(p["pair"])
        if before is None or any(before[k] != p[k] for k in ("windows", "prompts")):
            pairs[p["pair"]] = p
            continue
        rows = {r["variant"]: r for r in before["rows"]} | {r["variant"]: r for r in p["rows"]}
        before["rows"] = sorted(rows.values(), key=lambda r: order.index(r["variant"])
                                if r["variant"] in order else len(order))
    return {**new, "pairs": list(pairs.values())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="qwen3-large:qwen3-small,qwen3-small:qwen3-large")
    parser.add_argument("--windows", type=int, default=256, help="fitting windows of 256")
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts")
    parser.add_argument("--only", help="only the variants whose names hold this; the other "
                                       "rows of capacity.json are kept")
    parser.add_argument("--tabulate", action="store_true", help="only rebuild capacity.md")
    args = parser.parse_args()
    if args.tabulate:
        (OUT / "capacity.md").write_text(tabulate(json.loads((OUT / "capacity.json").read_text())))
        return
    if not Path("runs/corpus/train.txt").is_file():
        raise SystemExit("no train split: build the zoo corpus with `kvtrans zoo corpus`")
    if args.only and not any(args.only in v[0] for v in VARIANTS):
        raise SystemExit(f"--only {args.only!r}: no variant's name holds it")
    saved = OUT / "capacity.json"
    old = json.loads(saved.read_text()) if args.only and saved.is_file() else {"pairs": []}
    blas = blas_report()
    results = {"blas": str(blas), "pairs": []}
    for spec in args.pairs.split(","):
        source, target = spec.split(":")
        results["pairs"].append(measure(Pair(source, target), args))
    if args.only:
        results = merged(old, results)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "capacity.json").write_text(json.dumps(results, indent=1) + "\n")
    (OUT / "capacity.md").write_text(tabulate(results))
    print(f"wrote {OUT / 'capacity.md'}")


if __name__ == "__main__":
    main()
