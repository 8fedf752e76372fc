"""`eval ablate`: each cache object zeroed (or translated) alone, against the native cache."""

import pytest

import mlx.core as mx

import mlx_kvtrans as kv
from mlx_kvtrans.evaluation.ablate import ablate
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.zoo.gates import reference_gate_init

TEXT = ("The lighthouse keeper counted the ships that passed each night and wrote their names in "
        "a book, and every morning he read the list again. ") * 30


def test_native_is_exact_and_each_zeroed_object_is_its_own_case(model_dirs):
    lm = kv.load(str(model_dirs("qwen3_5")))
    reference_gate_init(lm.model, mx.random.key(1))  # states that carry the context
    ids = lm.tokenizer.encode(TEXT)
    rows = {r["label"]: r["lengths"]["48"]
            for r in ablate(lm.model, lm.tokenizer.encode, ids, [48], windows=2, needles=2)}
    assert rows["native"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows["native"]["agreement"] == 1.0
    assert rows["no cache"]["kl"] > 1e-3
    layout = kv.layout_of(lm.model)
    states = [f"zero {l.index}.{o.name}" for l in layout.layers for o in l.objects
              if o.kind.value == "recurrent_state"]
    assert states and all(rows[s]["kl"] > 1e-5 for s in states)
    assert len({round(rows[s]["kl"], 9) for s in states}) == len(states)  # one layer each
    assert rows["zero all"]["kl"] >= max(rows[s]["kl"] for s in states) * 0.5
    chosen = {"no cache", states[0]}
    some = {r["label"]: r["lengths"]["48"] for r in ablate(
        lm.model, lm.tokenizer.encode, ids, [48], windows=2, needles=2, only=chosen)}
    assert set(some) == chosen and all(some[k] == rows[k] for k in chosen)


def test_only_one_object_translated():
    src, tgt = kv.load("kimi-linear"), kv.load("kimi-vl")
    translator = artifact.load(artifact.shipped("kimi-linear", "kimi-vl"), src, tgt)
    ids = tgt.tokenizer.encode(TEXT)
    rows = {r["label"]: r for r in ablate(tgt.model, tgt.tokenizer.encode, ids, [64], windows=1,
                                          needles=1, translator=translator, source=src.model)}
    translated = [k for k in rows if k.startswith("translated ")]
    assert len(translated) == sum(len(l.objects) for l in kv.layout_of(tgt.model).layers)
    assert all(rows[k]["lengths"]["64"]["kl"] > 0 for k in translated)
