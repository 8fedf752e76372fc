"""Gated delta rule: mlx-lm's token loop vs the chunkwise-parallel form, side by side.

Training: forward and forward+backward of the bare recurrence, and a whole training step
(loss + gradients) of small qwen3_5 (GDN) and kimi_linear (KDA) models. Replay: the forward
a switch into a linear-attention target runs, at real checkpoints' layer sizes (Kimi-Linear-48B's
KDA, 32 heads of 128; Qwen3.5's GDN, 16 key and 32 value heads of 128) with decay rates as a
trained model starts from (`zoo.realistic.trained_dt_bias`), per chunk size (the sweep behind
`default_chunk_size`), with the largest difference from the token loop. State only: a replay
that rebuilds only the final state (what installing a translated cache runs), its chunks
composed one after another or as a tree (`TREE_RATIO`), at the zoo's KDA sizes and real ones.
Prints tables and writes research/results/recurrence.json.

    python research/recurrence.py [--repeats N] [--lengths 1024,4096] [--only replay|state]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_kvtrans  # noqa: F401  (fast BLAS first)
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from mlx_kvtrans.backend.blas import blas_report, median_seconds
from mlx_kvtrans.capture.instrument import chunked_recurrence
from mlx_kvtrans.layouts.gated_delta import (TREE_RATIO, default_chunk_size, gated_delta_chunked,
                                             gated_delta_update_chunked, log_decay)
from mlx_kvtrans.zoo.families import tiny_config
from mlx_kvtrans.zoo.random_model import build_model
from mlx_kvtrans.zoo.realistic import trained_dt_bias

RESULTS = Path(__file__).parent / "results" / "recurrence.json"


def recurrence_inputs(B, T, H, D, per_channel, trained_decay=False, Hk=None):
    """Normalised q, k (Hk heads), values, gate inputs and constants for H value heads of D;
    `trained_decay`: dt_bias as a trained model starts from (else mlx-lm's zeros)."""
    Hk = Hk or H
    keys = mx.random.split(mx.random.key(0), 7)
    q, k = normalize_qk(mx.random.normal((B, T, Hk, D), key=keys[0]),
                        mx.random.normal((B, T, Hk, D), key=keys[1]), inv_scale=D**-0.5,
                        eps=1e-6)
    v = mx.random.normal((B, T, H, D), key=keys[2])
    a = mx.random.normal((B, T, H, D) if per_channel else (B, T, H), key=keys[3])
    b = mx.random.normal((B, T, H), key=keys[4])
    A_log = mx.log(mx.random.uniform(1, 16, (H, 1) if per_channel else (H,), key=keys[5]))
    shape = (H, D) if per_channel else (H,)
    dt_bias = trained_dt_bias(shape, keys[6]) if trained_decay else mx.zeros(shape)
    return q, k, v, a, b, A_log, dt_bias


def replay(T, H, D, per_channel, repeats, Hk=None, chunk_sizes=(16, 32, 64)):
    """Forward only, at one length: the token loop and the chunkwise form per chunk size."""
    q, k, v, a, b, A_log, dt_bias = recurrence_inputs(1, T, H, D, per_channel, True, Hk)
    mx.eval(q, k, v, a, b, dt_bias)
    y, state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, use_kernel=False)
    mx.eval(y, state)  # a lazy 4K-step graph would hold every step's state
    row = {"loop_s": median_seconds(lambda: mx.eval(gated_delta_update(
        q, k, v, a, b, A_log, dt_bias, use_kernel=False)), repeats), "chunked": {}}
    for C in chunk_sizes:
        run = lambda: gated_delta_update_chunked(q, k, v, a, b, A_log, dt_bias,  # noqa: E731
                                                 chunk_size=C)
        y_c, state_c = run()
        mx.eval(y_c, state_c)
        row["chunked"][str(C)] = {
            "seconds": median_seconds(lambda: mx.eval(run()), repeats),
            "max_output_diff": float(mx.abs(y_c - y).max()),
            "max_state_diff": float(mx.abs(state_c - state).max())}
    return row


def state_only(T, H, D, repeats):
    """A KDA replay that keeps only the final state: the chunk loop beside the tree."""
    q, k, v, a, b, A_log, dt_bias = recurrence_inputs(1, T, H, D, True, True)
    log_g, beta = log_decay(A_log, a, dt_bias), mx.sigmoid(b)
    mx.eval(q, k, v, log_g, beta)
    run = {tree: (lambda tree=tree: gated_delta_chunked(q, k, v, log_g, beta, state_only=True,
                                                        tree=tree)[1])
           for tree in (False, True)}
    loop, tree = run[False](), run[True]()
    return {"loop_s": median_seconds(lambda: mx.eval(run[False]()), repeats),
            "tree_s": median_seconds(lambda: mx.eval(run[True]()), repeats),
            "max_state_diff": float(mx.abs(tree - loop).max()),
            "tree_by_default": D <= TREE_RATIO * default_chunk_size(True)}


