"""`eval frontier`: a switch that loses nothing measures as native, the cheapest setting meeting
an agreement is picked from a frontier, and frontier.json round-trips beside its translator."""

import json
import shutil

import mlx.core as mx
import pytest
from typer.testing import CliRunner

import mlx_kvtrans as kv
from mlx_kvtrans.cli.main import app
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.evaluation import frontier as fr
from mlx_kvtrans.session import dial
from mlx_kvtrans.translators import frontier as translator_frontier
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.training.fit import FitConfig, fit
from mlx_kvtrans.training.plan import plan

LENGTH = 48


@pytest.fixture(scope="module")
def self_switch(loaded):
    """A tiny random qwen3 translated to itself (fitted in closed form: exact), and text."""
    lm = loaded("qwen3")
    layout = kv.layout_of(lm.model)
    batches = [mx.random.randint(0, 259, (4, LENGTH), key=mx.random.key(i)) for i in range(6)]
    translator = fit(lm.model, lm.model, batches, plan(layout, layout, point=1, nu=1,
                                                       features="all"),
                     FitConfig(point=1, ridge=1e-7))
    text = mx.random.randint(0, 259, (2000,), key=mx.random.key(7)).tolist()
    return lm, fr.Switch(translator, lm.model, lm.model), text


def test_self_translation_and_reread_measure_as_native(self_switch):
    lm, switch, text = self_switch
    settings = [fr.Setting(0), fr.Setting(8), fr.Setting(LENGTH)]  # R >= L - 1: re-reading
    rows = fr.measure(switch, lm.tokenizer.encode, text, {LENGTH: settings},
                      fr.FrontierConfig(prompts=2, needles=1, repeats=1))
    assert [r.setting for r in rows] == settings
    for r in rows:
        assert r.agreement == r.agreement_native == 1.0
        assert r.greedy_match == fr.GENERATED and r.greedy_exact == r.first_token == 1.0
        assert abs(r.kl) < 1e-4
        assert r.recall_translated == r.recall_native
        assert r.history_recovered == 1.0 and r.agreement_last16 < 1.0
        assert r.near_ties is None  # nothing parted from native
    full_reread = rows[-1]
    assert full_reread.kl == 0.0 and full_reread.speedup == 1.0


def test_a_cache_that_forgot_the_prompt_scores_below_native(self_switch):
    """A translator whose maps output zeros: agreement falls, KL rises."""
    lm, switch, text = self_switch
    tr = switch.translator
    zeroed = type(tr)(tr.source_point, tr.identity, tr.recipes,
                      {k: mx.zeros_like(v) for k, v in tr.params.items()}, tr.info)
    rows = fr.measure(fr.Switch(zeroed, lm.model, lm.model), lm.tokenizer.encode, text,
                      {LENGTH: [fr.Setting(0)]},
                      fr.FrontierConfig(prompts=2, needles=0, repeats=1))
    assert rows[0].agreement < 1.0 and rows[0].kl > 1e-3
    assert 0.0 <= rows[0].near_ties <= 1.0
    assert rows[0].recall_native is None and rows[0].recall_translated is None


def test_a_near_tie_is_two_likeliest_tokens_within_the_margin():
    logits = mx.array([[2.0, 2.0 - fr.TIE_NATS / 2, -1.0],  # within: a near tie
                       [-1.0, 2.0, 2.0 - 2 * fr.TIE_NATS],  # outside, whatever the order
                       [5.0, 0.0, 4.9]])
    assert fr.near_tie(logits).tolist() == [True, False, True]


def test_default_rereads_and_the_fitting_length():
    assert fr.default_rereads(256) == [8, 32, 128]  # the gate reads 8 at every switch
    assert fr.default_rereads(2048) == [8, 32, 128, 512]
    assert fr.Setting(254).applies(256) and not fr.Setting(255).applies(256)
    assert fr.Setting(8).translated(100) == 92 and fr.Setting(300).translated(100) == 0
    assert fr.fitting_length({"distill": {"config": {"max_prefix": 512}}}) == 512
    assert fr.fitting_length({"fit": {"length": 128}}) == 128
    # the longest prompt it learnt from: a distillation on longer prefixes than the fit
    assert fr.fitting_length({"fit": {"length": 256},
                              "distill": {"config": {"max_prefix": 512}}}) == 512
    assert fr.fitting_length({"fit": {"mix": [256, 2048]},
                              "distill": {"config": {"max_prefix": 512}}}) == 2048
    assert fr.fitting_length({"fit": {"mix": [256], "length": 256},
                              "distill": {"config": {"max_prefix": 512}}}) == 512
    assert fr.fitting_length({}) == translator_frontier.UNRECORDED_LENGTH == kv.FitConfig().length
    name = artifact.shipped("kimi-linear", "kimi-vl")
    assert fr.fitting_length(artifact.read_manifest(name)) == 256
    # fitted on windows up to 2,048: its default is read at the longest length measured, not
    # at twice that, where nothing is known
    served = artifact.load(artifact.shipped("qwen3-small", "qwen3-large"))
    assert fr.fitting_length(served.info) == 2048
    reread, how = dial.default_reread(served)
    assert reread >= 8 and "at 2048 tokens" in how


