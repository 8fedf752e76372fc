"""Planning from configs alone: the same recipes and parameter shapes as from loaded models, the
moment memory the fit really holds, and a refusal before any work when a fit would not fit."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from typer.testing import CliRunner

import mlx_kvtrans as kv
from mlx_kvtrans.capture import capture
from mlx_kvtrans.cli.main import app
from mlx_kvtrans.models import load_config_only
from mlx_kvtrans.layouts import CapturePoint
from mlx_kvtrans.training import cost
from mlx_kvtrans.training.cost import layout_widths, plan_cost
from mlx_kvtrans.training.fit import FitConfig, fit
from mlx_kvtrans.translators.recipes import Widths
from mlx_kvtrans.translators.token_identity import TokenIdentity
from mlx_kvtrans.translators.translator import Translator

from test_translators import batches


def measure_widths(source_model, target_model, recipes, source_point) -> Widths:
    """The oracle: the widths `recipes` are shaped by, measured on an 8-token capture."""
    tokens = mx.zeros((1, 8), dtype=mx.int32)
    shell = Translator(CapturePoint(source_point), TokenIdentity(), recipes, {})
    features = shell.features(capture(source_model, tokens, points=shell.source_points()))
    points = set().union(*(r.target_points() for r in recipes)) | {CapturePoint.ENGINE}
    target = capture(target_model, tokens, points=points)
    samples = {(layer, name, point): value for layer, found in enumerate(target.objects)
               for (name, point), value in found.items()}
    return Widths({k: v.shape[-1] for k, v in features.items()}, 0, samples)


PAIRS = [("kimi_linear", "kimi_vl", {}), ("kimi_vl", "kimi_linear", {}),
         ("qwen3_5", "deepseek_v32", {}), ("qwen3", "qwen3_next", {}),
         ("qwen3_5", "qwen3_next", {"recurrent_state": "bilinear"})]


@pytest.mark.parametrize("source,target,recipes", PAIRS)
@pytest.mark.parametrize("features", ["attention", "all"])
def test_plan_from_configs_alone_matches_the_loaded_models(model_dirs, loaded, source, target,
                                                           recipes, features):
    S, T = loaded(source), loaded(target)
    config = FitConfig(features=features, recipes=recipes)
    from_models = config.plan(kv.layout_of(S.model), kv.layout_of(T.model))
    lazy_s = load_config_only(str(model_dirs(source) / "config.json"))
    lazy_t = load_config_only(str(model_dirs(target)))
    from_configs = config.plan(kv.layout_of(lazy_s.model), kv.layout_of(lazy_t.model))
    assert [r.to_json() for r in from_configs] == [r.to_json() for r in from_models]
    measured = measure_widths(S.model, T.model, from_models, 1)
    projected = layout_widths(kv.layout_of(lazy_s.model), kv.layout_of(lazy_t.model),
                              from_configs, 1)
    assert projected.features == measured.features
    for r in from_models:
        assert r.shaped(projected).param_shapes(projected) == \
            r.shaped(measured).param_shapes(measured)


@pytest.mark.parametrize("source,target", [("kimi_linear", "kimi_vl"), ("qwen3", "llama")])
def test_projected_moments_and_parameters_are_the_fits(loaded, source, target):
    S, T = loaded(source), loaded(target)
    recipes = kv.plan(kv.layout_of(S.model), kv.layout_of(T.model))
    tr = fit(S.model, T.model, batches(1), recipes)
    projected = plan_cost(S, T, recipes, 1)
    assert projected.moments_bytes == tr.info["fit"]["moments_bytes"]
    assert projected.parameters == sum(v.size for v in tr.params.values())
    assert projected.translation_flops_per_token * 100 == tr.flops(100, kv.layout_of(T.model))


def test_random_features_are_projected_as_fitted(loaded):
    """A plan with random features projects the fit's moments, parameters and translation
    FLOPs (the projection included)."""
    from mlx_kvtrans.training.fit import FitConfig

    S, T = loaded("qwen3"), loaded("llama")
    config = FitConfig(point=1, random_features=24)
    recipes = config.plan(kv.layout_of(S.model), kv.layout_of(T.model))
    tr = fit(S.model, T.model, batches(1), recipes, config)
    projected = plan_cost(S, T, recipes, 1, expansion_width=24)
    assert projected.moments_bytes == tr.info["fit"]["moments_bytes"]
    assert projected.parameters == sum(v.size for v in tr.params.values())
    assert projected.translation_flops_per_token * 100 == tr.flops(100, kv.layout_of(T.model))
    assert projected.translation_flops_per_token > plan_cost(
        S, T, recipes, 1).translation_flops_per_token


def test_plan_command_runs_from_zoo_aliases():
    result = CliRunner().invoke(app, ["plan", "--from", "kimi-linear", "--to", "kimi-vl",
                                      "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["fits"] and report["feature_sets"][0]["maps"] == 8  # one set serves all


def test_a_fit_that_would_not_fit_is_refused_before_any_work(monkeypatch, tmp_path):
    from mlx_kvtrans.backend import blas

    for module in (cost, blas):  # a 1 MiB machine, wherever its memory is read
        monkeypatch.setattr(module, "machine_memory", lambda: 2**20)
    (tmp_path / "text.txt").write_text("a few words " * 10)
    result = CliRunner().invoke(app, ["fit", "--from", "kimi-linear", "--to", "kimi-vl",
                                      "--out", str(tmp_path / "tr"), "--data",
                                      str(tmp_path / "text.txt")])
    assert result.exit_code == 2 and "would need about" in result.output
    assert not (tmp_path / "tr").exists()


def test_durations_read_in_human_units():
    from mlx_kvtrans.training.cost import format_duration

    assert [format_duration(x) for x in (7.5, 100, 3 * 3600, 10 * 86400, 1.5e12)] == \
        ["8 s", "1.7 min", "3.0 h", "10 days", "47,565 years"]


def test_projected_fit_time_is_measured_on_the_models_and_scales_with_the_fit(model_dirs,
                                                                              monkeypatch):
    """The projection runs both models (a fit of one batch, a gate window of each kind) and
    scales what those took by the fit's batches and windows: twice the tokens, twice the
    capture; twice the gate windows, twice the calibration. Each run's time is fixed here, so
    the arithmetic is checked exactly; how close the projection comes to a real fit is measured
    side by side by benchmarks/plan.py."""
    from mlx_kvtrans.training import fit_time as ft
    from mlx_kvtrans.training.workflows import plan_and_cost

    runs = []

    def timed(run):
        run()  # the real thing, on the two models
        runs.append(run)
        return 0.5

    monkeypatch.setattr(ft, "_timed", timed)
    src, tgt = load_config_only(str(model_dirs("kimi_linear"))), \
        load_config_only(str(model_dirs("kimi_vl")))
    config = FitConfig(windows=64, length=64)
    _, cost_ = plan_and_cost(src, tgt, config)
    small = ft.fit_time(src, tgt, cost_, config, gate_windows=2)
    large = ft.fit_time(src, tgt, cost_, config, tokens=2 * 64 * 64, gate_windows=4)
    assert small.measured and large.measured and runs  # timed, not the matmul rate
    assert large.capture_seconds == pytest.approx(2 * small.capture_seconds)
    assert large.gate_seconds == pytest.approx(2 * small.gate_seconds)
    untimed = ft.fit_time(src, tgt, cost_, config, gate_windows=2, timed=False)
    assert not untimed.measured and untimed.seconds > 0


def test_a_plan_for_another_mac_projects_at_its_figures(tmp_path):
    """`kvtrans plan --machine m3-ultra` (or the figures themselves) projects for that Mac: its
    memory decides whether the fit fits, its rates the time; a size or preset that is not one
    is refused in one line."""
    from mlx_kvtrans.training.machines import PRESETS, machine_for, parse_bytes

    assert parse_bytes("512GiB") == parse_bytes("512 GB") == 512 * 2**30
    assert parse_bytes("1.5t") == int(1.5 * 2**40)
    ultra = machine_for("m3-ultra", matmul_tflops=10.0)
    assert ultra.matmul_gflops == 10_000.0 and not ultra.measured
    assert ultra.memory_bytes == PRESETS["m3-ultra"].memory_bytes

    runner = CliRunner()
    base = ["plan", "--from", "kimi-linear", "--to", "kimi-vl", "--json"]
    fast = json.loads(runner.invoke(app, base + ["--machine", "m3-ultra"]).output)
    slow = json.loads(runner.invoke(app, base + ["--machine", "m3-ultra", "--matmul-tflops",
                                                 "1.74"]).output)
    assert fast["fits"] and fast["machine_bytes"] == 512 * 2**30
    assert not fast["fit_time"]["measured"]  # projected at the preset's rate, not timed here
    assert 9.0 < slow["fit_seconds"] / fast["fit_seconds"] < 11.0
    small = runner.invoke(app, ["plan", "--from", "kimi-linear", "--to", "kimi-vl",
                                "--machine", "m3-ultra", "--memory", "1MiB"])
    assert small.exit_code == 2 and "of Mac Studio M3 Ultra" in small.output
    for bad in (["--memory", "lots"], ["--machine", "m9"], ["--bandwidth", "0"]):
        result = runner.invoke(app, base + bad)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output


@pytest.mark.parametrize("name, total, active", [
    ("kimi-linear", (47e9, 50e9), (2.8e9, 3.8e9)), ("kimi-vl", (15e9, 17e9), (2.5e9, 3.2e9)),
    ("qwen3.5", (26e9, 28e9), (26e9, 28e9)), ("deepseek-v3.2", (660e9, 690e9), (36e9, 40e9))])
def test_the_real_checkpoints_are_planned_at_their_published_sizes(tmp_path, name, total,
                                                                   active):
    """The configs a plan for the mission's checkpoints is made from hold the published
    parameter counts (Kimi-Linear-48B-A3B, Kimi-VL-A3B 16B, Qwen3.5-27B, DeepSeek-V3.2 671B
    with 37B active): every expert held, a token's forward at the routed share."""
    from mlx_kvtrans.zoo.families import full_config

    (tmp_path / "config.json").write_text(json.dumps(full_config(name)))
    lm = load_config_only(str(tmp_path))
    assert total[0] < cost.parameter_count(lm.model) < total[1]
    assert active[0] < cost.active_parameters(lm) < active[1]
    assert cost.weights_bytes(lm) == pytest.approx(2 * cost.parameter_count(lm.model), rel=1e-6)


def test_two_models_of_one_geometry_are_planned_object_for_object():
    """`auto` plans a same-geometry pair (`same`): every state and conv history copied from its
    own layer, keys mapped from keys and values from values of the same layer; any other pair
    as `attention`, and `same` refuses it."""
    from mlx_kvtrans.layouts import layout_of
    from mlx_kvtrans.training.plan import designed, plan
    from mlx_kvtrans.translators.recipes import Copy, RecipeError, TokenMap

    a, b, vl = (layout_of(kv.load(n).model) for n in ("qwen3.5-a", "qwen3.5-b", "kimi-vl"))
    recipes = plan(a, b)
    assert designed(a, b, "auto") == "same" and designed(a, vl, "auto") == "attention"
    for r in recipes:
        assert r.sources == (r.layer,)
        if isinstance(r, TokenMap):
            assert r.source_kinds == ("token_key" if r.name == "keys" else "token_value",)
        else:
            assert isinstance(r, Copy)
    assert any(isinstance(r, TokenMap) for r in recipes) and any(
        isinstance(r, Copy) for r in recipes)
    assert plan(a, vl) == plan(a, vl, features="attention")
    with pytest.raises(RecipeError, match="one geometry"):
        plan(a, vl, features="same")
