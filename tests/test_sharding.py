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
from mlx_kvtrans.translators.sharding import shards_of
from conftest import ring_port

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
@pytest.mark.parametrize("kind, source, target, translator, sink, sharded", [
    # every layer's heads split in two (qwen3-large's 2 KV heads: one each), both models
    ("tensor", "qwen3-small", "qwen3-large", "qwen3-small__qwen3-large-distilled", 0, "both"),
    # layers split in two: one process holds the GDN layers, the other the attention layers
    ("pipeline", "qwen3.5-a", "qwen3.5-b", "qwen3.5-a__qwen3.5-b-distilled", 4, "both"),
    # MLA latents and indexer keys, each on the process that holds their layer
    ("pipeline", "qwen3.5-a", "dsa", "qwen3.5-a__dsa-distilled", 0, "target"),
])
def test_sharded_models_translate_as_their_unsharded_twins(tmp_path, kind, source, target,
                                                           translator, sink, sharded):
    ranks = run_sharded(tmp_path, ring_port(), kind, source, target, translator, str(sink),
                        sharded)
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
        for name, value in some[i].items():  # the fused GEMM is narrower: BLAS may round
            assert mx.allclose(value, whole[i][name], rtol=1e-5, atol=1e-5), (i, name)


def test_jobs_in_step_draw_from_the_shared_seed_on_the_compute_thread():
    """MLX's random state is per thread: the seed every process shares is set where the jobs
    run, so a sampled token is the same on every process."""
    import threading

    from mlx_kvtrans.serve.compute import ComputeThread
    from mlx_kvtrans.serve.lockstep import Lockstep

    lockstep = Lockstep(mx.distributed.init())  # a group of one: the protocol without peers
    drawn, done = [], threading.Event()
    worker = ComputeThread(named={"draw": lambda: (drawn.append(mx.random.uniform(shape=(4,))
                                                                .tolist()), done.set())},
                           lockstep=lockstep)
    worker.share("draw")
    assert done.wait(30)
    worker.close()

    def first_draw():  # a fresh thread, seeded as every process's compute thread is
        mx.random.seed(lockstep.seed)
        drawn.append(mx.random.uniform(shape=(4,)).tolist())

    thread = threading.Thread(target=first_draw)
    thread.start()
    thread.join()
    assert drawn[0] == drawn[1]


def test_settle_in_step_returns_once_every_continuation_ran():
    """`settle` checks between rounds; a check that finds work left looks again next round,
    after a job ran, and returns once none is left."""
    import threading

    from mlx_kvtrans.serve.compute import ComputeThread
    from mlx_kvtrans.serve.lockstep import Lockstep

    ran = []
    worker = None

    def chain(n: int) -> None:
        ran.append(n)
        if n:
            worker.later(chain, n - 1)

    lockstep = Lockstep(mx.distributed.init())
    worker = ComputeThread(named={"chain": chain}, lockstep=lockstep)
    lockstep.post("chain", 20)  # often shared in the round of the settle's first check
    settled = threading.Thread(target=worker.settle, daemon=True)
    settled.start()
    settled.join(30)
    assert not settled.is_alive() and ran == list(range(20, -1, -1))
    worker.close()


