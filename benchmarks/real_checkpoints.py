"""`kvtrans plan` for the mission's three real pairs on the Mac users fit on (projections).

No real checkpoint's config.json is on this machine, so each model is the config
`zoo.families.full_config` reconstructs from its published sizes (per-layer sizes, layer count,
vocabulary, experts; bfloat16 as the checkpoints ship), and its 4-bit conversion (mlx-lm's
affine, group 64, as mlx-community publishes). Per pair and weights, the plan's fit time for
a million fitting tokens, peak memory and the switch's translation cost at the M3 Ultra
preset's rates (`machines.PRESETS`): projections from FLOPs and bytes, not measurements.

Also what a switch moves between two Macs (`mx.distributed`): per token, the source features
the translator reads and the translated cache it installs, in bfloat16 as the checkpoints
compute, and at 4,096 tokens over a Thunderbolt 5 link.

Writes benchmarks/results/real-checkpoints.{json,md} and the figures blocks of
docs/real-checkpoints.md and docs/distributed.md.

    python benchmarks/real_checkpoints.py [--tokens 1000000] [--configs DIR]

`--configs DIR` also writes the reconstructed configs (DIR/kimi-linear/config.json, ...) so
that `kvtrans plan --from DIR/kimi-linear ...` can be run on them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import mlx_kvtrans  # noqa: F401  first: fast BLAS

from mlx_kvtrans.training.fit_time import fit_time
from mlx_kvtrans.layouts import layout_of
from mlx_kvtrans.training.machines import machine_for
from mlx_kvtrans.models import load_config_only
from mlx_kvtrans.training.cost import active_parameters, fits, parameter_count
from mlx_kvtrans.training.fit import FitConfig
from mlx_kvtrans.training.plan import designed
from mlx_kvtrans.training.workflows import plan_and_cost
from mlx_kvtrans.zoo.families import full_config

HERE = Path(__file__).resolve().parent
OUT = HERE / "results"
DOC = HERE.parent / "docs" / "real-checkpoints.md"
LINK_DOC = HERE.parent / "docs" / "distributed.md"
LINK_GBITS = 80  # Thunderbolt 5, per Apple's Mac Studio (M3 Ultra) specifications
LINK_LENGTH = 4096
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
MACHINE = "m3-ultra"
# (pair, source, target, the checkpoints' Hugging Face ids)
PAIRS = [("Kimi-Linear-48B-A3B -> Kimi-VL-A3B", "kimi-linear", "kimi-vl",
          ("moonshotai/Kimi-Linear-48B-A3B-Instruct", "moonshotai/Kimi-VL-A3B-Instruct")),
         ("Qwen3.5-27B -> Qwen3.5-27B", "qwen3.5", "qwen3.5",
          ("Qwen/Qwen3.5-27B", "Qwen/Qwen3.5-27B")),
         ("Qwen3.5-27B -> DeepSeek-V3.2", "qwen3.5", "deepseek-v3.2",
          ("Qwen/Qwen3.5-27B", "deepseek-ai/DeepSeek-V3.2"))]
WEIGHTS = {"bf16": None, "4-bit": {"group_size": 64, "bits": 4}}
# (weights, features): the default design (`auto`) on both weights, and the nearest-layer one
ROWS = [("bf16", "auto"), ("4-bit", "auto"), ("4-bit", "nearest")]


def write_configs(root: Path) -> None:
    for name in {n for _, s, t, _ in PAIRS for n in (s, t)}:
        for weights, quantization in WEIGHTS.items():
            config = full_config(name)
            if quantization:
                config["quantization"] = quantization
            directory = root / (name if quantization is None else f"{name}-{weights}")
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def plan_row(root: Path, pair: str, source: str, target: str, weights: str, features: str,
             tokens: int) -> dict:
    suffix = "" if WEIGHTS[weights] is None else f"-{weights}"
    src, tgt = (load_config_only(str(root / f"{n}{suffix}")) for n in (source, target))
    config = FitConfig(features=features)
    machine = machine_for(MACHINE)
    _, cost = plan_and_cost(src, tgt, config, machine)
    timed = fit_time(src, tgt, cost, config, tokens, timed=False)
    # re-reading the history instead: the target's prefill at the machine's matmul rate
    prefill_ms = {n: 2 * active_parameters(tgt) * n / (machine.matmul_gflops * 1e9) * 1000
                  for n in cost.lengths}
    row = {"pair": pair, "weights": weights, "fit_tokens": tokens, "asked": features,
           "features": designed(layout_of(src.model), layout_of(tgt.model), features),
           "parameters": [parameter_count(lm.model) for lm in (src, tgt)],
           "active_parameters": [round(active_parameters(lm)) for lm in (src, tgt)],
           "weights_bytes": cost.weights_bytes, "moments_bytes": cost.moments_bytes,
           "fit_peak_bytes": cost.fit_peak_bytes, "fits": fits(cost),
           "fit_seconds": round(timed.seconds, 1), "fit_time": timed.to_json(),
           "translator_parameters": cost.parameters,
           "link": link(cost),
           "switch": {str(n): {"gflop": round(r["flops"] / 1e9, 1),
                               "installed_mib": round(r["bytes"] / 2**20, 1),
                               "ms_at_peak": round(r["seconds_at_peak"] * 1000, 1),
                               "reread_ms": round(prefill_ms[n], 1)}
                      for n, r in cost.lengths.items()}}
    print(f"{pair} ({weights}, features {features}): fit {row['fit_seconds']:.0f} s, peak "
          f"{row['fit_peak_bytes'] / 2**30:.1f} GiB, fits {row['fits']}", flush=True)
    return row


def link(cost) -> dict:
    """What a switch between two Macs moves, in bfloat16 (the plan's layouts are float32)."""
    cache = cost.install_bytes_per_token // 2
    fixed = (cost.lengths[LINK_LENGTH]["bytes"] - cost.install_bytes_per_token * LINK_LENGTH) // 2
    features = 2 * sum(f.inputs for f in cost.feature_sets)
    at = {name: per_token * LINK_LENGTH + extra
          for name, per_token, extra in (("features", features, 0), ("cache", cache, fixed))}
    return {"features_bytes_per_token": features, "cache_bytes_per_token": cache,
            "cache_fixed_bytes": fixed, "length": LINK_LENGTH,
            "features_bytes": at["features"], "cache_bytes": at["cache"],
            "cache_ms_over_link": round(at["cache"] * 8 / (LINK_GBITS * 1e9) * 1000, 1)}


def link_markdown(rows: list[dict]) -> str:
    lines = ["What a switch moves when the source runs on one Mac and the target on another, in "
             f"bfloat16, per token and for {LINK_LENGTH:,} tokens of history (translated cache: "
             "per-token objects plus fixed-size states), and the translated cache's time over "
             f"a {LINK_GBITS} Gb/s Thunderbolt 5 link (`python benchmarks/real_checkpoints.py`, "
             "projections from the reconstructed configs):\n",
             "| pair | source features per token | translated cache per token | "
             f"translated cache at {LINK_LENGTH:,} tokens | over the link |",
             "|---|---|---|---|---|"]
    for r in rows:
        if (r["weights"], r["asked"]) != ("bf16", "auto"):
            continue
        k = r["link"]
        lines.append(f"| {r['pair']} | {k['features_bytes_per_token'] / 1024:,.1f} KiB | "
                     f"{k['cache_bytes_per_token'] / 1024:,.1f} KiB | "
                     f"{k['cache_bytes'] / 2**20:,.0f} MiB | {k['cache_ms_over_link']:,.0f} ms |")
    return "\n".join(lines) + "\n"


def render(doc: Path, table: str) -> None:
    text = doc.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    doc.write_text(text[:start] + "\n" + table + text[stop:])


def markdown(rows: list[dict], machine) -> str:
    lines = [f"Projected for the {machine.name} ({machine.source}), a fit of "
             f"{rows[0]['fit_tokens']:,} tokens at `kvtrans fit`'s defaults "
             "(`python benchmarks/real_checkpoints.py`). Features: what the maps read "
             "(`kvtrans plan --features`; the default, auto, is `same` for two models of one "
             "geometry and `attention` otherwise). The switch: its translation FLOPs, the bytes "
             "installed and both at the machine's peak rates, and as a share of re-reading the "
             "history (the target's prefill at the machine's matmul rate).\n",
             "| pair | weights | features | parameters (active) | fit | peak memory "
             "(weights + moments) | translator parameters (of the target's) | switch at 4,096 "
             "tokens | of re-reading |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        params = " + ".join(f"{p / 1e9:.0f}B ({a / 1e9:.1f}B)"
                            for p, a in zip(r["parameters"], r["active_parameters"]))
        peak = (f"{r['fit_peak_bytes'] / 2**30:,.0f} GiB ({r['weights_bytes'] / 2**30:,.0f} + "
                f"{r['moments_bytes'] / 2**30:,.1f})"
                + ("" if r["fits"] else ": **does not fit**"))
        switch = r["switch"]["4096"]
        lines.append(f"| {r['pair']} | {r['weights']} | {r['features']} | {params} | "
                     f"{_duration(r['fit_seconds'])} | {peak} | "
                     f"{r['translator_parameters'] / 1e6:,.0f}M "
                     f"({r['translator_parameters'] / r['parameters'][1]:.2%}) | "
                     f"{switch['gflop']:,.0f} GFLOP, {switch['installed_mib']:,.0f} MiB, "
                     f"{switch['ms_at_peak']:,.0f} ms | "
                     f"{switch['ms_at_peak'] / switch['reread_ms']:.2%} |")
    return "\n".join(lines) + "\n"


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--configs", type=Path, help="also write the reconstructed configs here")
    args = parser.parse_args()
    if args.configs:
        write_configs(args.configs)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_configs(root)
        rows = [plan_row(root, pair, s, t, w, f, args.tokens)
                for pair, s, t, _ in PAIRS for w, f in ROWS]
    machine = machine_for(MACHINE)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "real-checkpoints.json").write_text(json.dumps(
        {"machine": vars(machine), "pairs": [{"pair": p, "models": list(ids)}
                                             for p, _, _, ids in PAIRS],
         "rows": rows}, indent=2) + "\n")
    table = markdown(rows, machine)
    (OUT / "real-checkpoints.md").write_text(
        "# The mission's real pairs, planned for the M3 Ultra (projections)\n\n" + table
        + "\n## A switch between two Macs\n\n" + link_markdown(rows))
    render(DOC, table)
    render(LINK_DOC, link_markdown(rows))


if __name__ == "__main__":
    main()
