"""Stage-2 distillation: exact gradients through the frozen target, held-out KL goes down, a
resumed run is bit-identical, two processes match one."""

import json
import os
from dataclasses import replace
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlx_kvtrans as kv
from mlx_kvtrans.capture.instrument import chunked_recurrence
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.training.distill import DistillConfig, Distiller
from mlx_kvtrans.training.problem import Problem, ProblemConfig
from mlx_kvtrans.training.fit import FitConfig, fit
from mlx_kvtrans.training.plan import plan
from conftest import ring_port

TEXT = Path(__file__).parent / "data" / "corpus_sample.txt"


def tiny_translator(loaded, source, target, recipes=None, batches=2, length=48):
    S, T = loaded(source).model, loaded(target).model
    specs = plan(kv.layout_of(S), kv.layout_of(T), point=1, nu=2, recipes=recipes or {},
                 features="attention")
    data = [mx.random.randint(0, 259, (4, length), key=mx.random.key(i)) for i in range(batches)]
    return fit(S, T, data, specs, FitConfig(point=1)), S, T


@pytest.mark.parametrize("source,target,recipes,prefix,continuation", [
    ("qwen3", "llama", {}, 40, 8),
    ("qwen3_5", "qwen3_next", {"recurrent_state": "bilinear"}, 40, 8),  # state correction
    ("kimi_linear", "qwen3_5", {"recurrent_state": "replay"}, 40, 8),  # replay maps
    ("kimi_linear", "kimi_vl", {}, 40, 8),
    # DSA: a window no longer than index_topk keeps attention dense, so the loss (KL +
    # indexer rehearsal) is smooth and finite differences apply
    ("qwen3_5", "deepseek_v32", {}, 10, 4),
])
def test_gradient_matches_finite_differences(loaded, source, target, recipes, prefix,
                                             continuation):
    translator, S, T = tiny_translator(loaded, source, target, recipes)
    windows = mx.random.randint(0, 259, (2, prefix + continuation), key=mx.random.key(9))
    with chunked_recurrence():
        problem = Problem(translator, S, T, windows, prefix,
                          ProblemConfig(attention=True, outputs=True, objects=True))
        params = dict(tree_flatten(translator.parameters()))  # flat names: the loss takes either
        (total, (kl, rehearsal, attention, outputs, built)), _ = mx.value_and_grad(
            problem.loss)(params)
        assert float(total) > 0 and float(attention) > 0 and float(outputs) > 0
        assert float(built) > 0 and problem.rehearsed
        if target == "deepseek_v32":
            assert float(rehearsal) > 0
        keys = mx.random.split(mx.random.key(3), len(params))
        direction = {k: mx.random.normal(v.shape, key=key)
                     for key, (k, v) in zip(keys, params.items())}
        norm = sum(float((d * d).sum()) for d in direction.values()) ** 0.5
        eps = 1e-2 / norm
        # the output KL (+ indexer rehearsal), then the attention, output and object
        # rehearsals alone
        for which, loss in enumerate((lambda p: problem.loss(p)[0],
                     lambda p: problem.loss(p, 0.0, 1.0)[1][2],
                     lambda p: problem.loss(p, 0.0, 0.0, 1.0)[1][3],
                     lambda p: problem.loss(p, 0.0, 0.0, 0.0, 1.0)[1][4])):
            grads = mx.grad(loss)(params)
            assert set(grads) == set(params)

            # the object rehearsal is quadratic in the maps: a central difference is exact at
            # any step, and a small one only loses digits to cancellation
            step = eps * (100 if which == 3 else 1)

            def at(sign):
                return float(loss({k: params[k] + sign * step * direction[k] for k in params}))

            numeric = (at(1) - at(-1)) / (2 * step)
            analytic = sum(float((grads[k] * direction[k]).sum()) for k in params)
            assert abs(numeric - analytic) <= 0.02 * abs(analytic) + 1e-4, (numeric, analytic)


