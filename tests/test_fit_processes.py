"""Under `mlx.launch`: two processes, each summing half the fitting batches and reading half the
gate's calibration windows, make the translator one process makes, each process keeping a
checkpoint of its own; two processes, each scoring half the windows and needles, measure the
frontier one measures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_kvtrans  # noqa: F401  first: fast BLAS
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.models import weights_dir
from mlx_kvtrans.training.fit_checkpoint import FILE, check_directory, state_file
from conftest import ring_port

TEXT = weights_dir() / "corpus" / "validation.txt"


def kvtrans(args: list[str], processes: int, port: int) -> subprocess.CompletedProcess:
    """`kvtrans ARGS` in one process, or in `processes` under mlx.launch (one thread each)."""
    launcher = [] if processes == 1 else [
        shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or "mlx.launch",
        "-n", str(processes), "--backend", "ring", "--starting-port", str(port), "--"]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run([*launcher, sys.executable, "-m", "mlx_kvtrans.cli", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def fit_cli(args: list[str], processes: int, port: int) -> subprocess.CompletedProcess:
    return kvtrans(["fit", "--data", str(TEXT), "--validation", str(TEXT), "--gate-windows",
                    "1", "--length", "64", "--json", *args], processes, port)


@pytest.mark.slow  # spawns processes through mlx.launch
@pytest.mark.parametrize("pair, options", [
    # moments shared by maps, identity tables (sums per id and gathered bigrams)
    (("kimi-linear", "kimi-vl"), ["--windows", "8", "--token-identity", "ids",
                                  "--identity-tables", "4"]),
    # bilinear state pairs (gathered) and principal directions (a first pass, summed)
    (("qwen3.5-a", "qwen3.5-b"), ["--windows", "8", "--recipe", "recurrent_state=bilinear",
                                  "--features", "all", "--width", "16"]),
])
def test_two_processes_fit_what_one_fits(tmp_path, pair, options):
    runs = {}
    for n, port in ((1, 0), (2, ring_port())):
        out = tmp_path / f"out{n}"
        done = fit_cli(["--from", pair[0], "--to", pair[1], "--out", str(out), "--workdir",
                        str(tmp_path / f"work{n}"), *options], n, port)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout)["out"] == str(out)  # one process reports
        manifest = json.loads((out / "manifest.json").read_text())
        runs[n] = (mx.load(str(out / "weights.safetensors")), manifest["fit"], manifest["gate"])
        assert not list((tmp_path / f"work{n}").glob("fit-state*"))  # saved: the sums go
    (one, fit1, gate1), (two, fit2, gate2) = runs[1], runs[2]
    assert fit1["processes"] == 1 and fit2["processes"] == 2
    # the same windows calibrated, half on each process: the same gaps and thresholds
    assert "processes" not in gate1 and gate2.pop("processes") == 2
    assert gate1["data_sha256"] == gate2["data_sha256"]
    for band1, band2 in zip(gate1["bands"], gate2["bands"], strict=True):
        assert band1["prefix"] == band2["prefix"] and band1["gap"].keys() == band2["gap"].keys()
        for kind in band1["threshold"]:
            assert abs(band1["threshold"][kind] - band2["threshold"][kind]) <= 1e-3
            assert band1["gap"][kind]["windows"] == band2["gap"][kind]["windows"] == 1
    assert fit1["tokens"] == fit2["tokens"] and fit1["data_sha256"] == fit2["data_sha256"]
    assert one.keys() == two.keys()
    for name in one:
        difference = mx.abs(one[name].astype(mx.float32) - two[name].astype(mx.float32)).max()
        assert difference.item() <= 1e-5, name


@pytest.mark.slow  # spawns processes through mlx.launch
def test_two_processes_measure_the_frontier_one_measures(tmp_path):
    """Each process scores its share of the windows and needles (an odd count: one more on
    the first), the first times the switch; the first alone writes the frontier."""
    rows = {}
    for n, port in ((1, 0), (2, ring_port())):
        out = tmp_path / f"frontier{n}.json"
        done = kvtrans(["eval", "frontier", "--translator", "qwen3-large__qwen3-small-distilled",
                        "--lengths", "48,96", "--rereads", "8", "--prompts", "3", "--needles",
                        "3", "--repeats", "1", "--out", str(out)], n, port)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.count("wrote") == 1  # one process reports
        written = json.loads(out.read_text())
        assert written["settings"].get("processes", 1) == n
        rows[n] = written["rows"]
    assert len(rows[1]) == len(rows[2]) == 2
    for one, two in zip(rows[1], rows[2]):
        for key, value in one.items():
            if key in ("reread_s", "switch_s", "speedup"):
                assert two[key] > 0  # timed by the first process alone
            elif isinstance(value, float):
                assert abs(value - two[key]) <= 1e-6, key
            else:
                assert value == two[key], key


def test_each_process_resumes_its_own_checkpoint(tmp_path):
    """Two processes checkpoint to two files; a process resumes only from its own, and neither
    counts as a stranger's file in the directory."""
    assert state_file(0, 1) == FILE
    names = {state_file(r, 2) for r in range(2)}
    assert len(names) == 2 and FILE not in names
    (tmp_path / state_file(1, 2)).write_bytes(b"sums")
    check_directory(tmp_path, resume=True, name=state_file(1, 2))
    check_directory(tmp_path, resume=False, name=state_file(0, 2))
    with pytest.raises(KvtransError, match="--resume"):
        check_directory(tmp_path, resume=False, name=state_file(1, 2))
    with pytest.raises(KvtransError, match="no fit checkpoint"):
        check_directory(tmp_path, resume=True, name=state_file(0, 2))
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(KvtransError, match="other files"):
        check_directory(tmp_path, resume=True, name=state_file(1, 2))
