"""The fidelity dial: a switch's target re-reads the span's last R tokens itself, R fixed or
chosen from the translator's measured frontier, and the switch status says which and why."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_kvtrans as kv
from mlx_kvtrans.capture import capture
from mlx_kvtrans.evaluation.frontier import Frontier, Row, Setting
from mlx_kvtrans.translators.install import install
from mlx_kvtrans.session import Session, dial
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.tools.verify import max_abs_diff


def row(length, reread, agreement, speedup):
    return Row(length, Setting(reread), 4, agreement, 0.8, 1.0, None, 16.0, 0.5, 1.0, 0.01, 0,
               None, None, reread_s=speedup, switch_s=1.0)


FRONTIER = Frontier("t", "a", "b", 48, [
    row(48, 0, 0.92, 6.0), row(48, 8, 0.95, 4.0), row(48, 32, 0.99, 2.0),
    row(96, 0, 0.85, 8.0), row(96, 8, 0.91, 6.0), row(96, 32, 0.97, 3.0)])


def pair(kimi_pair, frontier=None, **options):
    a, b, paths = kimi_pair
    tr = artifact.load(paths[(a.name, b.name)])
    tr.frontier = frontier
    return Session({"a": a, "b": b}, {("a", "b"): tr}, active="a", **options), tr, a, b


def switched_at(s, a, tokens):
    s.add(tokens)
    list(s.generate(3))
    return s.switch("b")


def test_reread_r_equals_translating_the_head_and_reading_the_rest(kimi_pair):
    """With R = 24 the target holds the translation of all but the span's last 24 tokens and
    its own reading of those, as a plain translate-then-read would build it."""
    s, tr, a, b = pair(kimi_pair, reread=24, gate_tokens=0)
    status = switched_at(s, a, list(range(60, 110)))
    n = s.lines["a"].seen
    assert (status.status, status.reread, status.tokens_tail) == ("applied", 24, 24)
    assert status.tokens_translated == n - 24
    head = mx.array([s.tokens[:n - 24]])
    source = capture(a.model, head, points=tr.source_points())
    layout = kv.layout_of(b.model)
    cache = install(layout, *tr.translate(source, b.model, layout, head))
    # the switch's forward read the span's last 24 and the token after them
    mx.eval(b.model(mx.array([s.tokens[n - 24:n + 1]]), cache=cache))
    x = mx.array([[7, 8]])
    assert max_abs_diff(b.model(x, cache=s.lines["b"].cache), b.model(x, cache=cache)) <= 1e-4


def test_reread_beyond_the_span_is_a_native_reading(kimi_pair):
    s, _, a, b = pair(kimi_pair, reread=500)
    status = switched_at(s, a, list(range(60, 100)))
    assert status.tokens_translated == 0 and status.tokens_tail == s.lines["a"].seen
    native = make_prompt_cache(b.model)
    mx.eval(b.model(mx.array([s.tokens[:s.lines["b"].seen]]), cache=native))
    x = mx.array([[5, 6]])
    assert max_abs_diff(b.model(x, cache=s.lines["b"].cache), b.model(x, cache=native)) <= 1e-4


def test_fidelity_picks_the_cheapest_setting_that_meets_it(kimi_pair):
    s, _, a, _ = pair(kimi_pair, FRONTIER, fidelity=0.95, gate_tokens=0)
    status = switched_at(s, a, list(range(60, 100)))  # 42 tokens: the 48-token rows
    assert (status.reread, status.tokens_tail) == (8, 8)
    assert (status.expected_agreement, status.expected_speedup) == (0.95, 4.0)
    s, _, a, _ = pair(kimi_pair, FRONTIER, fidelity=0.95, gate_tokens=0)
    status = switched_at(s, a, list(range(60, 130)))  # 72 tokens: the 96-token rows
    assert (status.reread, status.expected_agreement) == (32, 0.97)


def test_fidelity_out_of_reach_rereads_visibly(kimi_pair):
    s, _, a, _ = pair(kimi_pair, FRONTIER, fidelity=0.999)
    status = switched_at(s, a, list(range(60, 100)))
    assert status.status == "fallback" and "fidelity 0.999" in status.reason
    s, _, a, _ = pair(kimi_pair, FRONTIER, fidelity=0.9)
    status = switched_at(s, a, list(range(0, 120)))  # past the longest measured length
    assert status.status == "fallback" and "measured only up to 96" in status.reason
    s, _, a, _ = pair(kimi_pair, None, fidelity=0.9)
    status = switched_at(s, a, list(range(60, 100)))
    assert status.status == "fallback" and "no measured frontier" in status.reason


def test_the_default_meets_ninety_percent_at_twice_the_fitting_length():
    class Tr:
        info = {"fit": {"length": 48}}
        frontier = FRONTIER
    assert dial.default_reread(Tr)[0] == 8  # at 96 tokens: R=8 reaches 0.91 fastest
    Tr.frontier = Frontier("t", "a", "b", 48, [row(96, 0, 0.7, 8.0), row(96, 32, 0.8, 3.0)])
    assert dial.default_reread(Tr)[0] == 32  # none reaches 0.9: the most faithful
    Tr.frontier = None
    assert dial.default_reread(Tr) == (0, "no frontier measured")


def test_a_state_reading_translator_stops_at_or_before_r_tokens_back(zoo):
    """A translator that reads the source's recurrent state stops at a state snapshot: with
    R = 32 the target still reads at least 32 tokens itself, and the gate judges its last."""
    src, tgt = zoo("qwen3.5-a"), zoo("qwen3.5-b")
    tr = artifact.load(artifact.shipped("qwen3.5-a", "qwen3.5-b"), src, tgt)
    assert kv.layouts.CapturePoint.ENGINE in tr.source_points()
    s = Session({"a": src, "b": tgt}, {("a", "b"): tr}, active="a", reread=32)
    s.add(src.tokenizer.encode("The ship sailed at dawn, and the crew " * 12))
    list(s.generate(12))
    status = s.switch("b")
    assert status.status == "applied", status
    assert 32 <= status.tokens_tail <= 64 and status.gate == "passed"


def test_session_refuses_both_knobs_and_bad_values(kimi_pair):
    for options in ({"reread": 8, "fidelity": 0.9}, {"reread": -1}, {"fidelity": 1.5},
                    {"fidelity": 0.0}):
        with pytest.raises(ValueError):
            pair(kimi_pair, **options)


def test_a_translator_loads_its_frontier_and_a_refit_drops_it(kimi_pair, tmp_path):
    import shutil

    from mlx_kvtrans.evaluation import frontier

    a, b, paths = kimi_pair
    directory = tmp_path / "tr"
    shutil.copytree(paths[(a.name, b.name)], directory)
    assert artifact.load(directory).frontier is None
    frontier.save(FRONTIER, directory)
    loaded = artifact.load(directory)
    assert [r.to_json() for r in loaded.frontier.rows] == [r.to_json() for r in FRONTIER.rows]
    artifact.save(loaded, directory, a, b)  # new weights: the old measurements go
    assert not (directory / "frontier.json").exists()


@pytest.mark.parametrize("command", [["chat", "--script", "/dev/null"], ["serve"]])
@pytest.mark.parametrize("options, message", [
    (["--reread", "8", "--fidelity", "0.9"], "not both"),
    (["--reread", "-1"], "--reread -1"),
    (["--fidelity", "1.5"], "--fidelity 1.5"),
    (["--fidelity", "0"], "--fidelity 0.0")])
def test_chat_and_serve_refuse_a_bad_dial_in_one_line(command, options, message):
    from typer.testing import CliRunner

    from mlx_kvtrans.cli.main import app

    result = CliRunner().invoke(app, command + options)
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output


def test_without_the_gate_a_state_reading_translator_still_keeps_r(zoo):
    """Gate off, R = 32: the source keeps a state snapshot R tokens back, so the target still
    reads at least R tokens itself."""
    src, tgt = zoo("qwen3.5-a"), zoo("qwen3.5-b")
    tr = artifact.load(artifact.shipped("qwen3.5-a", "qwen3.5-b"), src, tgt)
    s = Session({"a": src, "b": tgt}, {("a", "b"): tr}, active="a", reread=32, gate_tokens=0)
    s.add(src.tokenizer.encode("The ship sailed at dawn, and the crew " * 12))
    list(s.generate(12))
    status = s.switch("b")
    assert status.status == "applied" and 32 <= status.tokens_tail <= 64, status
    assert status.tokens_translated == s.lines["a"].seen - status.tokens_tail


def test_snapshots_stay_few_and_every_r_still_finds_one(zoo):
    """With the dial free to pick R = 8, 32 or 128, the source keeps a handful of state
    snapshots, not one every 8 tokens, and a switch at R = 128 still stops 128-256 back."""
    src, tgt = zoo("qwen3.5-a"), zoo("qwen3.5-b")
    tr = artifact.load(artifact.shipped("qwen3.5-a", "qwen3.5-b"), src, tgt)
    tr.frontier = Frontier("t", "a", "b", 256, [row(4096, r, 0.99 if r == 128 else 0.5, 2.0)
                                                for r in (8, 32, 128)])
    s = Session({"a": src, "b": tgt}, {("a", "b"): tr}, active="a", fidelity=0.95)
    s.add(src.tokenizer.encode("The ship sailed at dawn, and the crew " * 20))
    list(s.generate(120))
    assert len(s.lines["a"].states) <= 10
    status = s.switch("b")
    assert status.status == "applied" and status.reread == 128, status
    assert 128 <= status.tokens_tail <= 256


def test_the_default_setting_carries_the_recomputed_layers_its_frontier_chose():
    from mlx_kvtrans.translators.frontier import Frontier, Row, Setting

    def row(reread, recompute, agreement, speedup):
        return Row(length=192, setting=Setting(reread, recompute), windows=4,
                   agreement=agreement, agreement_last16=0.5, agreement_native=1.0,
                   history_recovered=None, greedy_match=0, greedy_exact=0, first_token=1,
                   kl=0, needles=0, recall_native=None, recall_translated=None,
                   reread_s=speedup, switch_s=1.0)

    class Tr:
        info = {"fit": {"length": 96}}
        frontier = Frontier("t", "a", "b", 96, [row(8, 0, 0.80, 10.0), row(8, 2, 0.93, 6.0),
                                                row(32, 0, 0.95, 3.0)])

    choice, _ = dial.choose(Tr, 150, None, None)
    assert (choice.reread, choice.recompute) == (8, 2)  # the cheapest that reaches 0.9
    fixed, _ = dial.choose(Tr, 150, None, None, recompute=0)
    assert (fixed.reread, fixed.recompute) == (32, 0)  # k fixed: R rises instead
    asked, _ = dial.choose(Tr, 150, None, 0.9)
    assert (asked.reread, asked.recompute) == (8, 2)