def _conversation(url: str, small: str, large: str, settle) -> list[tuple[str, str]]:
    """A conversation over OpenAI's API that moves from `small` to `large` and back, with a
    client that leaves mid-reply and a sampled reply between: each greedy reply and how its
    history was switched. `settle()` runs after each request: the server's idle work
    (reading the reply in, translating ahead) decides what the next switch translates."""
    import http.client
    from urllib.parse import urlparse

    import openai

    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "The number for pepper is 552190. Say ok."}]
    replies = []

    def ask(model: str, **options) -> str:
        raw = api.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=12, temperature=0, **options)
        text = raw.parse().choices[0].message.content
        replies.append((text, raw.headers["x-kvtrans-history"]))
        settle()
        return text

    messages.append({"role": "assistant", "content": ask(small)})
    messages.append({"role": "user", "content": "What was the number for pepper?"})
    messages.append({"role": "assistant", "content": ask(large)})
    # a client that leaves after the first chunk of a long reply
    host = urlparse(url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"model": small, "messages": messages, "max_tokens": 400, "stream": True}),
        {"content-type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200 and reply.readline()
    conn.close()
    settle()
    api.chat.completions.create(model=small, messages=messages, max_tokens=6, temperature=1.0,
                               seed=11)
    settle()
    messages.append({"role": "user", "content": "And the number again?"})
    ask(small)
    ask(large)
    # unseeded: every process must still draw the same tokens, or they fall out of step
    api.chat.completions.create(model=small, messages=messages, max_tokens=8, temperature=1.0)
    settle()
    ask(large)
    return replies


@pytest.mark.slow  # spawns processes through mlx.launch
@pytest.mark.parametrize("kind, small, large", [
    ("tensor", "qwen3-small", "qwen3-large"),
    ("pipeline", "qwen3.5-a", "qwen3.5-b"),
])
def test_a_sharded_server_answers_as_its_unsharded_twin(tmp_path, kind, small, large):
    """`mlx.launch -n 2 kvtrans serve --shard KIND`: process 0 answers HTTP, both decode their
    shares in step; the replies and switches are the unsharded server's, also after a client
    left mid-reply and a sampled reply, and Ctrl-C ends every process."""
    import signal
    import time

    from conftest import running
    from mlx_kvtrans.serve import Engine, ServeConfig
    from mlx_kvtrans.serve.config import find_translators, load_models

    models = load_models([small, large])
    translators, _ = find_translators(models, [])
    engine = Engine(models, translators, ServeConfig(models=[small, large]))
    with running(engine) as twin:
        expected = _conversation(twin, small, large, engine.settle)
    assert [h for _, h in expected][:4] == ["none", "applied", "reused", "applied"]

    group, url = _launch_server(tmp_path, ring_port(), [small, large], kind)
    try:  # the zoo's idle work takes well under a second
        answered = _conversation(url, small, large, lambda: time.sleep(1.0))
        assert answered == expected
    finally:
        os.killpg(group.pid, signal.SIGINT)  # Ctrl-C: every process of the group gets it
    # process 0 shares the end with the others: none is left behind
    _assert_ends(group, tmp_path, "after Ctrl-C")


@pytest.mark.slow  # spawns processes through mlx.launch
@pytest.mark.skipif(sys.platform != "linux", reason="finds a rank's process in /proc")
@pytest.mark.parametrize("rank", [0, 1])
def test_a_sharded_server_ends_when_one_of_its_processes_dies(tmp_path, rank):
    """A process killed outright breaks the group: the other ends and none is left behind. Where
    MLX's ring backend raises in the collective the other ends at once and says why (the
    follower as it exits, process 0 in its log); where it fails the pending tasks without
    raising (it does either, by timing), the other waits in the collective until mlx.launch's
    SIGTERM and ends through its grace (`--grace`, and twice that for the others)."""
    import signal
    import time
    import urllib.request

    group, url = _launch_server(tmp_path, ring_port(), ["qwen3.5-a"], "pipeline")
    try:  # one answer first: both processes run in step (process 0 answers health sooner)
        ask = urllib.request.Request(f"{url}/v1/completions", json.dumps(
            {"model": "qwen3.5-a", "prompt": "Hi", "max_tokens": 1}).encode(),
            {"Content-Type": "application/json"})
        assert urllib.request.urlopen(ask, timeout=120).status == 200
        os.kill(_rank_pid(group.pid, rank), signal.SIGKILL)
    except BaseException:
        _kill_group(group)
        raise
    killed = time.monotonic()
    deadline = killed + 2 * GRACE + 20  # the followers' grace, and mlx.launch's clean-up
    while _ranks(group.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _ranks(group.pid)
    if left:
        _kill_group(group)
        pytest.fail(f"processes {sorted(left)} did not end after process {rank} was killed:\n"
                    + (tmp_path / "serve.log").read_text()[-2000:])
    _assert_ends(group, tmp_path, f"after process {rank} was killed")
    if time.monotonic() - killed < GRACE:  # at once: the collective raised, and that is said
        assert "the sharded server's group broke" in (tmp_path / "serve.log").read_text()


@pytest.mark.slow  # spawns processes through mlx.launch
@pytest.mark.skipif(sys.platform != "linux", reason="finds a rank's process in /proc")
def test_a_sharded_server_ends_when_a_process_dies_while_it_streams(tmp_path):
    """Process 0's compute may then wait in a collective forever (MLX's ring backend fails the
    pending tasks without raising), and mlx.launch waits for process 0: told to stop, it ends
    within its grace."""
    import http.client
    import json
    import signal

    group, url = _launch_server(tmp_path, ring_port(), ["qwen3.5-a"], "pipeline")
    try:
        conn = http.client.HTTPConnection(url.split("//")[1], timeout=GRACE + 60)
        body = {"model": "qwen3.5-a", "max_tokens": 4000, "stream": True,
                "messages": [{"role": "user", "content": "Tell a long story."}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200 and reply.readline()  # streaming
        os.kill(_rank_pid(group.pid, 1), signal.SIGKILL)
    except BaseException:
        _kill_group(group)
        raise
    _assert_ends(group, tmp_path, "after process 1 was killed mid-stream",
                 within=GRACE + 30)


GRACE = 5.0  # seconds a sharded server's process 0, told to stop, waits (`--grace`)


def _launch_server(tmp_path: Path, port: int, models: list[str], kind: str):
    """`mlx.launch -n 2 kvtrans serve --shard KIND`, once it answers: (its process, its URL)."""
    import socket
    import time
    import urllib.request

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        http_port = free.getsockname()[1]
    launcher = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or "mlx.launch"
    kvtrans = shutil.which("kvtrans", path=str(Path(sys.executable).parent)) or "kvtrans"
    log = (tmp_path / "serve.log").open("w")
    group = subprocess.Popen(
        [launcher, "-n", "2", "--backend", "ring", "--starting-port", str(port), "--",
         kvtrans, "serve", *(a for m in models for a in ("--model", m)), "--shard", kind,
         "--port", str(http_port), "--grace", str(GRACE)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 180
    while True:
        if group.poll() is not None or time.monotonic() > deadline:
            _kill_group(group)
            pytest.fail((tmp_path / "serve.log").read_text()[-2000:])
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5)
            return group, url
        except OSError:
            time.sleep(0.5)


def _ranks(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of each process mlx.launch started that is still alive (its MLX_RANK)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                env = (proc / "environ").read_bytes().split(b"\0")
                stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            rank = next((e.split(b"=", 1)[1] for e in env if e.startswith(b"MLX_RANK=")), None)
            if int(stat[1]) == launcher_pid and rank is not None and stat[0] != "Z":
                found[int(rank)] = int(proc.name)
    return found


def _rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the process mlx.launch started as `rank` (its MLX_RANK)."""
    pid = _ranks(launcher_pid).get(rank)
    if pid is None:
        raise AssertionError(f"no process of rank {rank} under mlx.launch {launcher_pid}")
    return pid


def _assert_ends(group, tmp_path: Path, when: str, within: float = 60) -> None:
    """Every process of `group`'s process group ends `within` seconds; else all are killed and
    the test fails with what was left and the server's log."""
    import time

    deadline = time.monotonic() + within
    while True:
        group.poll()
        try:
            os.killpg(group.pid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            left = subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(group.pid)],
                                  capture_output=True, text=True).stdout
            _kill_group(group)
            log = (tmp_path / "serve.log").read_text()[-2000:]
            pytest.fail(f"a process of the sharded server did not end {when}:\n{left}\n{log}")
        time.sleep(0.2)


def _kill_group(group) -> None:
    import signal

    try:
        os.killpg(group.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
