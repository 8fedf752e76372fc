"""What a given KL buys: the share of the history's worth a target keeps when its own cache
carries plain noise, beside what the shipped translators keep at their KL.

For each target model of a shipped direction: the target's own cache of each held-out window,
every cached array given Gaussian noise of `eps` times its own RMS (`--eps`, a few scales),
scored as the frontier scores a switch (`evaluation/frontier.py`): teacher-forced on native's
greedy continuation, the recovered share over the last-16 floor, KL(native || noised) per
continuation token, and of the positions whose argmax parts from native's the share that
native itself nearly ties. As a switch at R (`--reread`, default the gate's 8) does, the noise
is in the cache of all but the prompt's last R + 1 tokens, which the target then reads over
it. A cache of unstructured error whose KL matches a translator's says how much of that
translator's loss comes with any error of that size, and how much is its own. On the test
split, 64 windows per length by default; each figure with its 95% bootstrap interval.

Writes research/results/noise.{json,md} (`--results DIR`: there instead).

    python research/noise.py [--targets qwen3-small,kimi-vl] [--eps 0.1,0.2,0.4]
    python research/noise.py --tabulate
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS
import mlx.core as mx
import numpy as np

from frontier import shipped_directions
from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.evaluation import frontier as fr
from mlx_kvtrans.evaluation.intervals import bootstrap, recovered_share
from mlx_kvtrans.models import held_out_split
from mlx_kvtrans.translators import artifact

OUT = Path(__file__).resolve().parent / "results"
LENGTHS = (256, 512)  # where the bars are read
EPS = (0.1, 0.2, 0.3, 0.4, 0.6)
REREAD = 8  # the gate's tail, which every shipped direction but one reads at its default


def noised(cache: list, eps: float, seed: int) -> list:
    """`cache` (mlx-lm's caches, one per layer) with every cached array, up to each cache's
    offset, given N(0, (eps * its RMS)^2) noise."""
    drawn = iter(range(1_000_000))

    def noisy(value: mx.array) -> mx.array:
        rms = mx.sqrt(mx.mean(value.astype(mx.float32) ** 2))
        noise = mx.random.normal(value.shape, key=mx.random.key(seed * 100_003 + next(drawn)))
        return (value + eps * rms * noise).astype(value.dtype)

    def into(c) -> int:  # arrays noised
        if hasattr(c, "caches"):  # CacheList
            return sum(into(sub) for sub in c.caches)
        if getattr(c, "keys", None) is not None:  # KVCache and its kind: the filled slots
            c.keys, c.values = (noisy(a[..., :c.offset, :]) for a in (c.keys, c.values))
            return 2
        if isinstance(getattr(c, "cache", None), list):  # ArraysCache: conv and state
            c.cache = [a if a is None else noisy(a) for a in c.cache]
            return sum(a is not None for a in c.cache)
        return 0

    for i, layer in enumerate(cache):
        if not into(layer):
            raise ValueError(f"layer {i}: no noise for a {type(layer).__name__}")
    return cache


def measure(alias: str, model, text_ids: list[int], eps_grid, prompts: int,
            reread: int) -> list[dict]:
    """Per length and noise scale: the target's own cache of all but the prompt's last
    `reread` + 1 tokens noised, then those read over it, as a switch at R = `reread` does."""
    switch = fr.Switch(None, model.model, model.model)
    rows = []
    for length in LENGTHS:
        starts = fr.window_starts(text_ids, length, prompts, 0)
        refs = [fr.reference(switch, list(text_ids[s:s + length])) for s in starts]
        floor = [r.floor for r in refs]
        for eps in eps_grid:
            agree, kls, parted, tied = [], [], 0, 0
            for w, ref in enumerate(refs):
                n = len(ref.prefix) - reread
                cache = noised(switch.native(ref.prefix[:n]), eps, w)
                if reread:
                    model.model(mx.array(ref.prefix[n:])[None], cache=cache)
                got = fr.against(ref, model.model(ref.inputs, cache=cache)[0])
                agree.append(got["agree"])
                kls.append(got["kl"])
                parted, tied = parted + got["parted"], tied + got["tied"]
            rows.append({"target": alias, "length": length, "eps": eps, "reread": reread,
                         "windows": prompts, "kl": float(np.mean(kls)),
                         "history_recovered": recovered_share(np.mean(agree), np.mean(floor)),
                         "interval": bootstrap(recovered_share, [agree, floor]),
                         "near_ties": tied / parted if parted else None})
            print(f"{alias} {length} eps {eps}: KL {rows[-1]['kl']:.4f}, recovered "
                  f"{rows[-1]['history_recovered']:.2f}", flush=True)
    return rows


def translator_rows() -> list[dict]:
    """The shipped directions' KL and recovered share at their default setting (bars.json)."""
    path = OUT / "bars.json"
    if not path.is_file():
        return []
    out = []
    for name, r in json.loads(path.read_text())["translators"].items():
        for row in r["rows"]:
            if row["length"] in LENGTHS:
                out.append({"translator": name, "target": r["target"], "length": row["length"],
                            "reread": r["reread"], "kl": row["kl"],
                            "history_recovered": row["history_recovered"],
                            "interval": row["intervals"]["history_recovered"],
                            "near_ties": row.get("near_ties")})
    return out


def write_markdown(saved: dict, out: Path) -> None:
    cell = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = ["# What a given KL buys\n",
             "The history's worth kept (recovered share, teacher-forced against native's greedy "
             "continuation, above the last-16 floor) by a target reading its own cache with "
             "Gaussian noise of eps times each cached array's RMS, then the prompt's last R "
             "tokens over it as a switch at R does, beside the shipped "
             f"translators at their default setting (`bars.md`), on the test split, "
             f"{saved['settings']['prompts']} windows per length. *Near ties*: of the "
             "positions whose argmax parts from native's, the share where native's two likeliest "
             f"tokens lie within {fr.TIE_NATS} nats. Read a translator's row against the noise "
             "rows of its target at about its KL: where noise of that KL keeps about as much, "
             "the loss is what any error of that size costs. Regenerate with "
             "`python research/noise.py`.\n", f"BLAS: {saved['blas']}\n",
             "| target | L | cache | KL | recovered [95%] | near ties |",
             "|---|---|---|---|---|---|"]
    for row in saved["rows"]:
        lo, hi = row["interval"]
        lines.append(f"| {row['target']} | {row['length']} | own, noise {row['eps']:g}, R = "
                     f"{row['reread']} | "
                     f"{row['kl']:.4f} | {row['history_recovered']:.2f} [{lo:.2f}, {hi:.2f}] | "
                     f"{cell(row['near_ties'], '.2f')} |")
    targets = {row["target"] for row in saved["rows"]}
    for row in translator_rows():
        if row["target"] in targets:
            lo, hi = row["interval"]
            lines.append(f"| {row['target']} | {row['length']} | {row['translator']}, R = "
                         f"{row['reread']} | {row['kl']:.4f} | {row['history_recovered']:.2f} "
                         f"[{lo:.2f}, {hi:.2f}] | {cell(row['near_ties'], '.2f')} |")
    (out / "noise.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", help="a,b (default: every shipped direction's target)")
    parser.add_argument("--eps", default=",".join(map(str, EPS)),
                        help="noise scales, times each array's RMS")
    parser.add_argument("--prompts", type=int, default=64, help="held-out windows per length")
    parser.add_argument("--reread", type=int, default=REREAD,
                        help="the prompt's last R tokens (and the last) read over the noise")
    parser.add_argument("--results", type=Path, default=OUT)
    parser.add_argument("--tabulate", action="store_true", help="only rebuild noise.md")
    args = parser.parse_args()
    path = args.results / "noise.json"
    if args.tabulate:
        return write_markdown(json.loads(path.read_text()), args.results)
    targets = args.targets.split(",") if args.targets else sorted(
        {artifact.read_manifest(n)["target"]["name"] for n in shipped_directions()})
    eps_grid = [float(e) for e in args.eps.split(",")]
    started, rows = time.perf_counter(), []
    for alias in targets:
        model = kv.load(alias)
        ids = model.tokenizer.encode(held_out_split("test").read_text())
        rows += measure(alias, model, ids, eps_grid, args.prompts, args.reread)
    saved = {"blas": str(blas_report()), "settings": {"prompts": args.prompts, "eps": eps_grid,
                                                      "reread": args.reread},
             "minutes": round((time.perf_counter() - started) / 60, 2), "rows": rows}
    args.results.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=1))
    write_markdown(saved, args.results)


if __name__ == "__main__":
    main()
