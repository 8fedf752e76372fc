"""`kvtrans audit`: token identity read back from caches, an honest split, and caches at rest
(prompt-cache files 0600, GGUF checkpoints loaded exactly)."""

import os
import stat

import mlx.core as mx
import numpy as np
import pytest

import mlx_kvtrans as kv
from mlx_kvtrans.tools.audit import LinearReadout, audit, held_out_tokens
from mlx_kvtrans.files import write_private


@pytest.fixture(scope="module")
def mla(loaded):
    return loaded("kimi_vl")


def _row(result, layer, name):
    return next(r for r in result.rows if (r.layer, r.object) == (layer, name))


def test_audit_decodes_mla_layer_zero_exactly(mla):
    fit, score = held_out_tokens(mla.tokenizer, 768)
    result = audit(mla, fit, score, window=128)
    latent = _row(result, 0, "latent")
    assert latent.point == 3 and latent.codebook == 1.0
    assert latent.readout > 0.85 * result.ceiling
    assert latent.nearest_mean == pytest.approx(result.ceiling)  # exact for every id it saw
    assert _row(result, 1, "latent").codebook is None  # deeper latents mix positions


def test_audit_scores_only_tokens_it_did_not_fit_on(mla):
    """Score tokens the fit never saw: no read-out can name them, the codebook still can."""
    fit, score = [t % 128 for t in range(97, 353)], [128 + t % 128 for t in range(256)]
    result = audit(mla, fit, score, window=64)
    latent = _row(result, 0, "latent")
    assert result.ceiling == 0.0 and latent.readout == 0.0 and latent.nearest_mean == 0.0
    assert latent.codebook == 1.0


def test_audit_reports_fixed_size_objects_as_not_per_token(loaded):
    lm = loaded("qwen3_5")
    result = audit(lm, list(range(40, 104)), list(range(40, 104)), window=32, codebook=False)
    kinds = {r.kind: r for r in result.rows}
    assert kinds["recurrent_state"].readout is None and kinds["recurrent_state"].point is None
    assert kinds["conv_history"].point == 1 and kinds["conv_history"].readout is not None


def test_readout_of_random_features_scores_near_chance():
    """Rows of no information: held out, the read-out does no better than always answering the
    commonest id, although on its own fit split it would look informative."""
    rng = np.random.default_rng(0)
    classes = 50
    prior = 1.0 / np.arange(1, classes + 1)
    prior /= prior.sum()
    fit_ids, score_ids = (rng.choice(classes, size=n, p=prior) for n in (512, 4096))
    fit_x, score_x = (rng.standard_normal((n, 256)).astype(np.float32) for n in (512, 4096))
    readout = LinearReadout(256, np.unique(fit_ids))
    readout.add(fit_x, fit_ids)
    readout.solve()
    majority = np.mean(score_ids == np.bincount(fit_ids).argmax())
    held_out = np.mean(readout.predict(score_x) == score_ids)
    assert held_out <= majority + 0.03
    assert np.mean(readout.predict(fit_x) == fit_ids) > majority + 0.3


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_prompt_cache_files_are_private(loaded, tmp_path):
    lm = loaded("qwen3")
    cap = kv.capture(lm.model, mx.array([5, 6, 7, 8]))
    previous = os.umask(0o022)
    try:
        path = kv.write_prompt_cache(tmp_path / "c.safetensors", kv.install(lm.model, cap.at(3)),
                                     str(lm.path))
        assert _mode(path) == 0o600
        path.chmod(0o644)  # an existing readable file is replaced, not kept readable
        kv.write_prompt_cache(path, kv.install(lm.model, cap.at(3)), str(lm.path))
        assert _mode(path) == 0o600
        bare = kv.write_prompt_cache(tmp_path / "bare", kv.install(lm.model, cap.at(3)),
                                     str(lm.path))
    finally:
        os.umask(previous)
    assert bare.name == "bare.safetensors" and _mode(bare) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare.safetensors", "c.safetensors"]
    caches, _ = kv.read_prompt_cache(path, lm.model)
    assert len(caches) == len(kv.layout_of(lm.model).layers)


def test_write_private_is_owner_only_and_leaves_nothing_on_failure(tmp_path):
    path = write_private(tmp_path / "transcript.json", "{}")
    assert _mode(path) == 0o600 and path.read_text() == "{}"
    with pytest.raises(OSError):
        write_private(tmp_path / "missing" / "t.json", "{}")
    assert [p.name for p in tmp_path.iterdir()] == ["transcript.json"]


def _llama_cpp_order(w: mx.array, heads: int) -> mx.array:
    """Rows of a Q or K projection as llama.cpp's converter stores them: each head's two
    halves interleaved, so that RoPE on adjacent pairs rotates what the halves-RoPE did."""
    out, dim = w.shape
    return w.reshape(heads, 2, out // heads // 2, dim).swapaxes(1, 2).reshape(out, dim)


def test_gguf_checkpoint_reproduces_its_model_logits(tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import pre_tokenizers

    from mlx_kvtrans.tools.gguf import load_gguf

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["Ġt", "<|endoftext|>"]
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=len(tokens), rope_theta=10000.0)
    mx.random.seed(0)
    reference = llama.Model(args)
    params = dict(tree_flatten(reference.parameters()))
    gguf_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                  "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                  "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                  "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down"}
    tensors = {"token_embd.weight": params["model.embed_tokens.weight"],
               "output_norm.weight": params["model.norm.weight"]}
    for i in range(args.num_hidden_layers):
        for name, short in gguf_names.items():
            w = params[f"model.layers.{i}.{name}.weight"]
            if short in ("attn_q", "attn_k"):
                w = _llama_cpp_order(w, args.num_attention_heads if short == "attn_q"
                                     else args.num_key_value_heads)
            tensors[f"blk.{i}.{short}.weight"] = w
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    metadata = {"general.architecture": "llama", "llama.embedding_length": u32(64),
                "llama.block_count": u32(2), "llama.feed_forward_length": u32(96),
                "llama.attention.head_count": u32(4), "llama.attention.head_count_kv": u32(2),
                "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
                "llama.rope.freq_base": mx.array(10000.0), "llama.context_length": u32(512),
                "llama.vocab_size": u32(len(tokens)), "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["Ġ t"],
                "tokenizer.ggml.eos_token_id": u32(len(tokens) - 1)}
    mx.save_gguf(str(tmp_path / "tiny.gguf"), tensors, metadata)

    lm = load_gguf(tmp_path / "tiny.gguf")
    ids = lm.tokenizer.encode("to the tower")
    assert ids and alphabet.index("Ġ") not in ids  # " t" merged
    x = mx.array(ids)[None]
    assert mx.allclose(lm.model(x), reference(x), atol=1e-4)
    assert kv.layout_of(lm.model).layers[0].objects[0].rotation.interleaved


def test_audit_command(model_dirs, tmp_path):
    import json

    from typer.testing import CliRunner

    from mlx_kvtrans.cli.main import app

    run = lambda *args: CliRunner().invoke(app, ["audit", *map(str, args)])  # noqa: E731
    result = run(model_dirs("deepseek_v3"), "--tokens", 256, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["rows"][0]["codebook"] == 1.0 and "0600" in data["storage"]
    assert "occur in the fit split" in data["one_hot"]
    table = run(model_dirs("deepseek_v3"), "--tokens", 256)
    assert table.exit_code == 0 and "0600" in table.output and "codebook" in table.output
    missing = run(tmp_path / "none.gguf")
    assert missing.exit_code == 2 and "no such GGUF file" in missing.output