@pytest.mark.parametrize("family", ["qwen3", "kimi_vl", "kimi_linear"])
def test_recorded_attention_is_the_attention_the_model_computes(loaded, family):
    """Recomputed from what `scaled_dot_product_attention` is given (GQA, MLA's additive rope
    scores, the causal mask of queries reading a cache), the probabilities times the values are
    its output."""
    from mlx_kvtrans.capture.instrument import attention_module_name, observe_function
    from mlx_kvtrans.training.attention_weights import attention_probabilities
    from mlx_lm.models.base import scaled_dot_product_attention as sdpa
    from mlx_lm.models.cache import make_prompt_cache

    model = loaded(family).model
    cache = make_prompt_cache(model)
    model(mx.random.randint(0, 259, (1, 20), key=mx.random.key(1)), cache=cache)
    checked = []

    def observe(queries, keys, values, cache=None, scale=1.0, mask=None, **kw):
        probs = attention_probabilities(queries, keys, scale, mask)
        expected = sdpa(queries, keys, values, cache=None, scale=scale, mask=mask)
        values = mx.repeat(values, probs.shape[1] // values.shape[1], axis=1)
        checked.append(float(mx.abs(probs @ values.astype(mx.float32) - expected).max()))

    name = next(n for n in map(attention_module_name, model.layers) if n)
    with observe_function(name, "scaled_dot_product_attention", observe):
        model(mx.random.randint(0, 259, (1, 6), key=mx.random.key(2)), cache=cache)
    assert checked and max(checked) < 1e-4, checked


def test_attention_rehearsal_is_zero_for_the_native_cache_and_positive_otherwise(loaded):
    from mlx_kvtrans.training.rehearsal import attention_rehearsal

    translator, S, T = tiny_translator(loaded, "qwen3", "llama")
    windows = mx.random.randint(0, 259, (2, 40), key=mx.random.key(4))
    problem = Problem(translator, S, T, windows, 32, ProblemConfig(attention=True))
    assert len(problem.native_attention) == len(T.layers)
    assert float(attention_rehearsal(problem.native_attention, problem.native_attention)) \
        == pytest.approx(0.0, abs=1e-6)
    _, (_, _, attention, _, _) = problem.loss(translator.params, attention_weight=1.0)
    assert float(attention) > 1e-4


@pytest.mark.parametrize("source,target", [("qwen3", "llama"), ("qwen3_5", "kimi_linear")])
def test_output_rehearsal_is_zero_for_the_native_cache_and_positive_otherwise(loaded, source,
                                                                              target):
    """Every layer's mixer is recorded, linear attention too; the native cache reproduces the
    native outputs (the rehearsal is 0) and a translated one does not."""
    from mlx_kvtrans.capture import capture
    from mlx_kvtrans.layouts import CapturePoint
    from mlx_kvtrans.training.rehearsal import output_rehearsal, recording_mixer_outputs

    translator, S, T = tiny_translator(loaded, source, target)
    windows = mx.random.randint(0, 259, (2, 40), key=mx.random.key(4))
    with chunked_recurrence():
        problem = Problem(translator, S, T, windows, 32, ProblemConfig(outputs=True))
        assert len(problem.native_outputs) == len(T.layers)
        assert all(o.shape == (2, 8, T.args.hidden_size) for o in problem.native_outputs)
        native = capture(T, windows[:, :32], points=(CapturePoint.ENGINE,)).engine
        with recording_mixer_outputs(T) as again:
            T(windows[:, 32:], cache=native)
        assert float(output_rehearsal(problem.native_outputs, again)) < 1e-8
        _, (_, _, _, outputs, _) = problem.loss(translator.params, output_weight=1.0)
    assert float(outputs) > 1e-4


@pytest.mark.parametrize("family", ["kimi_linear", "deepseek_v32"])
def test_greedy_continuation_is_what_the_target_says(loaded, family):
    """Sequence level: the continuation is the window's first token, then the target's own
    argmax at every step reading its native cache; the native logits are taken on it."""
    translator, S, T = tiny_translator(loaded, "qwen3_5", family)
    windows = mx.random.randint(0, 259, (2, 30), key=mx.random.key(5))
    problem = Problem(translator, S, T, windows, 22, ProblemConfig(greedy=True))
    assert problem.inputs.shape == (2, 8)
    assert mx.array_equal(problem.inputs[:, 0], windows[:, 22])
    assert mx.array_equal(problem.inputs[:, 1:], mx.argmax(problem.native_logits[:, :-1], -1))
    assert not mx.array_equal(problem.inputs, windows[:, 22:])


@pytest.mark.parametrize("family", ["qwen3", "kimi_linear", "deepseek_v32"])
def test_reread_tail_is_read_natively_and_not_scored(loaded, family):
    """With R = reread, the translator builds the first prefix - R tokens and the target reads
    the rest itself: a translator of an attention model to itself has next to no loss at any R
    (a misplaced tail would read at wrong positions), a cross-model one less loss the more the
    target reads (its tail repairs the translation)."""
    windows = mx.random.randint(0, 259, (2, 40), key=mx.random.key(6))
    if family == "qwen3":
        exact, S, _ = tiny_translator(loaded, family, family)
        for reread in (0, 8):
            problem = Problem(exact, S, S, windows, 32, ProblemConfig(reread=reread))
            assert problem.translated_ids.shape[1] == 32 - reread
            assert float(problem.loss(exact.params)[1][0]) < 1e-3
    translator, S, T = tiny_translator(loaded, "qwen3_5", family)
    losses = [float(Problem(translator, S, T, windows, 32, ProblemConfig(reread=r))
                    .loss(translator.params)[0])
              for r in (0, 8, 31)]
    assert losses[0] > losses[1] > losses[2] > 0, losses


@pytest.mark.parametrize("source, target", [("qwen3", "llama"), ("kimi_linear", "kimi_vl")])
def test_a_sink_is_read_natively_and_the_loss_is_what_a_switch_with_it_gives(loaded, source,
                                                                              target):
    """With S = sink, the target reads the prefix's first S tokens itself and the translator
    builds the rest: the loss is the KL of the target continuing from `translate_cache(...,
    sink=S)`, and its gradient is exact (finite differences)."""
    from mlx_kvtrans.translators.fidelity import kl_per_token

    translator, S, T = tiny_translator(loaded, source, target)
    windows = mx.random.randint(0, 259, (2, 40), key=mx.random.key(8))
    with chunked_recurrence():
        problem = Problem(translator, S, T, windows, 32, ProblemConfig(sink=4))
        assert problem.translated_ids.shape[1] == 28
        kl = float(problem.loss(translator.params)[1][0])
        switched = []
        for row in range(2):
            cache = kv.translate_cache(translator, S, T, windows[row, :32], sink=4)
            logits = T(windows[row:row + 1, 32:], cache=cache)
            switched.append(kl_per_token(problem.native_logits[row:row + 1], logits).mean())
        assert abs(kl - float(mx.stack(switched).mean())) <= 1e-4 * max(kl, 1.0), kl
        params = dict(tree_flatten(translator.parameters()))
        grads = mx.grad(lambda p: problem.loss(p)[0])(params)
        direction = {k: mx.random.normal(v.shape, key=mx.random.key(i))
                     for i, (k, v) in enumerate(params.items())}
        eps = 1e-2 / sum(float((d * d).sum()) for d in direction.values()) ** 0.5

        def at(sign):
            return float(problem.loss({k: params[k] + sign * eps * direction[k]
                                       for k in params})[0])

        numeric = (at(1) - at(-1)) / (2 * eps)
        analytic = sum(float((grads[k] * direction[k]).sum()) for k in params)
        assert abs(analytic) > 1e-3  # a gradient there is
        assert abs(numeric - analytic) <= 0.02 * abs(analytic) + 1e-4, (numeric, analytic)


def ids_of(loaded, family):
    return loaded(family).tokenizer.encode(TEXT.read_text())


CONFIG = DistillConfig(steps=30, lr=3e-3, warmup=3, batch=4, min_prefix=24, max_prefix=48,
                       continuation=16, validate_every=10, validation_windows=8)


def test_short_distillation_lowers_held_out_kl(loaded, tmp_path):
    # fitted on one batch of random tokens: a poor closed form, room to improve
    translator, S, T = tiny_translator(loaded, "kimi_linear", "kimi_vl", batches=1, length=40)
    ids = ids_of(loaded, "kimi_vl")
    d = Distiller(translator, S, T, ids[:15000], ids[15000:], CONFIG, tmp_path / "run")
    summary = d.run()
    assert summary["steps"] == 30
    assert summary["validation_kl_after"] < 0.8 * summary["validation_kl_before"], summary
    # the distilled translator installs and continues, with parameters of the stage-1 dtypes
    distilled = d.distilled()
    assert all(distilled.params[k].dtype == translator.params[k].dtype for k in translator.params)
    assert d.validate(distilled.parameters()) == pytest.approx(summary["validation_kl_after"],
                                                             rel=1e-4)


def test_resume_continues_bit_identically(loaded, tmp_path):
    translator, S, T = tiny_translator(loaded, "qwen3_5", "qwen3_next",
                                       {"recurrent_state": "bilinear"})
    ids = ids_of(loaded, "qwen3_5")
    config = DistillConfig(steps=6, lr=1e-3, warmup=2, batch=2, min_prefix=16, max_prefix=32,
                           continuation=8, validate_every=3, validation_windows=2)
    straight = Distiller(translator, S, T, ids[:15000], ids[15000:], config, tmp_path / "a")
    straight.run()
    first = Distiller(translator, S, T, ids[:15000], ids[15000:], config, tmp_path / "b")
    first.run(max_minutes=1e-9)  # stops (and checkpoints) after its first step
    assert first.state["step"] == 1
    # written whole, then renamed: no file of a save is left half-way
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        "optimizer.safetensors", "params.safetensors", "state.json"]
    second = Distiller(translator, S, T, ids[:15000], ids[15000:], config, tmp_path / "b")
    assert second.resume() and second.state["step"] == 1
    second.run()
    resumed = dict(tree_flatten(second.params))
    for k, v in tree_flatten(straight.params):
        assert mx.array_equal(v, resumed[k]), k
    assert [r["loss"] for r in straight.state["history"]] == \
        [r["loss"] for r in second.state["history"]]
    other = DistillConfig(**{**config.__dict__, "lr": 5e-4})
    with pytest.raises(Exception, match="other settings"):
        Distiller(translator, S, T, ids, ids, other, tmp_path / "b").resume()
    refitted = replace(translator, params={k: v * 1.01 for k, v in translator.params.items()})
    with pytest.raises(Exception, match="another translator"):
        Distiller(refitted, S, T, ids, ids, config, tmp_path / "b").resume()


