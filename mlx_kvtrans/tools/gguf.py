"""A llama-architecture GGUF checkpoint (llama.cpp's format) as an mlx-lm `llama.Model`.

`mx.load` reads GGUF tensors and metadata; quantized tensors come as (weight, scales, biases)
triplets, dequantised here to float32. llama.cpp's converter permutes the rows of Q and K so that
its RoPE rotates adjacent pairs: `rope_traditional=True` rotates the same pairs, so the weights
are used as stored and the cached keys hold their features in that order.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..errors import KvtransError
from ..models import LoadedModel

GGML_GROUP = 32  # every ggml block format mlx reads (Q4_0, Q4_1, Q8_0) has 32 weights a block
CONTROL_TOKEN = 3  # tokenizer.ggml.token_type of special tokens

_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _scalar(metadata: dict, key: str):
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def _mlx_name(name: str) -> str:
    if name == "token_embd":
        return "model.embed_tokens"
    if name == "output_norm":
        return "model.norm"
    if name == "output":
        return "lm_head"
    _, layer, tensor = name.split(".", 2)
    return f"model.layers.{layer}.{_NAMES[tensor]}"


def _weights(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """GGUF tensors -> mlx-lm llama parameter names, float32."""
    out = {}
    for key, value in tensors.items():
        name, kind = key.rsplit(".", 1)
        if kind in ("scales", "biases"):
            continue
        if f"{name}.scales" in tensors:
            scales = tensors[f"{name}.scales"]
            bits = value.shape[-1] * 32 // (scales.shape[-1] * GGML_GROUP)
            value = mx.dequantize(value, scales, tensors[f"{name}.biases"],
                                  group_size=GGML_GROUP, bits=bits)
        out[f"{_mlx_name(name)}.{kind}"] = value.astype(mx.float32)
    return out


def _config(metadata: dict, tied: bool) -> dict:
    get = lambda key: _scalar(metadata, f"llama.{key}")  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    return {"model_type": "llama", "hidden_size": hidden,
            "num_hidden_layers": int(get("block_count")),
            "intermediate_size": int(get("feed_forward_length")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv")),
            "head_dim": int(metadata.get("llama.rope.dimension_count", hidden // heads)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
            "vocab_size": int(metadata.get("llama.vocab_size",
                                           len(metadata["tokenizer.ggml.tokens"]))),
            "rope_theta": float(metadata.get("llama.rope.freq_base", 10000.0)),
            "rope_traditional": True,
            "max_position_embeddings": int(get("context_length")),
            "tie_word_embeddings": tied}


def _tokenizer(metadata: dict):
    """The GGUF's byte-level BPE as mlx-lm's tokenizer wrapper. Pre-tokenisation as llama.cpp's
    gpt2-style types do it: digits one at a time, then GPT-2's regex."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise KvtransError(f"GGUF tokenizer {metadata.get('tokenizer.ggml.model')!r}: only "
                           "byte-level BPE (gpt2) is supported")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    backend.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type")
    special = [] if types is None else [tokens[i] for i, t in enumerate(types.tolist())
                                        if t == CONTROL_TOKEN]
    token = lambda key: tokens[int(_scalar(metadata, key))] if key in metadata else None  # noqa: E731
    hf = PreTrainedTokenizerFast(tokenizer_object=backend,
                                 bos_token=token("tokenizer.ggml.bos_token_id"),
                                 eos_token=token("tokenizer.ggml.eos_token_id"),
                                 pad_token=token("tokenizer.ggml.padding_token_id"),
                                 additional_special_tokens=special)
    if "tokenizer.chat_template" in metadata:
        hf.chat_template = metadata["tokenizer.chat_template"]
    return TokenizerWrapper(hf)


def load_gguf(path: str | Path) -> LoadedModel:
    """A llama-architecture .gguf file as a loaded mlx-lm model with its tokenizer."""
    from mlx_lm.models import llama

    path = Path(path).expanduser()
    if not path.is_file():
        raise KvtransError(f"{path}: no such GGUF file")
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
    except Exception as err:
        raise KvtransError(f"{path} is not a GGUF file mlx can read ({err})") from None
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise KvtransError(f"{path}: GGUF architecture {architecture!r}; only llama is supported")
    weights = _weights(tensors)
    config = _config(metadata, tied="lm_head.weight" not in weights)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return LoadedModel(str(path), path, model, _tokenizer(metadata), config)
