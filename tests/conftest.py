"""Shared fixtures: tiny random-weight models of every supported family, built once per
session; a server on a free port; ports for mlx.launch's ring backend."""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import pytest

import mlx_kvtrans  # first: selects OpenBLAS before mlx.core loads
from mlx_kvtrans.backend import blas
from mlx_kvtrans.zoo.families import FAMILIES

HYBRID_RECURRENT = ("kimi_linear", "qwen3_next", "qwen3_5")


def ring_port(processes: int = 2) -> int:
    """A `--starting-port` for `mlx.launch -n PROCESSES --backend ring`: that many consecutive
    ports free now, below the kernel's ephemeral range, where no client socket of an earlier
    test (one left in TIME_WAIT) can hold one."""
    import random
    import socket
    from pathlib import Path

    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for _ in range(200):
        base = random.randrange(20000, max(ephemeral, 20000 + 2 * processes) - processes)
        taken = []
        try:
            for port in range(base, base + processes):
                taken.append(socket.socket())
                taken[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in taken:
                sock.close()
    raise RuntimeError("no free ports for the ring backend")


@contextmanager
def running(engine):
    """`engine` served on a free loopback port; yields the base URL."""
    from mlx_kvtrans.serve import listen, server

    sock = listen("127.0.0.1", 0)
    srv = server(engine)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(30)


def pytest_configure(config):
    # Tests must not silently run on the wheel's reference BLAS (far slower; `kvtrans doctor`
    # measures it).
    if blas.BLAS_NAME == "reference" and not os.environ.get("KVTRANS_ALLOW_REFERENCE_BLAS"):
        pytest.exit(f"MLX would run on the slow reference BLAS. Fix: {blas.FIX} "
                    "(or set KVTRANS_ALLOW_REFERENCE_BLAS=1 to run anyway)", returncode=3)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """family -> directory of a tiny random model, written lazily."""
    from mlx_kvtrans.zoo.random_model import write_random_model

    root = tmp_path_factory.mktemp("models")
    made = {}

    def get(family):
        if family not in made:
            made[family] = write_random_model(family, root / family, seed=FAMILIES.index(family))
        return made[family]

    return get


@pytest.fixture(scope="session")
def loaded(model_dirs):
    """family -> LoadedModel (mlx-lm model + tokenizer), loaded once."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = mlx_kvtrans.load(str(model_dirs(family)))
        return cache[family]

    return get


@pytest.fixture(scope="module")
def zoo():
    """zoo alias -> LoadedModel, loaded once per test module."""
    models = {}

    def get(name):
        if name not in models:
            models[name] = mlx_kvtrans.load(name)
        return models[name]
    return get


@pytest.fixture(scope="module")
def kimi_pair(model_dirs, tmp_path_factory):
    """(kimi_linear, kimi_vl, paths): tiny models with stage-1 translators both ways, saved
    ((source name, target name) -> directory)."""
    from pathlib import Path

    import mlx.core as mx

    from mlx_kvtrans.translators import artifact
    from mlx_kvtrans.training.fit import fit
    from mlx_kvtrans.training.plan import plan

    a, b = (mlx_kvtrans.load(str(model_dirs(f))) for f in ("kimi_linear", "kimi_vl"))
    batches = [mx.random.randint(0, 259, (4, 48), key=mx.random.key(i)) for i in range(3)]
    root = tmp_path_factory.mktemp("translators")
    paths = {}
    for s, t in ((a, b), (b, a)):
        tr = fit(s.model, t.model, batches,
                 plan(mlx_kvtrans.layout_of(s.model), mlx_kvtrans.layout_of(t.model)))
        paths[(s.name, t.name)] = artifact.save(
            tr, root / f"{Path(s.name).name}__{Path(t.name).name}", s, t)
    return a, b, paths
