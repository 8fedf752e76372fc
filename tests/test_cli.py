"""The `kvtrans` command: inspect, verify, doctor, and clear errors (exit 2, no traceback)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlx_kvtrans import load as kv_load
from mlx_kvtrans.cli.main import app
from mlx_kvtrans.zoo.families import FAMILIES

from test_layouts import EXPECTED_KINDS

runner = CliRunner()


def kvtrans(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_json_lists_every_object(model_dirs, family):
    result = kvtrans("inspect", model_dirs(family), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    kinds = {o["kind"] for layer in data["layers"] for o in layer["objects"]}
    assert kinds == {k.value for k in EXPECTED_KINDS[family]}
    assert len(data["layers"]) == 4
    assert data["totals"]["bytes_per_token"] > 0


def test_inspect_table(model_dirs):
    result = kvtrans("inspect", model_dirs("kimi_linear"))
    assert result.exit_code == 0
    for word in ("kda", "mla", "recurrent_state", "conv_history", "mla_latent", "per token"):
        assert word in result.output


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_passes(model_dirs, family):
    result = kvtrans("verify", model_dirs(family), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["passed"] and all(c["passed"] for c in data["checks"])
    names = " ".join(c["name"] for c in data["checks"])
    assert "install" in names and "prompt-cache" in names
    if family in ("kimi_linear", "qwen3_5", "qwen3_next"):
        assert "replay" in names


def test_doctor_reports_blas(model_dirs):
    result = kvtrans("doctor", "--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["blas"] in ("openblas", "accelerate")  # Linux's OpenBLAS or Apple's Accelerate
    assert not data["blas_is_slow_reference"]
    assert data["matmul_float32_gflops"] > 0


def _broken_dirs(tmp_path, model_dirs):
    good = model_dirs("qwen3")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    no_tok_config = tmp_path / "no_tok_config"
    shutil.copytree(good, no_tok_config)
    (no_tok_config / "tokenizer_config.json").unlink()
    unsupported = tmp_path / "unsupported"
    shutil.copytree(good, unsupported)
    config = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    bad_json = tmp_path / "bad_json"
    shutil.copytree(good, bad_json)
    (bad_json / "config.json").write_text("{not json")
    return {"missing": tmp_path / "nowhere", "no config.json": no_config,
            "no tokenizer_config.json": no_tok_config, "unsupported": unsupported,
            "bad json": bad_json}


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_bad_models_exit_2_with_one_line(tmp_path, model_dirs, command):
    for why, path in _broken_dirs(tmp_path, model_dirs).items():
        result = kvtrans(command, path)
        assert result.exit_code == 2, (why, result.output)
        assert "Traceback" not in result.output
        assert "error:" in result.output
        assert len(result.output.strip().splitlines()) == 1
        if why == "unsupported":
            assert "deepseek_v32" in result.output  # the error lists the supported families


@pytest.mark.slow  # spawns subprocesses
def test_console_script_has_no_traceback(tmp_path):
    """The installed entry point, as a user runs it."""
    script = Path(sys.executable).parent / "kvtrans"  # the venv's console script
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "mlx_kvtrans.cli.main"]
    cmd += ["inspect", str(tmp_path / "nothing")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "not found" in proc.stderr


@pytest.mark.slow  # spawns subprocesses
def test_mlx_lm_generate_continues_from_written_prompt_cache(loaded, tmp_path):
    import mlx_kvtrans as kv

    lm = loaded("qwen3_5")
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                           add_generation_prompt=False)
    cap = kv.capture(lm.model, ids)
    path = kv.write_prompt_cache(tmp_path / "c.safetensors",
                                 kv.install(lm.model, cap.at(1), point=1), str(lm.path))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--prompt-cache-file",
                           str(path), "--prompt", "and then?", "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Generation:" in proc.stdout


def test_malformed_config_is_a_user_error(tmp_path, model_dirs):
    broken = tmp_path / "missing_fields"
    shutil.copytree(model_dirs("qwen3"), broken)
    config = json.loads((broken / "config.json").read_text())
    del config["hidden_size"]
    (broken / "config.json").write_text(json.dumps(config))
    result = kvtrans("inspect", broken)
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_failed_verification_exits_1_without_internal_error(model_dirs, monkeypatch):
    from mlx_kvtrans.tools import verify

    real = verify.run_checks

    def one_failing(*args, **kwargs):
        checks = real(*args, **kwargs)
        checks[0].passed = False
        return checks

    monkeypatch.setattr(verify, "run_checks", one_failing)
    result = kvtrans("verify", model_dirs("qwen3"))
    assert result.exit_code == 1
    assert "FAIL" in result.output and "internal error" not in result.output


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear"])
def test_verify_passes_correct_models_on_any_seed(tmp_path, family):
    """The full-forward check allows the forward's own float32 reassociation error: a correct
    checkpoint passes whatever its random weights."""
    from mlx_kvtrans.tools.verify import run_checks
    from mlx_kvtrans.zoo.random_model import write_random_model

    for seed in range(4):
        lm = kv_load(write_random_model(family, tmp_path / f"{family}-{seed}", seed=seed))
        failed = [c for c in run_checks(lm.model, lm.tokenizer) if not c.passed]
        assert not failed, (seed, failed)


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear", "qwen3"])
def test_verify_fails_an_install_off_by_one_percent(loaded, monkeypatch, family):
    import mlx.core as mx

    from mlx_kvtrans.tools import verify

    real = verify.install

    def off_by_one_percent(layout, objects, *args, **kwargs):
        nudged = [{name: value * 1.01 if isinstance(value, mx.array) else value
                   for name, value in layer.items()} for layer in objects]
        return real(layout, nudged, *args, **kwargs)

    monkeypatch.setattr(verify, "install", off_by_one_percent)
    lm = loaded(family)
    failed = {c.name for c in verify.run_checks(lm.model, lm.tokenizer) if not c.passed}
    assert "capture(3) -> install continues like the full forward" in failed
    assert "capture(3) -> install continues like the engine's own cache" in failed


def test_shipped_distilled_translator_is_preferred(tmp_path, monkeypatch):
    from mlx_kvtrans.cli.common import default_translator

    monkeypatch.setenv("KVTRANS_WEIGHTS", str(tmp_path))
    assert default_translator("a", "b") is None
    for name in ("a__b", "a__b-distilled"):
        (tmp_path / "translators" / name).mkdir(parents=True)
    (tmp_path / "translators" / "a__b" / "manifest.json").write_text("{}")
    assert default_translator("a", "b").name == "a__b"
    (tmp_path / "translators" / "a__b-distilled" / "manifest.json").write_text("{}")
    assert default_translator("a", "b").name == "a__b-distilled"


# -- help and tables a person reads ---------------------------------------------------------------
def _commands(command, path=("kvtrans",)):
    import typer.main

    command = typer.main.get_command(command) if not hasattr(command, "params") else command
    for name, sub in (getattr(command, "commands", None) or {}).items():
        yield from _commands(sub, (*path, name))
    if not getattr(command, "commands", None):
        yield " ".join(path), command


def test_every_option_and_argument_of_every_command_has_help():
    missing = [f"{path} {'/'.join(p.opts)}" for path, command in _commands(app)
               for p in command.params if not (getattr(p, "help", None) or "").strip()]
    assert len(list(_commands(app))) > 15
    assert not missing, missing


def _kvtrans_at(columns: int, *args) -> str:
    """`kvtrans ARGS` piped (stdout not a terminal), as a person's COLUMNS sets it."""
    script = Path(sys.executable).parent / "kvtrans"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "mlx_kvtrans.cli.main"]
    proc = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": str(columns)})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_fits_80_columns_and_cuts_no_cell(model_dirs, family):
    shown = _kvtrans_at(80, "inspect", model_dirs(family))
    assert "…" not in shown and "..." not in shown
    assert max(map(len, shown.splitlines())) <= 80
    layout = kv_load(str(model_dirs(family))).model
    from mlx_kvtrans import layout_of

    for layer in layout_of(layout).layers:  # every object's name and kind, whole
        for obj in layer.objects:
            assert obj.name in shown.split() and obj.kind.value in shown.split()