def run_cli(args, env=None, launcher=()):
    return subprocess.run([*launcher, sys.executable, "-m", "mlx_kvtrans.cli", *args],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow  # spawns subprocesses through mlx.launch
def test_two_processes_match_one(model_dirs, tmp_path):
    """`mlx.launch -n 2 --backend ring`: each process takes half of the same global batch."""
    src, tgt = kv.load(str(model_dirs("qwen3"))), kv.load(str(model_dirs("llama")))
    specs = plan(kv.layout_of(src.model), kv.layout_of(tgt.model), point=1, nu=2)
    data = [mx.random.randint(0, 259, (4, 40), key=mx.random.key(0))]
    path = artifact.save(fit(src.model, tgt.model, data, specs), tmp_path / "tr", src, tgt)
    common = ["distill", "--translator", str(path), "--data", str(TEXT), "--validation",
              str(TEXT), "--steps", "6", "--batch", "4", "--lr", "1e-3", "--warmup", "2",
              "--min-prefix", "16", "--max-prefix", "32", "--continuation", "8",
              "--validate-every", "3", "--validation-windows", "4", "--gate-windows", "1",
              "--json"]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    one = run_cli([*common, "--workdir", str(tmp_path / "w1"), "--out", str(tmp_path / "o1")],
                  env)
    assert one.returncode == 0, one.stderr
    again = run_cli([*common, "--workdir", str(tmp_path / "w1"), "--out", str(tmp_path / "o1")],
                    env)  # a checkpoint is there: refused unless --resume
    assert again.returncode == 2 and "--resume" in again.stderr and "Traceback" not in again.stderr
    launcher = (shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or "mlx.launch",
                "-n", "2", "--backend", "ring", "--starting-port", str(ring_port()), "--")
    two = run_cli([*common, "--workdir", str(tmp_path / "w2"), "--out", str(tmp_path / "o2")],
                  env, launcher)
    assert two.returncode == 0, two.stderr + two.stdout
    curves = []
    for out in ("o1", "o2"):
        manifest = json.loads((tmp_path / out / "manifest.json").read_text())
        assert manifest["stage"] == 2
        curves.append(manifest["distill"])
    assert curves[0]["processes"] == 1 and curves[1]["processes"] == 2
    for a, b in zip(curves[0]["curve"], curves[1]["curve"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    assert curves[0]["validation_kl_after"] == pytest.approx(curves[1]["validation_kl_after"],
                                                             rel=1e-4)


def test_indexer_selection_is_exact_on_itself(loaded):
    from mlx_kvtrans.translators.fidelity import indexer_selection

    T = loaded("deepseek_v32").model
    specs = plan(kv.layout_of(T), kv.layout_of(T), point=3, nu=1)
    data = [mx.random.randint(0, 259, (4, 64), key=mx.random.key(i)) for i in range(4)]
    translator = fit(T, T, data, specs, FitConfig(point=3, ridge=1e-7))
    prompts = [mx.random.randint(0, 259, (60,), key=mx.random.key(50 + i)).tolist()
               for i in range(3)]
    needles = [[10, 11, 12]] * 3
    result = indexer_selection(translator, T, T, prompts, needles)
    assert result["index_topk"] < 59 and result["selection_overlap"] == 1.0
    assert result["needle_selected_translated"] == result["needle_selected_native"]


def test_needle_rows_end_with_question_and_answer():
    """A needle share of the batch: rows that end with the code, drawn the same way each time."""
    from mlx_kvtrans.evaluation import tasks
    from mlx_kvtrans.evaluation.needles import NEEDLE_SEED, needle_rows
    from mlx_kvtrans.training.distill import draw_windows
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_kvtrans.models import weights_dir

    tok = load_tokenizer(weights_dir() / "tokenizer")
    config = DistillConfig(batch=4, min_prefix=40, max_prefix=60, continuation=16,
                           needle_share=0.5)
    needles = needle_rows(tok.encode, [], 76, count=20)
    corpus = tok.encode(TEXT.read_text())
    windows, prefix = draw_windows(corpus, 3, config, needles)
    again, _ = draw_windows(corpus, 3, config, needles)
    assert windows.shape == (4, prefix + 16) and (windows == again).all()
    tails = {tuple(r[-(prefix + 16):]) for r in needles}
    rows = [tuple(r) for r in windows.tolist()]
    assert [r in tails for r in rows] == [False, False, True, True]
    codes = {tasks.needle(NEEDLE_SEED + i, filler=[]).meta["code"] for i in range(20)}
    assert all(tok.decode(list(r[-7:-1])) in codes for r in rows[2:])


def test_chat_needle_rows_are_chat_turns_that_end_with_the_answer():
    """`--needle-form chat`: the rows are conversations in the target's chat template, at least
    the span a step takes, the question in the last user turn and the six-digit answer last;
    the default form leaves earlier checkpoints' fingerprints as they were."""
    from mlx_kvtrans.training.workflows import chat_training_needles
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_kvtrans.models import weights_dir

    tok = load_tokenizer(weights_dir() / "tokenizer")
    rows = chat_training_needles(tok, [TEXT.read_text()], 120, count=6)
    opening = tok.apply_chat_template([{"role": "user", "content": "x"}],
                                      tokenize=False).split("x")[0]
    assert len(rows) == 6 and all(len(r) >= 120 for r in rows)
    for row in rows:
        text = tok.decode(row)
        assert text.startswith(opening) and "What was the number for" in text
        assert text.rstrip(".")[-6:].isdigit()
    assert DistillConfig(needle_form="text").fingerprint() == DistillConfig().fingerprint()
    assert DistillConfig(needle_form="chat").fingerprint() != DistillConfig().fingerprint()
    with pytest.raises(KvtransError, match="--needle-form"):
        DistillConfig(needle_form="html")


def test_residual_nonlinearity_starts_at_zero_and_distils(loaded):
    """A map's residual term leaves the closed form exactly as it was; stage 2's gradient
    reaches it."""
    S, T = loaded("qwen3").model, loaded("llama").model
    data = [mx.random.randint(0, 259, (4, 48), key=mx.random.key(i)) for i in range(2)]
    plain = fit(S, T, data, config=FitConfig(point=1))
    with_residual = fit(S, T, data, config=FitConfig(point=1, residual=8))
    tokens = mx.random.randint(0, 259, (1, 30), key=mx.random.key(5))
    a = kv.translate_cache(plain, S, T, tokens)[1].keys[..., :30, :]
    b = kv.translate_cache(with_residual, S, T, tokens)[1].keys[..., :30, :]
    assert mx.allclose(a, b, atol=1e-5)  # (the fused and unfused matmuls round apart)
    windows = mx.random.randint(0, 259, (2, 40), key=mx.random.key(6))
    problem = Problem(with_residual, S, T, windows, 32)
    grads = dict(tree_flatten(mx.grad(lambda p: problem.loss(p)[0])(with_residual.parameters())))
    down = [k for k in grads if k.endswith("residual.down")]
    assert down and all(float(mx.abs(grads[k]).sum()) > 0 for k in down)


def test_train_only_moves_the_parameters_named_and_no_other(loaded, tmp_path):
    S, T = loaded("qwen3").model, loaded("llama").model
    data = [mx.random.randint(0, 259, (4, 48), key=mx.random.key(i)) for i in range(2)]
    translator = fit(S, T, data, config=FitConfig(point=1, residual=8))
    ids = ids_of(loaded, "llama")
    config = DistillConfig(steps=3, lr=1e-3, warmup=1, batch=2, min_prefix=16, max_prefix=32,
                           continuation=8, validate_every=3, validation_windows=2,
                           train_only="residual")
    run = Distiller(translator, S, T, ids[:15000], ids[15000:], config, tmp_path / "run")
    run.run()
    after = run.distilled().params
    moved = {k for k in after if not mx.array_equal(after[k], translator.params[k])}
    assert moved and all("residual" in k for k in moved), moved
    with pytest.raises(KvtransError, match="--train-only tables"):
        Distiller(translator, S, T, ids, ids, replace(config, train_only="tables"),
                  tmp_path / "other")


def test_auto_trains_every_parameter_unless_the_first_validation_is_worse_then_the_biases(
        loaded, tmp_path, monkeypatch):
    """`train_only` auto (the default): every parameter moves while the held-out KL falls; where
    the first validation is above the start's, the run starts again from the closed form with
    the biases alone, records why, and a resumed run keeps that choice."""
    translator, S, T = tiny_translator(loaded, "qwen3", "llama")
    ids = ids_of(loaded, "llama")
    config = DistillConfig(steps=4, lr=1e-3, warmup=1, batch=2, min_prefix=16, max_prefix=32,
                           continuation=8, validate_every=2, validation_windows=2)
    assert config.train_only == "auto"
    falling = iter([1.0 - i / 100 for i in range(100)])
    monkeypatch.setattr(Distiller, "validate", lambda self, params=None: next(falling))
    steady = Distiller(translator, S, T, ids[:15000], ids[15000:], config, tmp_path / "a")
    summary = steady.run()
    assert summary["trained"] == "all" and "probe" not in summary
    after = steady.distilled().params
    assert any("bias" not in k and not mx.array_equal(v, translator.params[k])
               for k, v in after.items())
    rising = iter(range(100))
    monkeypatch.setattr(Distiller, "validate", lambda self, params=None: float(next(rising)))
    run = Distiller(translator, S, T, ids[:15000], ids[15000:], config, tmp_path / "b")
    summary = run.run()
    assert summary["trained"] == "bias" and summary["steps"] == 4
    assert [r["step"] for r in summary["probe"]] == [1, 2]  # what every parameter did
    assert [r["step"] for r in summary["curve"]] == [1, 2, 3, 4]  # from the start again
    moved = {k for k, v in run.distilled().params.items()
             if not mx.array_equal(v, translator.params[k])}
    assert moved and all("bias" in k for k in moved), moved
    resumed = Distiller(translator, S, T, ids[:15000], ids[15000:], config, tmp_path / "b")
    assert resumed.resume() and resumed.frozen == run.frozen and resumed.frozen
    # a checkpoint of every parameter, as runs before auto wrote them, resumes under auto
    earlier = Distiller(translator, S, T, ids[:15000], ids[15000:],
                        replace(config, train_only=""), tmp_path / "c")
    earlier.run(max_minutes=1e-9)
    state = tmp_path / "c" / "state.json"
    state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items()
                                 if k != "trained"}))
    later = Distiller(translator, S, T, ids[:15000], ids[15000:], config, tmp_path / "c")
    assert later.resume() and later.state["trained"] == "" and not later.frozen


