"""The zoo's tokenizer files: a byte-level tokenizer with ChatML turns that mlx-lm loads offline.

mlx-lm needs `tokenizer.json` *and* `tokenizer_config.json`: without the latter transformers returns
an empty tokenizer that encodes everything to `[]`, silently.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """A byte-level BPE with no merges: 256 byte tokens, then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: byte for byte, ch in _bytes_to_unicode().items()}  # token id = byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def train_bpe(texts, vocab_size: int = 4096):
    """A byte-level BPE trained on `texts` (an iterator of strings), every digit its own token.

    Single-digit tokens make a six-digit code exactly six tokens, so copying it is measurable
    digit by digit. 4,096 rather than 8K entries: at hidden 128 the tied embedding of an 8K
    vocabulary would be half of a zoo model's weights and most of its output-layer time.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table of printable stand-ins for the 256 bytes, which byte-level BPE uses."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


def special_token_ids(tok) -> dict[str, int]:
    """The ids a model config names: generation stops at the end of a turn."""
    return {"bos_token_id": tok.token_to_id("<|endoftext|>"),
            "eos_token_id": tok.token_to_id("<|im_end|>"),
            "pad_token_id": tok.token_to_id("<|endoftext|>")}


def save_tokenizer(tok, directory: str | Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` (with the chat template) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