def bare_recurrence(B, T, H, D, per_channel, repeats):
    q, k, v, a, b, A_log, dt_bias = recurrence_inputs(B, T, H, D, per_channel)
    impls = {"loop": lambda *x: gated_delta_update(*x, A_log, dt_bias, use_kernel=False),
             "chunked": lambda *x: gated_delta_update_chunked(*x, A_log, dt_bias)}
    row = {}
    for name, update in impls.items():
        loss = lambda q, k, v, a, b: (update(q, k, v, a, b)[0] ** 2).sum()
        grad = mx.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
        row[f"{name}_forward_s"] = median_seconds(lambda: mx.eval(update(q, k, v, a, b)), repeats)
        row[f"{name}_train_s"] = median_seconds(lambda: mx.eval(grad(q, k, v, a, b)), repeats)
    return row


def training_step(family, hidden, B, T, repeats):
    config = tiny_config(family, vocab_size=4096)
    target = config.get("text_config", config)
    target.update(hidden_size=hidden, intermediate_size=3 * hidden)
    model = build_model(config)
    model.train()
    tokens = mx.random.randint(0, 4096, (B, T + 1), key=mx.random.key(1))

    def loss_fn(model):
        logits = model(tokens[:, :-1])
        return nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()

    step = nn.value_and_grad(model, loss_fn)
    row = {"loop_train_s": median_seconds(lambda: mx.eval(step(model)), repeats)}
    with chunked_recurrence():
        row["chunked_train_s"] = median_seconds(lambda: mx.eval(step(model)), repeats)
    row["params"] = sum(x.size for _, x in __import__("mlx.utils").utils.tree_flatten(model.parameters()))
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", default="1024,4096", help="replay lengths")
    parser.add_argument("--only", choices=("training", "replay", "state"), default=None)
    args = parser.parse_args()
    blas = blas_report()
    results = {"blas": blas.name, "matmul_float32_gflops": round(blas.gflops, 1),
               "dtype": "float32", "device": str(mx.default_device()),
               "default_chunk_size": {"gdn": default_chunk_size(False),
                                      "kda": default_chunk_size(True)},
               "rows": [], "replay": [], "state_only": []}
    if RESULTS.exists():  # a partial run keeps the other tables
        previous = json.loads(RESULTS.read_text())
        for table in ("rows", "replay", "state_only"):
            results[table] = previous.get(table, [])
    print(f"BLAS {blas.name}, {blas.gflops:.0f} GFLOP/s float32, {mx.default_device()}")
    if args.only in (None, "training"):
        results["rows"] = []
        print(f"{'case':44s} {'loop s':>9s} {'chunked s':>10s} {'speed-up':>9s}")
        cases = [("recurrence GDN fwd+bwd B8 T512 H4 D32",
                  lambda: bare_recurrence(8, 512, 4, 32, False, args.repeats)),
                 ("recurrence KDA fwd+bwd B8 T512 H4 D32",
                  lambda: bare_recurrence(8, 512, 4, 32, True, args.repeats)),
                 ("train step qwen3_5 h128 B8 T256",
                  lambda: training_step("qwen3_5", 128, 8, 256, args.repeats)),
                 ("train step kimi_linear h128 B8 T256",
                  lambda: training_step("kimi_linear", 128, 8, 256, args.repeats))]
        for name, run in cases:
            row = {"case": name, **run()}
            row["train_speedup"] = row["loop_train_s"] / row["chunked_train_s"]
            results["rows"].append(row)
            print(f"{name:44s} {row['loop_train_s']:9.3f} {row['chunked_train_s']:10.3f} "
                  f"{row['train_speedup']:8.1f}x")
    if args.only in (None, "state"):
        results["state_only"] = []
        print(f"{'state-only replay (KDA)':44s} {'loop s':>9s} {'tree s':>9s} {'max diff':>9s} "
              "default")
        for name, H, D in [("zoo kimi-linear H4 D32", 4, 32), ("Kimi-Linear-48B H32 D128", 32, 128)]:
            for T in (int(x) for x in args.lengths.split(",")):
                row = {"case": f"{name} T{T}", "length": T, **state_only(T, H, D, args.repeats)}
                results["state_only"].append(row)
                print(f"{row['case']:44s} {row['loop_s']:9.3f} {row['tree_s']:9.3f} "
                      f"{row['max_state_diff']:9.1e} {'tree' if row['tree_by_default'] else 'loop'}")
    if args.only in (None, "replay"):
        results["replay"] = []
        print(f"{'replay':44s} {'loop s':>9s} {'C':>4s} {'chunked s':>10s} {'speed-up':>9s} "
              f"{'max diff':>9s}")
        layers = [("KDA (Kimi-Linear-48B) H32 D128", 32, 32, True),
                  ("GDN (Qwen3.5) Hk16 Hv32 D128", 32, 16, False)]
        for name, H, Hk, per_channel in layers:
            for T in (int(x) for x in args.lengths.split(",")):
                row = {"case": f"{name} T{T}", "length": T,
                       **replay(T, H, 128, per_channel, args.repeats, Hk)}
                for C, c in row["chunked"].items():
                    c["speedup"] = row["loop_s"] / c["seconds"]
                    print(f"{row['case']:44s} {row['loop_s']:9.3f} {C:>4s} {c['seconds']:10.3f} "
                          f"{c['speedup']:8.1f}x {c['max_output_diff']:9.1e}")
                results["replay"].append(row)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
