"""Every shipped translator loads (through the loader that migrates older formats) and gives the
held-out KL it gave when it was written (`data/shipped_translators_kl.json`, on fixed windows of
the shipped held-out filler text; `python tests/test_shipped_translators.py NAME ...` re-pins a
refitted one)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS (re-pinning runs this file as a script)
import mlx.core as mx
import numpy as np
import pytest

from mlx_kvtrans.translators.alignment import char_spans
from mlx_kvtrans.capture import capture
from mlx_kvtrans.evaluation.needles import FILLER_FILE
from mlx_kvtrans.models import weights_dir
from mlx_kvtrans.translators.cross_tokenizer import aligned_text, translate_text
from mlx_kvtrans.translators.fidelity import kl_per_token

GOLDEN = json.loads((Path(__file__).parent / "data" / "shipped_translators_kl.json").read_text())
SHIPPED = sorted(p.name for p in (weights_dir() / "translators").iterdir()
                 if (p / "manifest.json").exists())


def test_every_shipped_translator_is_pinned():
    assert SHIPPED == sorted(GOLDEN["kl"])


def test_weights_stay_within_their_budget():
    """Everything under weights/ (zoo models, corpus splits, translators) ships in the wheel
    and the repository: 64 MB at most."""
    total = sum(f.stat().st_size for f in weights_dir().rglob("*") if f.is_file())
    assert total <= 64 * 2**20, f"weights/ holds {total / 2**20:.1f} MiB"


def held_out_kl(name: str, load=kv.load) -> float:
    """The pinned measurement: mean KL over the three fixed windows."""
    manifest = json.loads((weights_dir() / "translators" / name / "manifest.json").read_text())
    src, tgt = load(manifest["source"]["name"]), load(manifest["target"]["name"])
    across = "alignment" in manifest  # the two models tokenize the text differently
    tr = kv.load_translator(weights_dir() / "translators" / name, src, tgt)
    text = FILLER_FILE.read_text()[:20000]
    ids, spans = char_spans(tgt.tokenizer, text)
    kls = []
    for start in (0, 1000, 2000):
        window = mx.array(ids[start:start + 160])[None]
        prefix, inputs = window[:, :128], window[:, 128:]
        native = tgt.model(inputs, cache=capture(tgt.model, prefix, points=(3,)).engine)
        if across:  # the source reads its own tokens of the prefix's text
            piece = aligned_text(src.tokenizer, tgt.tokenizer, text[spans[start][0]:],
                                 manifest["alignment"]["pooling"], target_tokens=128)
            assert np.array_equal(np.array(piece.target), np.array(prefix))
            cache = translate_text(tr, src.model, tgt.model, piece)
        else:
            cache = kv.translate_cache(tr, src.model, tgt.model, prefix)
        translated = tgt.model(inputs, cache=cache)
        kls.append(float(kl_per_token(native, translated).mean()))
    return sum(kls) / len(kls)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_translator_gives_its_recorded_held_out_kl(name, zoo, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRANS_CACHE", str(tmp_path))  # a codebook is built, not reused
    assert abs(held_out_kl(name, zoo) - GOLDEN["kl"][name]) < 1e-6


if __name__ == "__main__":  # re-pin translators that were refitted: python THIS_FILE NAME ...
    import sys

    for name in sys.argv[1:] or SHIPPED:
        if name not in SHIPPED:  # e.g. a stage 2 that did not improve on stage 1
            print(name, "is not shipped: its pin is dropped")
            continue
        GOLDEN["kl"][name] = held_out_kl(name)
        print(name, GOLDEN["kl"][name])
    GOLDEN["kl"] = {k: v for k, v in sorted(GOLDEN["kl"].items()) if k in SHIPPED}
    path = Path(__file__).parent / "data" / "shipped_translators_kl.json"
    path.write_text(json.dumps(GOLDEN, indent=2) + "\n")
