"""`eval ablate`: each cache object zeroed (or translated) alone, against the native cache."""

import pytest

import mlx.core as mx

import mlx_kvtrans as kv
from mlx_kvtrans.evaluation.ablate import AblateConfig, Ablation, Case, ablate
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.zoo.gates import reference_gate_init
from test_gate import held_out, noise

TEXT = ("The lighthouse keeper counted the ships that passed each night and wrote their names in "
        "a book, and every morning he read the list again. ") * 30


def test_native_is_exact_and_each_zeroed_object_is_its_own_case(model_dirs):
    lm = kv.load(str(model_dirs("qwen3_5")))
    reference_gate_init(lm.model, mx.random.key(1))  # states that carry the context
    ids = lm.tokenizer.encode(TEXT)
    rows = {r["label"]: r["lengths"]["48"]
            for r in ablate(lm.model, lm.tokenizer.encode, ids, AblateConfig([48], 2, 2))}
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
        lm.model, lm.tokenizer.encode, ids, AblateConfig([48], 2, 2, only=chosen))}
    assert set(some) == chosen and all(some[k] == rows[k] for k in chosen)


def test_translated_cases_swap_in_exactly_what_they_name():
    src, tgt = kv.load("kimi-linear"), kv.load("kimi-vl")
    translator = artifact.load(artifact.shipped("kimi-linear", "kimi-vl"), src, tgt)
    layout = kv.layout_of(tgt.model)
    ids = tgt.tokenizer.encode(TEXT)
    rows = {r["label"]: r for r in ablate(tgt.model, tgt.tokenizer.encode, ids,
                                          AblateConfig([64], windows=1, needles=1),
                                          translator=translator, source=src.model)}
    assert rows["native"]["lengths"]["64"]["copy"] == pytest.approx(0.0, abs=1e-5)
    objects = [k for k in rows if k.startswith("translated ") and "." in k]
    assert len(objects) == sum(len(l.objects) for l in layout.layers)
    assert all(rows[k]["lengths"]["64"]["kl"] > 0 for k in objects)
    assert {f"translated layer {l.index}" for l in layout.layers} < set(rows)

    # every object translated is the translator's own cache; a layer's case swaps only it
    ablation = Ablation(tgt.model, translator, src.model)
    prefix, nxt = mx.array(ids[:63]), mx.array(ids[63:64])[None]
    every = tgt.model(nxt, cache=ablation.cache(Case("translated"), prefix))
    whole = tgt.model(nxt, cache=kv.translate_cache(translator, src.model, tgt.model, prefix))
    assert mx.abs(every - whole).max().item() < 1e-5
    one = ablation.cache(Case("translated", layer=1), prefix)
    native = ablation.cache(Case("native"), prefix)
    for i, (a, b) in enumerate(zip(one, native)):
        same = mx.array_equal(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :]).item()
        assert same == (i != 1)
    # from layer 2 up: the target's own first two layers, translated above them
    above = ablation.cache(Case("translated", above=2), prefix)
    moved_all = ablation.cache(Case("translated"), prefix)
    for i, (a, b, c) in enumerate(zip(above, native, moved_all)):
        same = mx.array_equal(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :]).item()
        moved = mx.array_equal(a.keys[..., :a.offset, :], c.keys[..., :c.offset, :]).item()
        assert (same, moved) == ((True, False) if i < 2 else (False, True))
    assert {f"translated from layer {k} up" for k in range(1, len(layout.layers))} < set(rows)


def test_zeroing_every_object_of_a_linear_attention_model_is_the_no_cache_floor(tmp_path):
    """States and conv histories carry no positions, so zeroing them all is reading nothing
    (zeroed attention objects keep their positions: no such identity there)."""
    from mlx_kvtrans.zoo.families import tiny_config
    from mlx_kvtrans.zoo.random_model import write_random_model
    from mlx_kvtrans.zoo.tokenizer import byte_tokenizer, special_token_ids

    tok = byte_tokenizer()
    config = {**tiny_config("qwen3_next", tok.get_vocab_size(), special_token_ids(tok)),
              "full_attention_interval": 64}  # every layer Gated DeltaNet
    lm = kv.load(str(write_random_model("qwen3_next", tmp_path / "linear", seed=5, config=config)))
    lm.model.model.fa_idx = None  # mlx-lm looks up an attention layer's cache even with none
    reference_gate_init(lm.model, mx.random.key(2))
    assert all(o.kind.value in ("conv_history", "recurrent_state")
               for layer in kv.layout_of(lm.model).layers for o in layer.objects)
    rows = {r["label"]: r["lengths"]["48"] for r in ablate(
        lm.model, lm.tokenizer.encode, lm.tokenizer.encode(TEXT),
        AblateConfig([48], windows=2, needles=2, only={"no cache", "zero all"}))}
    assert rows["no cache"]["kl"] > 1e-3
    assert rows["zero all"]["kl"] == pytest.approx(rows["no cache"]["kl"], rel=1e-4)
    assert rows["zero all"]["agreement"] == rows["no cache"]["agreement"]


def test_the_recovered_share_is_one_natively_and_falls_without_the_history():
    """The frontier's measure per case: the native cache predicts its own greedy continuation
    (1 but for ties), reading nothing recovers less than the last 16 tokens do (< 0), and one
    layer's zeroed keys lie between."""
    lm = kv.load("qwen3-large")
    rows = {r["label"]: r["lengths"]["64"]["recovered"] for r in ablate(
        lm.model, lm.tokenizer.encode, lm.tokenizer.encode(TEXT),
        AblateConfig([64], windows=2, needles=1, only={"native", "no cache", "zero 2.keys"}))}
    assert None not in rows.values()  # the floor does not already agree everywhere
    assert rows["native"] >= 0.9
    assert rows["no cache"] < 0.0
    assert rows["no cache"] < rows["zero 2.keys"] < rows["native"]


def test_the_copy_loss_sees_a_history_the_model_reads_worse_than_its_own():
    """The gate's copy probe per case: zero on the model's own cache, well above it where a
    noised translation's latents replace the history (the tail alone lets such a switch stand,
    `test_copy_probe`), and near it for the shipped translation."""
    src, tgt = kv.load("kimi-linear"), kv.load("kimi-vl")
    translator = artifact.load(artifact.shipped("kimi-linear", "kimi-vl"), src, tgt)
    ids = held_out(tgt.tokenizer, 600, 0)
    config = AblateConfig([240], windows=2, needles=1, only={"native", "translated all"})
    copies = {}
    for name, t in (("good", translator), ("noise", noise(translator, 10.0))):
        rows = ablate(tgt.model, tgt.tokenizer.encode, ids, config, translator=t,
                      source=src.model)
        copies[name] = {r["label"]: r["lengths"]["240"]["copy"] for r in rows}
    assert copies["good"]["native"] == pytest.approx(0.0, abs=1e-5)
    assert abs(copies["good"]["translated all"]) < 0.1 < 0.4 < copies["noise"]["translated all"]