def test_keep_best_returns_the_lowest_validated_parameters_and_resumes_them(loaded, tmp_path,
                                                                           monkeypatch):
    """`keep` best: the parameters of the lowest validation KL measured, the start's included
    (a run whose KL only rises leaves the start's), kept through a checkpoint and a resume; a
    finished run resumed with `keep` best writes those without training again."""
    translator, S, T = tiny_translator(loaded, "qwen3", "llama")
    ids = ids_of(loaded, "llama")
    config = DistillConfig(steps=6, lr=1e-3, warmup=1, batch=2, min_prefix=16, max_prefix=32,
                           continuation=8, validate_every=2, validation_windows=2, keep="best")
    run = Distiller(translator, S, T, ids[:15000], ids[15000:], config, tmp_path / "a")
    summary = run.run()
    measured = [summary["validation_kl_before"]] + [
        r["validation_kl"] for r in summary["curve"] if "validation_kl" in r]
    assert summary["best"]["validation_kl"] == min(measured)
    assert run.validate(run.distilled().parameters()) == pytest.approx(min(measured), rel=1e-4)
    first = Distiller(translator, S, T, ids[:15000], ids[15000:], config, tmp_path / "b")
    first.run(max_minutes=1e-9)
    second = Distiller(translator, S, T, ids[:15000], ids[15000:], config, tmp_path / "b")
    second.resume()
    assert second.run()["best"] == summary["best"]
    kept, resumed = (dict(tree_flatten(d.kept_params())) for d in (run, second))
    assert all(mx.array_equal(v, resumed[k]) for k, v in kept.items())
    last = Distiller(translator, S, T, ids[:15000], ids[15000:], replace(config, keep="last"),
                     tmp_path / "a")
    assert last.resume() and last.run()["steps"] == 6  # finished: nothing runs again
    assert all(mx.array_equal(v, dict(tree_flatten(last.params))[k])
               for k, v in tree_flatten(run.params))
    rising = iter(range(100))
    monkeypatch.setattr(Distiller, "validate", lambda self, params=None: float(next(rising)))
    wild = Distiller(translator, S, T, ids[:15000], ids[15000:], config, tmp_path / "c")
    assert wild.run()["best"]["step"] == 0
    assert all(mx.array_equal(v, translator.params[k])
               for k, v in wild.distilled().params.items())
    with pytest.raises(KvtransError, match="--keep"):
        replace(config, keep="first")


