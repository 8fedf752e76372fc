"""Quantized checkpoints, as users hold them: mlx-lm's own conversions of the zoo's models
(`mlx_lm.convert`), served by the translators fitted on the unquantized weights and refused
for other weights of the same config."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_kvtrans as kv
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.models import lineage, lineage_difference, load_config_only
from mlx_kvtrans.session import Session
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.training.cost import weights_bytes
from mlx_kvtrans.zoo.random_model import write_random_model


def quantized(source: Path, out: Path, bits: int = 4, mode: str = "affine") -> Path:
    from mlx_lm.convert import convert

    if not out.is_dir():
        convert(hf_path=str(source), mlx_path=str(out), quantize=True, q_bits=bits,
                q_group_size=32 if mode == "affine" else None, q_mode=mode)
    return out


@pytest.fixture(scope="module")
def zoo_4bit(tmp_path_factory):
    from mlx_kvtrans.models import weights_dir

    root = tmp_path_factory.mktemp("quantized")
    found = {name: quantized(weights_dir() / name, root / f"{name}-4bit")
             for name in ("kimi-linear", "kimi-vl")}
    found["kimi-vl 8-bit"] = quantized(weights_dir() / "kimi-vl", root / "kimi-vl-8bit", bits=8)
    # kimi-vl's config with other weights (its tokenizer too)
    config = json.loads((weights_dir() / "kimi-vl" / "config.json").read_text())
    other = write_random_model("kimi_vl", root / "other", seed=5, config=config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(weights_dir() / "kimi-vl" / name, other / name)
    found["other weights"] = other
    return found


def test_a_quantization_keeps_the_lineage_and_other_weights_do_not(zoo_4bit):
    kimi_vl = lineage(kv.load("kimi-vl").model)
    # re-quantizing the recorded rows reproduces the 4- and 8-bit checkpoints' packed rows
    assert lineage_difference(kimi_vl, kv.load(str(zoo_4bit["kimi-vl"])).model) == ""
    assert lineage_difference(kimi_vl, kv.load(str(zoo_4bit["kimi-vl 8-bit"])).model) == ""
    # and the other way: a translator fitted on the 4-bit checkpoint knows the original
    assert lineage_difference(lineage(kv.load(str(zoo_4bit["kimi-vl"])).model),
                              kv.load("kimi-vl").model) == ""
    assert lineage_difference(kimi_vl, kv.load(str(zoo_4bit["other weights"])).model) != ""
    # a fine-tune of the same config (the zoo's "next generation")
    assert lineage_difference(lineage(kv.load("qwen3.5-a").model), kv.load("qwen3.5-b").model)


def test_one_changed_matrix_is_another_model(zoo_4bit):
    """A merged LoRA fine-tune of the target changes one matrix and no file's first megabyte."""
    src, tgt = kv.load("kimi-linear"), kv.load("kimi-vl")
    path = artifact.shipped("kimi-linear", "kimi-vl")
    attn = tgt.model.language_model.model.layers[3].self_attn
    name = "q_b_proj" if hasattr(attn, "q_b_proj") else "q_proj"
    weight = getattr(attn, name).weight
    getattr(attn, name).weight = weight + 0.01 * mx.random.normal(weight.shape, key=mx.random.key(0))
    with pytest.raises(KvtransError, match=f"layers.3.self_attn.{name}.weight differs"):
        artifact.load(path, src, tgt)


def test_the_shipped_translator_serves_the_4bit_pair_and_says_so(zoo_4bit):
    src, tgt = kv.load(str(zoo_4bit["kimi-linear"])), kv.load(str(zoo_4bit["kimi-vl"]))
    path = artifact.shipped_for(src, tgt)
    assert path == artifact.shipped("kimi-linear", "kimi-vl")
    translator = artifact.load(path, src, tgt)
    assert "4-bit affine quantization (group 32) of kimi-vl" in translator.info["fitted_on"]
    session = Session({src.name: src, tgt.name: tgt}, {(src.name, tgt.name): translator})
    tok, stop = src.tokenizer, set(src.tokenizer.eos_token_ids)

    def say(text: str) -> str:
        session.add(tok.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True))
        reply = [t for t in session.generate(16, stop=stop) if t not in stop]
        session.add(tok.encode("\n", add_special_tokens=False))
        return tok.decode(reply)

    say("The number for pepper is 552190.")
    status = session.switch(tgt.name)
    assert status.status == "applied" and "quantization" in status.translator_note
    assert "552190" in say("What was the number for pepper?")


def test_other_weights_of_the_same_config_stay_refused(zoo_4bit):
    path = artifact.shipped("kimi-linear", "kimi-vl")
    src, seed = kv.load(str(zoo_4bit["kimi-linear"])), kv.load(str(zoo_4bit["other weights"]))
    with pytest.raises(KvtransError, match="different model"):
        artifact.load(path, src, seed)
    assert artifact.shipped_for(src, seed) is None


def test_a_fit_and_a_switch_run_on_quantized_models(model_dirs, tmp_path):
    from mlx_kvtrans.training.fit import FitConfig
    from mlx_kvtrans.training.workflows import fit_translator

    src_dir = quantized(model_dirs("kimi_linear"), tmp_path / "kl-8bit", bits=8)
    tgt_dir = quantized(model_dirs("kimi_vl"), tmp_path / "kv-4bit")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 97} and {i % 13}." for i in range(3000)))
    config = FitConfig(windows=8, length=48, token_identity="ids")
    translator = fit_translator(str(src_dir), str(tgt_dir), [text], config,
                                out=tmp_path / "tr", gate_windows=1)
    src, tgt = kv.load(str(src_dir)), kv.load(str(tgt_dir))
    loaded = artifact.load(tmp_path / "tr", src, tgt)
    assert loaded.params.keys() == translator.params.keys() and "fitted_on" not in loaded.info
    session = Session({src.name: src, tgt.name: tgt}, {(src.name, tgt.name): loaded})
    session.add(src.tokenizer.encode(" ".join(f"word{i} and {i % 13}." for i in range(20))))
    list(session.generate(4))  # the source reads what it was given
    status = session.switch(tgt.name)
    assert status.tokens_translated > 0 and status.status in ("applied", "fallback_gate")
    # the unquantized pair it quantizes is served too, with the note
    unquantized = artifact.load(tmp_path / "tr", kv.load(str(model_dirs("kimi_linear"))),
                                kv.load(str(model_dirs("kimi_vl"))))
    assert "a conversion of" in unquantized.info["fitted_on"]


def test_a_plan_counts_a_quantized_checkpoint_at_its_size(zoo_4bit, tmp_path):
    """What a plan holds for weights is the checkpoint's bytes: its files where they are, and
    from a quantized config.json alone (a plan made before downloading) within 5% of them."""
    directory = zoo_4bit["kimi-vl"]
    on_disk = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    assert weights_bytes(kv.load(str(directory))) == on_disk
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((directory / "config.json").read_text())
    assert abs(weights_bytes(load_config_only(str(config_only))) / on_disk - 1) < 0.05
