"""What the benchmark scripts share: where results go, the shipped directions, loading a
translator with its models, and writing results beside the rows other runs left.

Each script runs from the repository root (`python benchmarks/NAME.py`); research studies
(`research/`) import this module too.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS

from mlx_kvtrans.backend.blas import blas_report
from mlx_kvtrans.translators import artifact

OUT = Path(__file__).resolve().parent / "results"
ZOO_LENGTHS = [256, 512, 1024, 2048]  # 1x-8x the zoo's fitting length; its models recall to 2K


def shipped_directions() -> list[str]:
    """One translator per shipped (source, target) direction, the distilled one first."""
    pairs = {}
    for name in artifact.shipped_names():
        manifest = artifact.read_manifest(name)
        pairs[(manifest["source"]["name"], manifest["target"]["name"])] = None
    return sorted(artifact.shipped(*pair).name for pair in pairs)


def loaded(name, models: dict):
    """(translator, source, target) of a translator name or directory; `models` keeps the
    models loaded by alias."""
    manifest = artifact.read_manifest(name)
    source, target = manifest["source"]["name"], manifest["target"]["name"]
    for alias in (source, target):
        models.setdefault(alias, kv.load(alias))
    src, tgt = models[source], models[target]
    return artifact.load(name, src, tgt), src, tgt


def cell(value, spec: str) -> str:
    """A table cell: `value` formatted, or "-" where nothing was measured."""
    return "-" if value is None else format(value, spec)


def ints(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",")] if text else None


def merge_and_write(results_file: Path, settings: dict, measured: dict) -> tuple[dict, str]:
    """Write `measured` into `results_file` beside the rows it holds of other shipped
    translators measured with the same `settings` (read as it is now: other runs may have
    added to it): (every translator's entry, the BLAS line)."""
    previous = json.loads(results_file.read_text()) if results_file.exists() else {}
    results = previous.get("translators", {}) if previous.get("settings") == settings else {}
    shipped = set(artifact.shipped_names())  # rows of translators no longer shipped go
    results = {k: v for k, v in results.items() if k in shipped}
    results = dict(sorted({**results, **measured}.items()))
    blas = str(blas_report())
    results_file.parent.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps({"blas": blas, "settings": settings,
                                        "translators": results}, indent=2) + "\n")
    return results, blas