def test_the_residual_nonlinearity_is_gelu_with_finite_gradients():
    """The residual's gelu (erf by a polynomial off a GPU, where MLX's erf is slow) is
    nn.gelu to within 1e-6 of max(1, |x|), and its gradient is finite everywhere."""
    import mlx.nn as nn

    from mlx_kvtrans.translators.recipes.base import gelu

    x = mx.concatenate([mx.linspace(-40, 40, 80001), mx.array([0.0, 1e-8, -1e-8, 1e30])])
    assert float((mx.abs(gelu(x) - nn.gelu(x)) / mx.maximum(1, mx.abs(x))).max()) <= 1e-6
    grad, ref = (mx.grad(lambda v, f=f: f(v).sum())(x[:-1]) for f in (gelu, nn.gelu))
    assert bool(mx.isfinite(grad).all()) and float(mx.abs(grad - ref).max()) <= 1e-5


def test_object_rehearsal_reads_the_targets_own_objects_of_the_translated_span(loaded):
    """Its targets are the target's own per-token objects at each map's capture point, over the
    tokens translated (not the re-read tail); a perfect translation of them scores 0."""
    from mlx_kvtrans.capture import capture
    from mlx_kvtrans.training.rehearsal import object_rehearsal

    translator, S, T = tiny_translator(loaded, "qwen3", "llama")
    windows = mx.random.randint(0, 259, (2, 40), key=mx.random.key(5))
    problem = Problem(translator, S, T, windows, 32, ProblemConfig(reread=4, objects=True))
    assert len(problem.rehearsed) == len(translator.recipes)
    own = capture(T, windows[:, :28], points=(1,))
    for (layer, name), native in zip(problem.rehearsed, problem.native_objects):
        assert native.shape[1] == 28
        assert mx.allclose(native, own.objects[layer][(name, 1)].astype(mx.float32))
    assert float(object_rehearsal(problem.native_objects, problem.native_objects)) == 0.0
    _, parts = problem.loss(translator.params, object_weight=1.0)
    assert float(parts[4]) > 0  # a fit on random tiny models is far from exact


