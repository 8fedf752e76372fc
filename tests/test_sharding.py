"""Models loaded sharded by mlx-lm translate as their unsharded twins: two processes under
`mlx.launch --backend ring` capture a sharded source whole and install their share of a sharded
target, which continues as the unsharded target does, and a `Session` over sharded models
switches as over their twins (`tests/sharded_worker.py`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_kvtrans  # noqa: F401  first: fast BLAS
import mlx.core as mx

from mlx_kvtrans import capture, load, load_translator
from mlx_kvtrans.sharding import shards_of

WORKER = Path(__file__).with_name("sharded_worker.py")


def run_sharded(tmp_path: Path, port: int, *args: str) -> list[dict]:
    launcher = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or "mlx.launch"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([launcher, "-n", "2", "--backend", "ring", "--starting-port",
                           str(port), "--", sys.executable, str(WORKER), *args[:4],
                           str(tmp_path), *args[4:]],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-1500:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow  # spawns processes through mlx.launch
@pytest.mark.parametrize("kind, source, target, translator, sink, sharded, port", [
    # every layer's heads split in two (qwen3-large's 2 KV heads: one each), both models
    ("tensor", "qwen3-small", "qwen3-large", "qwen3-small__qwen3-large-distilled", 0, "both",
     47611),
    # layers split in two: one process holds the GDN layers, the other the attention layers
    ("pipeline", "qwen3.5-a", "qwen3.5-b", "qwen3.5-a__qwen3.5-b", 4, "both", 47621),
    # MLA latents and indexer keys, each on the process that holds their layer
    ("pipeline", "qwen3.5-a", "dsa", "qwen3.5-a__dsa-distilled", 0, "target", 47631),
])
def test_sharded_models_translate_as_their_unsharded_twins(tmp_path, kind, source, target,
                                                           translator, sink, sharded, port):
    ranks = run_sharded(tmp_path, port, kind, source, target, translator, str(sink), sharded)
    held = [set(r["layers"]) for r in ranks]
    for rank in ranks:
        assert rank["kind"] == kind and rank["size"] == 2
        # its share of the installed caches is the whole install split the same way
        assert rank["cache_difference"] <= 1e-5
        assert rank["tokens_sharded"] == rank["tokens_whole"]
        assert rank["logit_difference"] <= 1e-3
        # a Session over them switches as over their twins: same tokens, same outcomes
        whole, split = rank["sessions"]["whole"], rank["sessions"]["sharded"]
        assert split == whole and split["switches"][0][0] == "applied"
    if kind == "tensor":
        assert held[0] == held[1]  # every process caches every layer, half its heads
    else:
        assert not held[0] & held[1] and held[0] | held[1] == set(range(len(held[0] | held[1])))


def test_a_translation_of_some_layers_is_those_layers_of_the_whole_translation():
    src, tgt = load("qwen3.5-a"), load("dsa")
    assert shards_of(tgt.model) is None  # held whole: translated as before
    tr = load_translator("qwen3.5-a__dsa-distilled", src, tgt)
    tokens = mx.array([[5, 9, 31, 7, 44, 12, 3, 8, 19, 23]])
    source = capture(src.model, tokens, points=tr.source_points())
    whole, points = tr.translate(source, tgt.model, token_ids=tokens)
    some, some_points = tr.translate(source, tgt.model, token_ids=tokens, layers=[1, 2])
    assert [bool(o) for o in some] == [i in (1, 2) for i in range(len(whole))]
    for i in (1, 2):
        assert some_points[i] == points[i]
        for name, value in some[i].items():
            assert mx.array_equal(value, whole[i][name]), (i, name)
