"""Gated delta rule: mlx-lm's token loop vs the chunkwise-parallel form, side by side.

Measures forward and forward+backward of the bare recurrence, and a whole training step
(loss + gradients) of small qwen3_5 (GDN) and kimi_linear (KDA) models. Prints a table and
writes benchmarks/results/recurrence.json. Run: python benchmarks/recurrence.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_kvtrans  # noqa: F401  (fast BLAS first)
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from mlx_kvtrans.blas import blas_report, median_seconds
from mlx_kvtrans.capture.instrument import chunked_recurrence
from mlx_kvtrans.layouts.gated_delta import gated_delta_update_chunked
from mlx_kvtrans.zoo.families import tiny_config
from mlx_kvtrans.zoo.random_model import build_model

RESULTS = Path(__file__).parent / "results" / "recurrence.json"


def recurrence_inputs(B, T, H, D, per_channel):
    keys = mx.random.split(mx.random.key(0), 6)
    q, k = normalize_qk(mx.random.normal((B, T, H, D), key=keys[0]),
                        mx.random.normal((B, T, H, D), key=keys[1]), inv_scale=D**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, H, D), key=keys[2])
    a = mx.random.normal((B, T, H, D) if per_channel else (B, T, H), key=keys[3])
    b = mx.random.normal((B, T, H), key=keys[4])
    A_log = mx.log(mx.random.uniform(1, 16, (H, 1) if per_channel else (H,), key=keys[5]))
    dt_bias = mx.zeros((H, D) if per_channel else (H,))
    return q, k, v, a, b, A_log, dt_bias


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
    args = parser.parse_args()
    blas = blas_report()
    results = {"blas": blas.name, "matmul_float32_gflops": round(blas.gflops, 1),
               "dtype": "float32", "device": str(mx.default_device()), "rows": []}
    print(f"BLAS {blas.name}, {blas.gflops:.0f} GFLOP/s float32, {mx.default_device()}")
    print(f"{'case':44s} {'loop s':>9s} {'chunked s':>10s} {'speed-up':>9s}")
    cases = [("recurrence GDN fwd+bwd B8 T512 H4 D32", lambda: bare_recurrence(8, 512, 4, 32, False, args.repeats)),
             ("recurrence KDA fwd+bwd B8 T512 H4 D32", lambda: bare_recurrence(8, 512, 4, 32, True, args.repeats)),
             ("train step qwen3_5 h128 B8 T256", lambda: training_step("qwen3_5", 128, 8, 256, args.repeats)),
             ("train step kimi_linear h128 B8 T256", lambda: training_step("kimi_linear", 128, 8, 256, args.repeats))]
    for name, run in cases:
        row = {"case": name, **run()}
        row["train_speedup"] = row["loop_train_s"] / row["chunked_train_s"]
        results["rows"].append(row)
        print(f"{name:44s} {row['loop_train_s']:9.3f} {row['chunked_train_s']:10.3f} "
              f"{row['train_speedup']:8.1f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