def test_a_low_temperature_weighs_a_flipped_near_tie_above_an_equal_kl_elsewhere():
    """At T = 1 the tempered KL is the KL. Below 1 it weighs a position whose two top tokens,
    nearly tied in native, come out in the other order above a position with as much KL whose
    argmax stays: what the frontier's agreement counts."""
    from mlx_kvtrans.translators.fidelity import kl_per_token, tempered_kl

    native = mx.array([[0.05, 0.0, -4.0, -4.0], [3.0, 0.0, -4.0, -4.0]])
    flipped = mx.array([[0.0, 0.05, -4.0, -4.0]])
    target = float(kl_per_token(native[:1], flipped)[0])  # the KL the other position is given
    kept = mx.array([[3.0 - _shift_for_kl(target), 0.0, -4.0, -4.0]])
    assert abs(float(kl_per_token(native[1:], kept)[0]) - target) < 1e-3 * target
    assert mx.allclose(tempered_kl(native, native[::-1], 1.0), kl_per_token(native, native[::-1]))
    assert float(tempered_kl(native[:1], native[:1], 0.25)[0]) < 1e-9
    cold = [float(tempered_kl(a, b, 0.25)[0]) for a, b in ((native[:1], flipped),
                                                            (native[1:], kept))]
    assert cold[0] > 3 * cold[1]
    half = (native.astype(mx.bfloat16), native[::-1].astype(mx.bfloat16))  # summed in float32
    assert mx.allclose(tempered_kl(*half, 0.3),
                       tempered_kl(*(h.astype(mx.float32) for h in half), 0.3), rtol=1e-5)