def test_piped_tables_follow_columns(model_dirs):
    for columns in (60, 120):
        shown = _kvtrans_at(columns, "inspect", model_dirs("kimi_linear"))
        assert max(map(len, shown.splitlines())) <= columns
        assert "…" not in shown


def test_help_lists_every_command_with_its_whole_summary():
    shown = _kvtrans_at(80, "--help")
    commands = shown[shown.index("Commands:"):]
    assert "…" not in commands and "..." not in commands
    assert max(map(len, shown.splitlines())) <= 80
    # a summary sentence ends on its full stop, however it wraps
    assert "Show every cache object of every layer: kind, shape, rotation,\n" \
           "             capture points, bytes." in shown


def test_eval_perplexity_reports_the_ratio_to_its_reference():
    result = CliRunner().invoke(app, ["eval", "perplexity", "--model", "qwen3-small",
                                      "--reference", "qwen3-large", "--windows", "2",
                                      "--length", "32", "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    small, large = got["model"]["perplexity"], got["reference"]["perplexity"]
    assert 1 < small < 4096 and 1 < large < 4096  # better than a uniform guess over 4,096
    assert abs(got["ratio"] - small / large) < 1e-9


def test_eval_needle_in_chat_format_names_its_format():
    result = CliRunner().invoke(app, ["eval", "needle", "--model", "qwen3-small", "--lengths",
                                      "128", "--samples", "2", "--needle-format", "chat",
                                      "--facts", "2", "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    assert got["format"] == "chat" and got["facts"] == 2 and 0 <= got["recall"]["128"] <= 1


def test_eval_needle_through_a_translator_names_the_setting_it_measured():
    args = ["eval", "needle", "--translator", "qwen3-large__qwen3-small-distilled", "--lengths",
            "64", "--samples", "2"]
    result = CliRunner().invoke(app, args + ["--json"])
    assert result.exit_code == 0, result.output
    assert "bare translation" in json.loads(result.output)["setting"]
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "bare translation" in " ".join(table.output.split())