def test_history_recovered_is_the_share_above_the_floor():
    assert fr.history_recovered(0.9, 0.8) == pytest.approx(0.5)
    assert fr.history_recovered(0.8, 0.8) == 0.0
    assert fr.history_recovered(0.7, 0.8) < 0  # worse than reading the last 16 tokens
    assert fr.history_recovered(1.0, 1.0) is None


def row(length, reread, agreement, speedup):
    return fr.Row(length=length, setting=fr.Setting(reread), windows=4, agreement=agreement,
                  agreement_last16=0.8, agreement_native=1.0, history_recovered=None,
                  greedy_match=20.0, greedy_exact=0.25, first_token=1.0, kl=0.01, needles=4,
                  recall_native=1.0, recall_translated=0.5, reread_s=speedup, switch_s=1.0)


SYNTHETIC = [row(256, 0, 0.93, 8.0), row(256, 8, 0.95, 6.0), row(256, 32, 0.97, 3.0),
             row(256, 128, 0.99, 0.9),  # slower than re-reading: never chosen
             row(512, 0, 0.88, 9.0), row(512, 32, 0.91, 5.0), row(512, 128, 0.96, 2.0)]


def test_cheapest_is_the_fastest_setting_meeting_the_agreement():
    assert fr.cheapest(SYNTHETIC, 0.90, 256) == fr.Setting(0)
    assert fr.cheapest(SYNTHETIC, 0.95, 256) == fr.Setting(8)
    assert fr.cheapest(SYNTHETIC, 0.96, 256) == fr.Setting(32)
    assert fr.cheapest(SYNTHETIC, 0.985, 256) is None  # only a setting slower than re-reading
    assert fr.cheapest(SYNTHETIC, 0.985, 256, min_speedup=0.5) == fr.Setting(128)
    assert fr.cheapest(SYNTHETIC, 0.90, 512) == fr.Setting(32)
    assert fr.cheapest_row(SYNTHETIC, 0.95, 512).speedup == 2.0


def test_cheapest_reads_the_next_measured_length_and_nothing_past_the_last():
    assert fr.cheapest(SYNTHETIC, 0.95, 100) == fr.Setting(8)  # read at 256
    assert fr.cheapest(SYNTHETIC, 0.95, 300) == fr.Setting(128)  # read at 512: cautious
    assert fr.cheapest(SYNTHETIC, 0.50, 513) is None  # never measured
    frontier = fr.Frontier("t", "a", "b", 256, SYNTHETIC)
    assert fr.cheapest(frontier, 0.95, 256) == fr.Setting(8)


def test_frontier_json_round_trips_and_refuses_to_overwrite(tmp_path):
    frontier = fr.Frontier("t", "a", "b", 256, SYNTHETIC, {"prompts": 4}, None)
    path = fr.save(frontier, tmp_path)
    assert path == tmp_path / fr.FILE
    back = fr.load(tmp_path)
    assert back == frontier and back.rows[0].setting == fr.Setting(0)
    assert json.loads(path.read_text())["rows"][1]["speedup"] == 6.0
    with pytest.raises(KvtransError, match="already exists"):
        fr.save(frontier, tmp_path)
    fr.save(fr.Frontier("t", "a", "b", 256, SYNTHETIC[:1]), tmp_path, force=True)
    assert len(fr.load(path).rows) == 1
    path.write_text("{}")
    with pytest.raises(KvtransError, match="not a readable frontier"):
        fr.load(tmp_path)
    with pytest.raises(KvtransError, match="no frontier.json"):
        fr.load(tmp_path / "elsewhere")


def test_a_frontier_of_other_weights_is_refused(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"one")
    fr.save(fr.Frontier("t", "a", "b", 256, SYNTHETIC, weights_sha256="0" * 64), tmp_path)
    with pytest.raises(KvtransError, match="other weights"):
        fr.load(tmp_path)