def _shift_for_kl(target: float) -> float:
    """The drop of the top logit of [3, 0, -4, -4] whose KL from it is `target` (bisection)."""
    from mlx_kvtrans.translators.fidelity import kl_per_token

    base = mx.array([[3.0, 0.0, -4.0, -4.0]])
    lo, hi = 0.0, 3.0
    for _ in range(60):
        mid = (lo + hi) / 2
        moved = mx.array([[3.0 - mid, 0.0, -4.0, -4.0]])
        lo, hi = (mid, hi) if float(kl_per_token(base, moved)[0]) < target else (lo, mid)
    return (lo + hi) / 2


def test_the_loss_takes_its_kl_at_the_temperature_and_reports_it_at_one(loaded):

    translator, S, T = tiny_translator(loaded, "qwen3", "llama")
    windows = mx.random.randint(0, 259, (2, 40), key=mx.random.key(6))
    problem = Problem(translator, S, T, windows, 32)
    plain, (kl, *_) = problem.loss(translator.params, indexer_weight=0.0)
    cold, (cold_kl, *_) = problem.loss(translator.params, indexer_weight=0.0, temperature=0.25)
    assert float(plain) == float(kl) == float(cold_kl)
    assert abs(float(cold) - float(plain)) > 1e-6 * float(plain)
    with pytest.raises(KvtransError, match="temperature"):
        DistillConfig(temperature=0.0)


def test_a_translator_distilled_again_keeps_its_earlier_runs_records():
    from mlx_kvtrans.training.workflows import with_earlier_runs

    first = {"steps": 200, "config": {"max_prefix": 512}, "curve": [{"step": 1}]}
    second = with_earlier_runs({"steps": 300, "curve": [{"step": 1}]}, first)
    third = with_earlier_runs({"steps": 50}, second)
    assert [run["steps"] for run in third["earlier"]] == [200, 300]
    assert all("curve" not in run and "earlier" not in run for run in third["earlier"])
    assert third["earlier"][0]["config"] == {"max_prefix": 512}
    assert with_earlier_runs({"steps": 1}, None) == {"steps": 1}
