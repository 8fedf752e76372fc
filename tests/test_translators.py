"""Stage-1 translators: exact on a model translated to itself, every pair kind installs, the
artifact refuses tampering and wrong pairs."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_kvtrans as kv
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.models import input_embedding
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.translators.cross_tokenizer import aligned_text, translate_text
from mlx_kvtrans.training.fit import FitConfig, fit
from mlx_kvtrans.training.plan import plan, relative_depth
from mlx_kvtrans.translators.recipes import BuildInputs, RecipeError, recipe_from_json
from mlx_kvtrans.translators.recipes.state import bilinear_r2, fit_bilinear
from mlx_kvtrans.translators.token_identity import (build_codebook, confirm_ids, decode_ids,
                                                    first_duplicates)
from mlx_kvtrans.translators.translator import translate_cache
from mlx_kvtrans.tools.verify import max_abs_diff


def batches(n=6, length=48, seed=0):
    return [mx.random.randint(0, 259, (4, length), key=mx.random.key(seed + i)) for i in range(n)]


def continuation_kl(model, native, translated, tokens):
    p = nn.log_softmax(model(tokens, cache=native).astype(mx.float32), -1)
    q = nn.log_softmax(model(tokens, cache=translated).astype(mx.float32), -1)
    return float((mx.exp(p) * (p - q)).sum(-1).mean())


def self_translation_kl(model, specs, point, **kw):
    tr = fit(model, model, batches(), specs, FitConfig(point=point, ridge=1e-7, **kw))
    toks = mx.random.randint(0, 259, (1, 56), key=mx.random.key(99))
    native = kv.capture(model, toks[:, :48]).engine
    translated = translate_cache(tr, model, model, toks[:, :48])
    return tr, continuation_kl(model, native, translated, toks[:, 48:])


@pytest.mark.parametrize("family,point", [("qwen3", 3), ("qwen3", 1), ("deepseek_v3", 1),
                                          ("kimi_linear", 1), ("qwen3_5", 1),
                                          ("deepseek_v32", 1)])
def test_fitting_a_model_to_itself_is_exact(loaded, family, point):
    model = loaded(family).model
    layout = kv.layout_of(model)
    specs = plan(layout, layout, point=point, nu=1, features="all")
    tr, kl = self_translation_kl(model, specs, point)
    assert min(m["r2"] for m in tr.info["metrics"].values()) >= 0.999
    assert kl <= 1e-3


def test_bilinear_state_correction_recovers_a_known_map():
    rng = np.random.default_rng(0)
    H, Dv, Dk = 3, 8, 6
    A = np.eye(Dv) + 0.3 * rng.normal(size=(H, Dv, Dv))
    B = np.eye(Dk) + 0.3 * rng.normal(size=(H, Dk, Dk))
    S = rng.normal(size=(40, H, Dv, Dk))
    a, b = fit_bilinear(S, A @ S @ B, rounds=30, ridge=1e-9)
    assert np.abs(a @ S @ b - A @ S @ B).max() < 1e-4
    assert bilinear_r2(a, b, S, A @ S @ B) > 0.999999


def test_bilinear_self_translation_of_a_hybrid(loaded):
    model = loaded("qwen3_5").model
    layout = kv.layout_of(model)
    specs = plan(layout, layout, point=1, nu=1, recipes={"recurrent_state": "bilinear"},
                 features="all")
    assert {s.recipe for s in specs if s.name == "state"} == {"bilinear"}
    tr, kl = self_translation_kl(model, specs, 1)
    assert kl <= 1e-3


def test_relative_depth_assignment():
    assert relative_depth(8, 4, 0, 2) == (0, 1)
    assert relative_depth(8, 4, 3, 2) == (6, 7)
    assert relative_depth(4, 4, 2, 1) == (2,)
    picks = [relative_depth(27, 7, l, 1)[0] for l in range(7)]
    assert picks == sorted(picks) and picks[0] < 3 and picks[-1] > 23


PAIRS = [("qwen3", "llama"), ("kimi_linear", "kimi_vl"), ("kimi_vl", "kimi_linear"),
         ("qwen3_5", "qwen3_next"), ("qwen3_5", "deepseek_v32"), ("deepseek_v32", "qwen3")]


@pytest.mark.parametrize("source,target", PAIRS)
def test_translated_caches_install_and_continue(loaded, source, target):
    S, T = loaded(source).model, loaded(target).model
    specs = plan(kv.layout_of(S), kv.layout_of(T), point=1, nu=2)
    tr = fit(S, T, batches(3), specs, FitConfig(point=1))
    toks = mx.random.randint(0, 259, (1, 40), key=mx.random.key(5))
    cache = translate_cache(tr, S, T, toks)
    logits = T(toks[:, -1:] * 0 + 7, cache=cache)
    assert logits.shape == (1, 1, 259) and bool(mx.isfinite(logits).all())


def test_codebook_decodes_layer0_latents(loaded):
    model = loaded("kimi_vl").model
    book = build_codebook(model, 259)
    assert book.shape == (259, 32)
    toks = mx.random.randint(0, 259, (2, 30), key=mx.random.key(1))
    cap = kv.capture(model, toks, points=(2,))
    assert bool((decode_ids(cap.objects[0][("latent", 2)], book) == toks).all())


def test_known_ids_confirmed_against_the_cache_give_what_decoding_gives(loaded):
    """A switch knows the ids: checking each against its codebook row gives `decode_ids`'s
    answer, for ids the cache holds, for duplicated codebook rows (decoding's first of a tie)
    and for known ids that are wrong (decoded instead)."""
    model = loaded("kimi_vl").model
    rows = np.array(build_codebook(model, 259))
    rows[[200, 250]] = rows[17]  # ids 17, 200 and 250 now share one row
    book = mx.array(rows)
    first = first_duplicates(book)
    assert first[200].item() == 17 and first[250].item() == 17 and first[3].item() == 3
    toks = mx.random.randint(0, 259, (2, 40), key=mx.random.key(2))
    # ids 200 and 250 whose latents the model computes are no longer in the book: decoded
    toks = toks.at[0, :3].add(mx.array([200, 250, 17]) - toks[0, :3])
    latent = kv.capture(model, toks, points=(2,)).objects[0][("latent", 2)]
    latent = mx.concatenate([latent[:, :3], mx.broadcast_to(book[200], (2, 2, 32)),
                             latent[:, 5:]], axis=1)  # the duplicated row, at other ids
    wrong = toks.at[1, 5:9].add(1)  # ids the cache does not hold
    decoded = decode_ids(latent, book)
    assert decoded[0, 2:5].tolist() == [17] * 3 and 200 not in decoded[0, :2].tolist()
    for known in (toks, wrong):
        assert confirm_ids(latent, book, known, first).tolist() == decoded.tolist()


def test_token_identity_appends_the_target_embedding_and_codebook_equals_ids(loaded):
    """Token identity widens every map's input by the target's embedding width; a codebook that
    decodes every latent exactly gives the same features, so the same fit, as the true ids."""
    S, T = loaded("kimi_vl").model, loaded("kimi_linear").model
    specs = plan(kv.layout_of(S), kv.layout_of(T), point=1, nu=1)
    off = fit(S, T, batches(3), specs)
    ids = fit(S, T, batches(3), specs, FitConfig(token_identity="ids"))
    book = build_codebook(S, 259)
    decoded = fit(S, T, batches(3), specs, FitConfig(token_identity="codebook"), codebook=book)
    width = input_embedding(T).weight.shape[1]
    assert ids.params.keys() == off.params.keys() == decoded.params.keys()
    for key in (k for k in off.params if k.endswith(".weight")):
        assert ids.params[key].shape == (off.params[key].shape[0],
                                         off.params[key].shape[1] + width), key
    assert decoded.info["fit"]["codebook_decode_accuracy"] == 1.0
    for key in ids.params:
        assert mx.allclose(ids.params[key], decoded.params[key], atol=1e-5), key
    with pytest.raises(ValueError, match="not a function of the token alone"):
        build_codebook(loaded("kimi_linear").model, 259)  # its first MLA layer is not layer 0


@pytest.fixture
def saved_translator(model_dirs, tmp_path):
    src, tgt = kv.load(str(model_dirs("qwen3"))), kv.load(str(model_dirs("llama")))
    specs = plan(kv.layout_of(src.model), kv.layout_of(tgt.model), point=1, nu=2)
    tr = fit(src.model, tgt.model, batches(2), specs)
    return artifact.save(tr, tmp_path / "tr", src, tgt), src, tgt, tr


def test_artifact_round_trip(saved_translator):
    path, src, tgt, tr = saved_translator
    loaded_tr = artifact.load(path, src, tgt)
    toks = mx.random.randint(0, 259, (1, 20), key=mx.random.key(2))
    a = translate_cache(tr, src.model, tgt.model, toks)
    b = translate_cache(loaded_tr, src.model, tgt.model, toks)
    assert tr.params.keys() == loaded_tr.params.keys()
    assert all(mx.array_equal(tr.params[k], loaded_tr.params[k]) for k in tr.params)
    assert loaded_tr.recipes == tr.recipes
    assert mx.allclose(a[0].keys, b[0].keys, atol=1e-5)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["source"]["model_type"] == "qwen3" and manifest["target"]["model_type"] == "llama"
    assert manifest["fit"]["data_sha256"] and manifest["objects"][0]["sources"]


def test_random_features_of_some_layers_widen_only_their_maps(model_dirs, tmp_path):
    """`random_layers`: only those target layers' maps read the random features; the others
    are the linear fit's own maps exactly (they share no moments with the widened ones), and
    the saved translator translates as it was fitted (to float rounding: a loaded weight's
    layout may take another matmul kernel)."""
    src, tgt = kv.load(str(model_dirs("qwen3"))), kv.load(str(model_dirs("qwen3_next")))
    data = batches(3)
    top = len(kv.layout_of(tgt.model).layers) - 1
    linear = fit(src.model, tgt.model, data, config=FitConfig(point=1, features="all"))
    some = fit(src.model, tgt.model, data, config=FitConfig(
        point=1, features="all", random_features=16, random_layers=(top,)))
    for r in some.recipes:
        for key, value in some.params_of(r).items():
            if not key.endswith("weight"):
                continue
            base = linear.params_of(r)[key]
            widened = r.layer == top
            assert value.shape == (base.shape[0], base.shape[1] + 16 * widened), (r.key, key)
            if not widened:
                assert mx.allclose(value, base, atol=1e-5), (r.key, key)
    path = artifact.save(some, tmp_path / "some", src, tgt)
    # a version-2 reader would append the features to every map: a newer format says not to
    assert json.loads((path / "manifest.json").read_text())["format_version"] == 3
    again = artifact.load(path, src, tgt)
    toks = mx.random.randint(0, 259, (1, 24), key=mx.random.key(3))
    rec = kv.capture(src.model, toks, points=some.source_points())
    for (a, _), (b, _) in [(again.translate(rec, tgt.model), some.translate(rec, tgt.model))]:
        for x, y in zip(a, b):
            for name in x:
                pairs = (zip(x[name].arrays(), y[name].arrays()) if hasattr(x[name], "arrays")
                         else [(x[name], y[name])])
                assert all(mx.allclose(p, q, rtol=1e-5, atol=1e-6).item() for p, q in pairs), name
    assert again.flops(64, kv.layout_of(tgt.model)) < fit(
        src.model, tgt.model, data, config=FitConfig(point=1, features="all",
                                                     random_features=16)).flops(
        64, kv.layout_of(tgt.model))
    layouts = kv.layout_of(src.model), kv.layout_of(tgt.model)
    with pytest.raises(RecipeError, match="the target has"):
        FitConfig(point=1, random_features=16, random_layers=(top + 1,)).plan(*layouts)
    plain = FitConfig(point=1, features="all").plan(*layouts)
    assert FitConfig(point=1, features="all", random_layers=(top,)).plan(*layouts) == plain


def test_random_features_widen_every_map_and_fit_closer(model_dirs, tmp_path):
    """Random features append H columns to every map's input, drawn again (not stored) when
    the translator is loaded; fitted in closed form they fit the training data closer than
    the linear map (the same ridge over more columns); the fused translation equals each
    map built alone; a hybrid target's replay maps take them too."""
    from mlx_kvtrans.translators.random_features import RandomFeatures

    for source, target in (("qwen3", "llama"), ("qwen3", "qwen3_next")):
        src, tgt = kv.load(str(model_dirs(source))), kv.load(str(model_dirs(target)))
        data = batches(3)
        linear = fit(src.model, tgt.model, data, config=FitConfig(point=1, features="all"))
        wide = fit(src.model, tgt.model, data,
                   config=FitConfig(point=1, features="all", random_features=16))
        assert wide.expansion == RandomFeatures(16)
        for key in (k for k in linear.params if k.endswith("weight")):
            assert wide.params[key].shape == (linear.params[key].shape[0],
                                              linear.params[key].shape[1] + 16), key
        r2 = lambda t: [v["r2"] for v in t.info["metrics"].values()]  # noqa: E731
        assert all(w >= l - 1e-4 for w, l in zip(r2(wide), r2(linear)))
        assert sum(r2(wide)) > sum(r2(linear))
        path = artifact.save(wide, tmp_path / target, src, tgt)
        again = artifact.load(path, src, tgt)
        assert again.expansion == wide.expansion and "random_features" in json.loads(
            (path / "manifest.json").read_text())
        toks = mx.random.randint(0, 259, (1, 24), key=mx.random.key(3))
        rec = kv.capture(src.model, toks, points=wide.source_points())
        fused, _ = again.translate(rec, tgt.model)
        alone = {r: r.build(BuildInputs(rec, again.features(rec), None, 1,
                                        kv.layout_of(tgt.model).layers[r.layer].cache.object(
                                            r.name), False, None, again.expansion),
                            again.params_of(r)) for r in again.recipes}
        for r, built in alone.items():
            got = fused[r.layer][r.name]
            pairs = (zip(built.arrays(), got.arrays()) if hasattr(built, "arrays")
                     else [(built, got)])
            for a, b in pairs:
                assert mx.allclose(a, b, atol=1e-4), (r.layer, r.name)


def test_tampered_artifact_is_refused(saved_translator):
    path, src, tgt, _ = saved_translator
    weights = path / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(KvtransError, match="SHA256SUMS"):
        artifact.load(path, src, tgt)


def test_wrong_pair_is_refused(saved_translator, model_dirs):
    path, src, tgt, _ = saved_translator
    other = kv.load(str(model_dirs("qwen2")))
    with pytest.raises(KvtransError, match="different model"):
        artifact.load(path, other, tgt)
    with pytest.raises(KvtransError, match="different model"):
        artifact.load(path, src, other)


def test_cli_fit_then_fidelity_and_refusals(model_dirs, tmp_path):
    from typer.testing import CliRunner

    from mlx_kvtrans.cli.main import app

    runner = CliRunner()
    text = tmp_path / "text.txt"
    text.write_text("A short passage about ships, harbours and the weather at sea. " * 80)
    out = tmp_path / "tr"
    src, tgt = str(model_dirs("kimi_linear")), str(model_dirs("kimi_vl"))
    result = runner.invoke(app, ["fit", "--from", src, "--to", tgt, "--data", str(text),
                                 "--out", str(out), "--windows", "8", "--length", "48", "--json",
                                 "--gate-windows", "1"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["fit"]["tokens"] == 8 * 48
    # the recall options: needle windows weighted by their answers, tables, a residual
    recall = runner.invoke(app, ["fit", "--from", src, "--to", tgt, "--data", str(text),
                                 "--out", str(tmp_path / "recall"), "--windows", "8", "--length",
                                 "48", "--token-identity", "ids", "--needle-share", "0.5",
                                 "--attention-weighted", "4", "--identity-tables", "4",
                                 "--residual", "4", "--gate-windows", "1", "--json"])
    assert recall.exit_code == 0, recall.output
    manifest = json.loads((tmp_path / "recall" / "manifest.json").read_text())
    assert all(o["tables"] == 4 and o["residual"] == 4 for o in manifest["objects"]
               if o["recipe"] == "map")
    result = runner.invoke(app, ["eval", "fidelity", "--translator", str(out), "--text", str(text),
                                 "--prefix-lengths", "32", "--windows", "1", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)["rows"][0]
    assert 0 <= row["greedy_agreement"] <= 1 and row["kl"] >= 0
    # a wrong pair and a tampered artifact: one line, exit 2
    wrong = runner.invoke(app, ["eval", "fidelity", "--translator", str(out), "--text", str(text),
                                "--from", str(model_dirs("qwen3_5"))])
    assert wrong.exit_code == 2 and "different model" in wrong.output
    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered)
    with open(tampered / "weights.safetensors", "ab") as f:
        f.write(b"\0")
    result = runner.invoke(app, ["eval", "fidelity", "--translator", str(tampered), "--text",
                                 str(text)])
    assert result.exit_code == 2 and "SHA256SUMS" in result.output and "Traceback" not in result.output
    # models that tokenize differently: each reads its own tokens of the text; what the fit
    # cannot do across tokenizers yet is refused in one line
    other = tmp_path / "other_tok"
    shutil.copytree(model_dirs("qwen3"), other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] = "<|other|>"
    (other / "tokenizer.json").write_text(json.dumps(tok))
    across = ["fit", "--from", str(other), "--to", tgt, "--data", str(text), "--windows", "4",
              "--length", "48"]
    # the gate calibrated on a short held-out text: prefixes a 4-window fit can serve
    short = tmp_path / "held_out.txt"
    short.write_text("Rain fell on the harbour while the ferry waited for the tide. " * 5)
    result = runner.invoke(app, across + ["--out", str(tmp_path / "across"), "--needle-share",
                                          "0.5", "--attention-weighted", "4", "--pooling", "last",
                                          "--gate-windows", "2", "--validation", str(short),
                                          "--workdir", str(tmp_path / "across-sums")])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "across" / "manifest.json").read_text())
    assert manifest["alignment"]["pooling"] == "last" and manifest["gate"]["tail"] == 8
    # an evaluation gives the target its tokens of a text; the source reads its own
    result = runner.invoke(app, ["eval", "fidelity", "--translator", str(tmp_path / "across"),
                                 "--text", str(text), "--prefix-lengths", "32", "--windows", "1",
                                 "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["rows"][0]["kl"] >= 0
    src_lm, tgt_lm = kv.load(str(other)), kv.load(tgt)
    across_translator = kv.load_translator(tmp_path / "across", src_lm, tgt_lm)
    prompt = aligned_text(src_lm.tokenizer, tgt_lm.tokenizer, text.read_text()[:200], "last")
    cache = translate_text(across_translator, src_lm.model, tgt_lm.model, prompt)
    # the target's tokens of the text, given as ids, translate as the text does
    given_ids = kv.translate_cache(across_translator, src_lm.model, tgt_lm.model,
                                   prompt.target[0].tolist(), sink=0)
    for a, b in zip(cache, given_ids):
        assert all(mx.allclose(x, y, atol=1e-5).item() for x, y in zip(a.state, b.state)
                   if isinstance(x, mx.array))
    assert bool(mx.isfinite(tgt_lm.model(prompt.target[:, -1:], cache=cache)).all())
    with pytest.raises(kv.KvtransError, match="load it with both models"):
        kv.translate_cache(kv.load_translator(tmp_path / "across"), src_lm.model, tgt_lm.model,
                           prompt.target[0].tolist())
    with pytest.raises(ValueError, match="fitted on last"):  # pooled as it was fitted, or not at all
        translate_text(across_translator, src_lm.model, tgt_lm.model, aligned_text(
            src_lm.tokenizer, tgt_lm.tokenizer, text.read_text()[:200]))
    session = kv.Session({"a": src_lm, "b": tgt_lm}, {("a", "b"): across_translator})
    session.add_text(text.read_text()[:200])  # each model reads its own tokens of it
    list(session.generate(0))
    assert session.switch("b").gate in ("passed", "fired")  # translated, and judged
    for refused in (["--token-identity", "codebook"], ["--capture", "3"],
                    ["--recipe", "recurrent_state=copy"]):
        result = runner.invoke(app, across + ["--out", str(tmp_path / "x"), *refused])
        assert result.exit_code == 2 and "tokenize differently" in result.output, refused
    # windows of several lengths, and each target layer reading the source layer that fits it
    result = runner.invoke(app, across + ["--out", str(tmp_path / "mixed"), "--mix-lengths",
                                          "32,64", "--assign", "best", "--gate-windows", "1"])
    assert result.exit_code == 0, result.output
    mixed = kv.load_translator(tmp_path / "mixed", src_lm, tgt_lm)
    assert mixed.info["fit"]["mix"] == [32, 64]
    assert mixed.info["fit"]["assign"] == "best"


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_replay_from_predicted_inputs_is_exact_on_itself(loaded, family):
    """Read at (2), a layer's own recurrence inputs map to themselves; replaying them through
    the target's recurrence rebuilds its state."""
    model = loaded(family).model
    layout = kv.layout_of(model)
    specs = plan(layout, layout, point=2, nu=1, features="all",
                 recipes={"recurrent_state": "replay", "conv_history": "copy"})
    assert {s.recipe for s in specs if s.name == "state"} == {"replay"}
    tr, kl = self_translation_kl(model, specs, 2)
    assert kl <= 1e-3


def test_replay_is_the_default_when_the_source_has_no_state(loaded):
    S, T = loaded("kimi_vl").model, loaded("kimi_linear").model
    specs = plan(kv.layout_of(S), kv.layout_of(T))
    assert {s.recipe for s in specs if s.name == "state"} == {"replay"}
    tr = fit(S, T, batches(3), specs)
    toks = mx.random.randint(0, 259, (1, 40), key=mx.random.key(5))
    cache = translate_cache(tr, S, T, toks)
    state = cache[0][3]
    assert state.shape == (1, 2, 32, 32)  # the tiny kimi_linear: 2 heads of 32
    assert float(mx.abs(state).sum()) > 0  # replayed, not empty


def test_replay_through_the_convolution_is_planned_saved_and_refused_off_1(loaded):
    """`replay_convolve`: replay's k and v before the target's short convolution, which
    installing applies (its exactness: test_capture_install); a manifest keeps it; from
    features at (2), already convolved, it is refused."""
    S, T = loaded("kimi_vl").model, loaded("kimi_linear").model
    specs = FitConfig(replay_convolve=True).plan(kv.layout_of(S), kv.layout_of(T))
    replays = [s for s in specs if s.recipe == "replay"]
    assert replays and all(s.convolve for s in replays)
    assert not any(s.convolve for s in plan(kv.layout_of(S), kv.layout_of(T))
                   if s.recipe == "replay")
    tr = fit(S, T, batches(3), specs)
    saved = [recipe_from_json(json.loads(json.dumps(r.to_json()))) for r in tr.recipes]
    assert all(r.convolve for r in saved if r.recipe == "replay")
    cache = translate_cache(tr, S, T, mx.random.randint(0, 259, (1, 40), key=mx.random.key(5)))
    assert float(mx.abs(cache[0][3]).sum()) > 0
    with pytest.raises(RecipeError, match="features at"):
        FitConfig(point=2, replay_convolve=True).plan(kv.layout_of(S), kv.layout_of(T))


def test_best_single_fit_finds_the_same_layer_on_itself(loaded):
    from mlx_kvtrans.translators.recipes import assign_best_single

    model = loaded("qwen3").model
    layout = kv.layout_of(model)
    specs = plan(layout, layout, point=1, nu=2)
    best, scores = assign_best_single(model, model, batches(2), specs)
    for spec in best:
        assert spec.sources == (spec.layer,)
        assert scores[spec.layer][spec.layer] >= 0.999


def test_split_kv_and_per_object_capture_points(loaded):
    S, T = loaded("qwen3").model, loaded("llama").model
    specs = plan(kv.layout_of(S), kv.layout_of(T), point=1, nu=1, split_kv=True,
                 points={"token_value": 3})
    keys = [s for s in specs if s.name == "keys"]
    values = [s for s in specs if s.name == "values"]
    assert all(s.source_kinds == ("token_key",) and s.point == 1 for s in keys)
    assert all(s.source_kinds == ("token_value",) and s.point == 3 for s in values)
    tr = fit(S, T, batches(2), specs)
    assert tr.params["layer0.keys.weight"].shape == (2 * 16, 2 * 16)  # keys from keys alone
    toks = mx.random.randint(0, 259, (1, 30), key=mx.random.key(4))
    logits = T(toks[:, -1:], cache=translate_cache(tr, S, T, toks))
    assert bool(mx.isfinite(logits).all())
    # a hybrid's keys and values split too (its states have recipes of their own); an MLA's
    # latent is neither
    hybrid = plan(kv.layout_of(loaded("qwen3_5").model), kv.layout_of(T), split_kv=True)
    assert {s.source_kinds for s in hybrid} == {("token_key",), ("token_value",)}
    with pytest.raises(ValueError, match="split K/V"):
        plan(kv.layout_of(loaded("deepseek_v3").model), kv.layout_of(T), split_kv=True)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "qwen3_5"])
def test_attention_weights_match_the_models_attention(loaded, family):
    """The recorded weights are the continuation's real attention, checked against MLX's own
    attention kernel run with one-hot values (its output is then the attention matrix)."""
    import sys

    from mlx_kvtrans.training.attention_weights import recording_attention

    model = loaded(family).model
    layout = kv.layout_of(model)
    toks = mx.random.randint(0, 259, (2, 40), key=mx.random.key(8))
    attention_layers = [l.index for l in layout.layers if l.mixer not in ("gdn", "kda")]
    owner = sys.modules[type(model.layers[attention_layers[0]]["self_attn"]).__module__]
    calls = []
    original = owner.scaled_dot_product_attention

    def spy(queries, keys, values, cache=None, scale=1.0, mask=None, **kw):
        eye = mx.broadcast_to(mx.eye(keys.shape[2]), (*keys.shape[:2], keys.shape[2], keys.shape[2]))
        calls.append(mx.fast.scaled_dot_product_attention(queries, keys, eye, scale=scale,
                                                          mask=mask))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    owner.scaled_dot_product_attention = spy
    try:
        with recording_attention(model, layout, continuation=8) as found:
            model(toks)
    finally:
        owner.scaled_dot_product_attention = original
    assert sorted(found) == attention_layers and len(calls) == len(attention_layers)
    for layer, probs in zip(attention_layers, calls):
        expected = probs[:, :, -8:, :32].mean(axis=(1, 2))
        expected = expected / expected.mean(axis=-1, keepdims=True)
        assert max_abs_diff(found[layer], expected) <= 1e-4
    specs = plan(layout, layout, point=1, nu=1, features="all")
    tr = fit(model, model, batches(3), specs, FitConfig(ridge=1e-7, attention_weighted=8))
    assert min(m["r2"] for m in tr.info["metrics"].values()) >= 0.999


def test_headwise_maps_are_block_diagonal_and_exact_on_itself(loaded):
    model = loaded("qwen3").model
    layout = kv.layout_of(model)
    specs = plan(layout, layout, point=1, nu=2, split_kv=True, headwise=True)
    assert all(s.heads == 2 for s in specs)
    for identity in ("off", "ids"):
        tr = fit(model, model, batches(3), specs, FitConfig(ridge=1e-7, token_identity=identity))
        w = np.asarray(tr.params["layer1.keys.weight"])  # 2 heads x 16; sources: layers 0, 1
        assert np.all(w[:16, 16:32] == 0) and np.all(w[16:, 0:16] == 0)  # no head mixing
        assert min(m["r2"] for m in tr.info["metrics"].values()) >= 0.999
    with pytest.raises(ValueError):
        plan(layout, layout, headwise=True, features="attention")  # needs split K/V


def test_capture_3_reads_only_layers_with_per_token_objects(loaded):
    from mlx_kvtrans.training.plan import feature_layers

    S, T = loaded("kimi_linear").model, loaded("kimi_vl").model
    layout = kv.layout_of(S)
    assert feature_layers(layout, 3) == [3]  # KDA layers 0-2 hold only conv/state summaries
    assert feature_layers(layout, 1) == [0, 1, 2, 3]
    specs = plan(layout, kv.layout_of(T), point=3, nu=2)
    assert all(s.sources == (3,) for s in specs)
    tr = fit(S, T, batches(2), specs, FitConfig(point=3))
    toks = mx.random.randint(0, 259, (1, 30), key=mx.random.key(4))
    assert bool(mx.isfinite(T(toks[:, -1:], cache=translate_cache(tr, S, T, toks))).all())


@pytest.mark.parametrize("source,target,recipes", [
    ("kimi_linear", "kimi_vl", {}), ("qwen3_5", "qwen3_next", {"recurrent_state": "bilinear"}),
    ("kimi_vl", "qwen3_5", {}), ("qwen3_5", "deepseek_v32", {})])
def test_shaped_translator_has_the_fitted_shapes(loaded, source, target, recipes):
    """The bench's timing translator (random weights) is shaped exactly as a fitted one."""
    from mlx_kvtrans.timing import shaped_translator

    S, T = loaded(source).model, loaded(target).model
    specs = plan(kv.layout_of(S), kv.layout_of(T), point=1, nu=2, recipes=recipes)
    fitted = fit(S, T, batches(1), specs)
    shaped = shaped_translator(S, T, specs)
    assert {k: v.shape for k, v in shaped.params.items()} == \
        {k: v.shape for k, v in fitted.params.items()}
    assert [r.to_json() for r in shaped.recipes] == [r.to_json() for r in fitted.recipes]
    toks = mx.random.randint(0, 259, (1, 24), key=mx.random.key(3))
    logits = T(toks[:, -1:], cache=translate_cache(shaped, S, T, toks[:, :-1]))
    assert bool(mx.isfinite(logits).all())


def test_translation_flops_equal_a_hand_count(loaded):
    """2 x multiply-adds: each map over every token (a conv history over its K-1 rows), each
    replay input map over every token, each bilinear correction once per head."""
    from mlx_kvtrans.timing import translation_flops

    S, T = loaded("kimi_linear").model, loaded("qwen3_5").model
    layout = kv.layout_of(T)
    length = 100
    for recipes in ({}, {"recurrent_state": "replay"}):
        specs = plan(kv.layout_of(S), layout, point=1, nu=2, recipes=recipes)
        tr = fit(S, T, batches(1), specs)
        by_hand = 0.0
        for name, w in tr.params.items():
            layer, obj, *rest = name.split(".")
            target = layout.layers[int(layer.removeprefix("layer"))].cache.object(obj)
            if rest == ["weight"]:
                rows = (target.engine_shape[1] if target.kind == kv.layouts.ObjectKind.CONV_HISTORY
                        else length)
                by_hand += 2 * w.shape[0] * w.shape[1] * rows
            elif rest[-1] == "weight":  # replay: k, v, a, b input maps
                by_hand += 2 * w.shape[0] * w.shape[1] * length
        assert by_hand > 0
        assert translation_flops(tr, length, layout) == by_hand


def test_parameter_names_read_as_a_tree(loaded):
    """"layer<L>.<object>.<name>": `tree_flatten` / `tree_unflatten` and
    `nn.average_gradients` keep the translator's parameters as they are."""
    from mlx.utils import tree_flatten

    S, T = loaded("qwen3_5").model, loaded("qwen3_next").model
    tr = fit(S, T, batches(1), plan(kv.layout_of(S), kv.layout_of(T),
                                    recipes={"recurrent_state": "bilinear"}))
    tree = tr.parameters()
    assert all(not key[0].isdigit() for key in tree)
    assert dict(tree_flatten(tree)).keys() == tr.params.keys()
    averaged = dict(tree_flatten(nn.average_gradients(tree)))
    assert all(mx.array_equal(averaged[k], tr.params[k].astype(mx.float32)) for k in tr.params)


def test_a_hybrid_source_gives_every_map_all_its_attention_layers(loaded):
    """The paper's design: Kimi-Linear's maps read its MLA latents and rope keys (every MLA
    layer, one feature set for all maps), never its KDA conv rows, unless features "all"."""
    S, T = loaded("kimi_linear").model, loaded("kimi_vl").model
    source = kv.layout_of(S)
    mla = [l.index for l in source.layers if l.cache.mixer == "mla"]
    recipes = plan(source, kv.layout_of(T))
    assert {r.sources for r in recipes} == {tuple(mla)}
    tr = fit(S, T, batches(1), recipes)
    assert {name for (layer, name, point) in tr.reads(source)} == {"latent", "rope_key"}
    nearest = plan(source, kv.layout_of(T), features="all", nu=2)
    assert any(s not in mla for r in nearest for s in r.sources)


@pytest.mark.parametrize("source,target,recipes", [
    ("kimi_linear", "kimi_vl", {}), ("kimi_vl", "qwen3_5", {"recurrent_state": "replay"}),
    ("qwen3", "llama", {})])
def test_shared_moment_fitting_equals_per_map_fitting(loaded, source, target, recipes):
    S, T = loaded(source).model, loaded(target).model
    specs = plan(kv.layout_of(S), kv.layout_of(T), recipes=recipes, features="attention")
    shared = fit(S, T, batches(2), specs)
    alone = fit(S, T, batches(2), specs, FitConfig(share_moments=False))
    assert shared.info["fit"]["moments_bytes"] < alone.info["fit"]["moments_bytes"]
    assert shared.params.keys() == alone.params.keys()
    for key in shared.params:
        assert mx.allclose(shared.params[key], alone.params[key], atol=1e-4, rtol=1e-4), key


def test_compressed_features_at_full_width_reproduce_the_uncompressed_fit(loaded):
    """Principal directions at width = feature count are a rotation: the ridge fit (its
    penalty is rotation invariant) translates exactly as the uncompressed one."""
    S, T = loaded("qwen3_5").model, loaded("qwen3_next").model
    config = FitConfig(features="all", nu=1)
    plain = fit(S, T, batches(2), None, config)
    linear = [l.index for l in kv.layout_of(S).layers if l.cache.mixer == "gdn"]
    width = max(plain.features(kv.capture(S, batches(1)[0][:1, :8]))[(s, ())].shape[-1]
                for s in linear)
    full = fit(S, T, batches(2), None, FitConfig(features="all", nu=1, width=width))
    assert any(k.startswith("features.") for k in full.params)
    narrow = fit(S, T, batches(2), None, FitConfig(features="all", nu=1, width=8))
    assert all(v.shape[-1] == 8 for k, v in narrow.params.items() if k.startswith("features."))
    toks = mx.random.randint(0, 259, (1, 30), key=mx.random.key(6))
    a = T(toks[:, -1:], cache=translate_cache(plain, S, T, toks[:, :-1]))
    b = T(toks[:, -1:], cache=translate_cache(full, S, T, toks[:, :-1]))
    assert max_abs_diff(a, b) <= 1e-3 * float(mx.abs(a).max())


def test_needle_windows_end_with_the_answer():
    from mlx_kvtrans.training.fit import token_windows

    ids = list(range(1000))
    needles = [[7] * 90 + [1, 2, 3], [8] * 70 + [4, 5, 6]]
    rows = [r for b in token_windows(ids, 50, 8, batch=4, needles=needles, needle_share=0.5)
            for r in b.tolist()]
    assert len(rows) == 8 and all(len(r) == 50 for r in rows)
    ends = [r[-3:] for r in rows[::2]]
    assert ends == [[1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6]]
    assert all(r[0] == r[1] - 1 for r in rows[1::2])  # the others are corpus windows


@pytest.mark.parametrize("length", [2, 3, 40])
def test_a_conv_history_maps_only_the_rows_it_keeps(length, zoo):
    """A conv history keeps its last K-1 rows: its map reads only those (identity tables
    included, which read the token before the first), and they are the rows the map gives
    when it maps every token."""
    tr = artifact.load(artifact.resolve("qwen3.5-xt__qwen3.5-a-distilled"))
    assert any(r.tables for r in tr.recipes if r.name == "conv")
    src, tgt = zoo(tr.info["source"]["name"]), zoo(tr.info["target"]["name"])
    tokens = mx.random.randint(0, 3000, (1, length), key=mx.random.key(6))  # both vocabularies
    source = kv.capture(src.model, tokens, points=tr.source_points())
    kept, _ = tr.translate(source, tgt.model, token_ids=tokens)
    every, _ = tr.translate(source, tgt.model, token_ids=tokens, all_rows=True)
    for layer, objects in enumerate(kept):
        if "conv" in objects:
            rows = objects["conv"].shape[1]
            assert rows == min(length, kv.layout_of(tgt.model).layers[layer].cache.object(
                "conv").engine_shape[1])
            assert bool(mx.isfinite(objects["conv"]).all())
            assert max_abs_diff(objects["conv"], every[layer]["conv"][:, -rows:]) <= 1e-5


@pytest.mark.parametrize("name", ["kimi-linear__kimi-vl-distilled", "qwen3-small__qwen3-large-distilled"])
def test_fused_maps_equal_each_map_built_alone(name, zoo):
    """Maps of one input run as one matmul, identity tables and residuals included: the objects
    equal each recipe's own build, for each row of a batch."""
    tr = kv.load_translator(name)
    src, tgt = zoo(tr.info["source"]["name"]), zoo(tr.info["target"]["name"])
    tokens = mx.random.randint(0, 4000, (2, 40), key=mx.random.key(5))
    source = kv.capture(src.model, tokens, points=tr.source_points())
    layout = kv.layout_of(tgt.model)
    objects, _ = tr.translate(source, tgt.model, layout, tokens)
    alone, _ = tr.translate(source, tgt.model, layout, tokens, params=tr.params)
    assert any(r.added_terms(tr.params_of(r)) for r in tr.recipes)
    features = tr.features(source)
    ids = tr.identity.ids(source, tokens)
    identity = input_embedding(tgt.model)(ids).astype(mx.float32)
    for r in tr.recipes:
        inputs = BuildInputs(source, features, identity if r.reads_identity else None, 2,
                             layout.layers[r.layer].cache.object(r.name), False, ids)
        built = r.build(inputs, tr.params_of(r))
        assert objects[r.layer][r.name].shape == built.shape, r.key
        assert max_abs_diff(objects[r.layer][r.name], built) <= 1e-4, r.key
        assert max_abs_diff(alone[r.layer][r.name], built) <= 1e-4, r.key
    steps = []  # a benchmark's pauses between the steps change nothing
    lapped, _ = tr.translate(source, tgt.model, layout, tokens,
                             lap=lambda step, arrays: steps.append(step) or mx.eval(arrays))
    assert {"features", "matmul", "layout", "group matmul", "rest"} <= set(steps)
    for r in tr.recipes:
        assert mx.array_equal(lapped[r.layer][r.name], objects[r.layer][r.name]), r.key


def test_fit_reads_chat_logs_rendered_with_the_models_template(model_dirs, tmp_path):
    """A .jsonl chat log (OpenAI's messages format) is fitting data: each conversation rendered
    with the chat template; a line that is not one is named, exit 2."""
    from typer.testing import CliRunner

    from mlx_kvtrans.cli.main import app
    from mlx_kvtrans.tokens import conversations, encode_file

    log = tmp_path / "chats.jsonl"
    turns = [{"messages": [{"role": "user", "content": f"Where is ship {i}?"},
                           {"role": "assistant",
                            "content": [{"type": "text", "text": f"In harbour {i % 7}."}]}]}
             for i in range(120)]
    log.write_text("\n".join(json.dumps(t) for t in turns) + "\n")
    src = kv.load(str(model_dirs("kimi_linear")))
    ids = encode_file(src.tokenizer, log)
    first = src.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Where is ship 0?"},
         {"role": "assistant", "content": "In harbour 0."}], tokenize=True)
    assert ids[:len(first)] == list(first) and len(ids) > 120 * len(first) // 2
    base = ["fit", "--from", str(model_dirs("kimi_linear")), "--to", str(model_dirs("kimi_vl")),
            "--windows", "4", "--length", "48", "--gate-windows", "1", "--json"]
    runner = CliRunner()
    result = runner.invoke(app, base + ["--data", str(tmp_path), "--out", str(tmp_path / "tr")])
    assert result.exit_code == 0, result.output
    tool_call = {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Fair."}]}
    assert conversations(json.dumps(tool_call).encode(), log)[0][1][1]["tool_calls"]
    for line, why in (('{"messages": "not a list of turns"}', "not a conversation"),
                      ('{"messages": [{"role": "user", "content": ["no parts"]}]}',
                       "not a conversation")):
        log.write_text("\n".join(json.dumps(t) for t in turns) + "\n" + line + "\n")
        bad = runner.invoke(app, base + ["--data", str(log), "--out", str(tmp_path / "tr2")])
        assert bad.exit_code == 2 and f"chats.jsonl:121: {why}" in bad.output, bad.output
    held_out = runner.invoke(app, base + ["--data", str(log), "--validation", str(log),
                                          "--out", str(tmp_path / "tr2")])
    assert held_out.exit_code == 2 and "held-out text is a text file" in held_out.output


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "kimi_linear"])
def test_a_sink_read_natively_then_the_rest_translated_is_exact_on_itself(loaded, family):
    """`sink`: the target reads the first tokens itself and the translation of the rest is
    installed after them; on a model fitted to itself the cache still continues as native."""
    model = loaded(family).model
    layout = kv.layout_of(model)
    tr = fit(model, model, batches(), plan(layout, layout, point=1, nu=1, features="all"),
             FitConfig(point=1, ridge=1e-7))
    toks = mx.random.randint(0, 259, (1, 56), key=mx.random.key(99))
    for sink in (0, 4):
        native = kv.capture(model, toks[:, :48]).engine  # each continuation grows it
        translated = translate_cache(tr, model, model, toks[:, :48], sink=sink)
        assert continuation_kl(model, native, translated, toks[:, 48:]) <= 1e-3