def test_cli_records_a_frontier_in_the_translator_and_refuses_to_replace_it(tmp_path):
    directory = tmp_path / "pair"
    shutil.copytree(artifact.shipped("qwen3-large", "qwen3-small"), directory)
    (directory / fr.FILE).unlink(missing_ok=True)  # the shipped one's own
    args = ["eval", "frontier", "--translator", str(directory), "--lengths", "64",
            "--rereads", "8,100", "--prompts", "2", "--needles", "1", "--repeats", "1",
            "--record"]
    result = CliRunner().invoke(app, args + ["--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    # 100 re-reads it all at 64 tokens
    assert [r["setting"]["reread"] for r in printed["rows"]] == [8]
    recorded = fr.load(directory)
    assert recorded.fit_length == 256 and recorded.rows[0].setting == fr.Setting(8)
    assert all(0.0 <= r.agreement <= 1.0 and r.speedup > 0 for r in recorded.rows)
    artifact.read_manifest(directory)  # the translator still verifies
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "already exists" in again.output
    bad = CliRunner().invoke(app, args[:6] + ["--rereads", "63,64"])
    assert bad.exit_code == 2 and "re-reads the whole prompt" in bad.output


PAIR = "qwen3-large__qwen3-small-distilled"


@pytest.mark.parametrize("extra,message", [
    ([], "--translator"),
    (["--translator", PAIR, "--lengths", "8"], "at least 18"),
    (["--translator", PAIR, "--lengths", "99999999"], "at most"),
    (["--translator", PAIR, "--rereads", "x"], "integers"),
    (["--translator", PAIR, "--rereads", "-1"], "at least 0"),
    (["--translator", PAIR, "--rereads", "0,8"], "gate reads the prompt's last 8 tokens"),
    (["--translator", PAIR, "--prompts", "0"], "--prompts"),
    (["--translator", "no-such-translator"], "not found"),
])
def test_cli_refuses_bad_input_in_one_line(extra, message):
    result = CliRunner().invoke(app, ["eval", "frontier", *extra])
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output and result.output.count("\n") == 1


def test_cli_refuses_an_existing_out_file_before_measuring(tmp_path):
    existing = tmp_path / "frontier.json"
    existing.write_text("{}")
    result = CliRunner().invoke(app, ["eval", "frontier", "--translator", PAIR, "--out",
                                      str(existing)])
    assert result.exit_code == 2 and "--force" in result.output
    assert existing.read_text() == "{}"


def test_a_session_switch_builds_the_cache_the_plain_switch_does(kimi_pair):
    """The frontier measures through a `Session` (as users switch); without the gate it holds
    what translating all but R tokens and reading those does."""
    from mlx_kvtrans.evaluation.frontier import SessionSwitch, Setting, Switch
    from mlx_kvtrans.translators import artifact
    from mlx_kvtrans.tools.verify import max_abs_diff

    a, b, paths = kimi_pair
    tr = artifact.load(paths[(a.name, b.name)])
    plain, via = Switch(tr, a.model, b.model), SessionSwitch(tr, a, b, gate_tokens=0)
    prefix = list(range(60, 110))
    x = mx.array([[5, 6, 7]])
    for r in (0, 8, 24):
        assert max_abs_diff(b.model(x, cache=plain.cache(Setting(r), prefix)),
                            b.model(x, cache=via.cache(Setting(r), prefix))) <= 1e-4
        assert [st.tokens_tail for st in via.statuses[Setting(r)]] == [r]


def test_a_setting_with_recomputed_layers_labels_and_round_trips_and_an_old_one_reads_alike():
    assert fr.Setting(8).to_json() == {"reread": 8}  # frontiers written before the knob
    assert fr.Setting(8, 2).to_json() == {"reread": 8, "recompute": 2}
    assert fr.Setting.from_json({"reread": 8}) == fr.Setting(8)
    assert fr.Setting.from_json(fr.Setting(8, 2).to_json()) == fr.Setting(8, 2)
    assert fr.Setting(8, 2).label() == "R=8 k=2" and fr.Setting(8).label() == "R=8"


def test_cli_frontier_measures_each_recompute_with_every_reread(tmp_path):
    args = ["eval", "frontier", "--translator", PAIR, "--lengths", "64", "--rereads", "8",
            "--recompute", "0,4", "--prompts", "2", "--needles", "1", "--repeats", "1", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert [(r["setting"]["reread"], r["setting"].get("recompute", 0)) for r in rows] == \
        [(8, 0), (8, 4)]
    # qwen3-small has 4 layers: recomputing them all is native
    assert rows[1]["agreement"] == pytest.approx(rows[1]["agreement_native"], abs=1e-9)
    bad = CliRunner().invoke(app, args[:-1][:8] + ["--recompute", "5"])
    assert bad.exit_code == 2 and "has 4 layers" in bad.output


def test_the_own_cache_at_8_bits_stays_nearer_native_than_at_4(zoo):
    """mlx-lm's KV quantization of the target's own cache, scored as a switch is."""
    lm = zoo("qwen3-small")
    text = mx.random.randint(0, 259, (1000,), key=mx.random.key(3)).tolist()
    eight, four = (fr.quantized_reference(lm.model, text, [LENGTH], bits, prompts=2)[LENGTH]
                   for bits in (8, 4))
    assert 0 <= eight["kl"] < 1e-3 and eight["kl"] < four["kl"]
    assert eight["first_token"] == 1.0 and eight["agreement"] >= four["agreement"]
    assert 0 <= eight["greedy_match"] <= fr.GENERATED


def test_an_mla_cache_mlx_lm_cannot_quantize_is_refused(zoo):
    lm = zoo("kimi-vl")
    with pytest.raises(ValueError, match="MLA"):
        fr.quantized_reference(lm.model, list(range(200)), [LENGTH], 8, prompts=1)
