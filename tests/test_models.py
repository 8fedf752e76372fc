"""Model directories: written offline, loaded by mlx-lm, tokenizer usable; the resolver."""

import mlx_lm
import pytest

import mlx_kvtrans as kv
from mlx_kvtrans.errors import ModelNotFoundError
from mlx_kvtrans.models import resolve
from mlx_kvtrans.zoo.families import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_model_loads_offline_with_a_working_tokenizer(model_dirs, family, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = mlx_lm.load(str(model_dirs(family)))
    ids = tokenizer.encode("The needle is 418207.")
    assert ids and tokenizer.decode(ids) == "The needle is 418207."
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True)
    assert tokenizer.decode(chat).endswith("<|im_start|>assistant\n")


def test_mlx_lm_generate_on_a_random_model_is_its_greedy_continuation(loaded):
    """mlx-lm's own generation loop continues our random model exactly as a plain greedy loop
    over its forward pass does."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    lm = loaded("kimi_linear")
    text = mlx_lm.generate(lm.model, lm.tokenizer, "Once upon a time", max_tokens=5)
    cache = make_prompt_cache(lm.model)
    logits = lm.model(mx.array([lm.tokenizer.encode("Once upon a time")]), cache=cache)[:, -1]
    greedy = []
    for _ in range(5):
        greedy.append(int(mx.argmax(logits, axis=-1)))
        logits = lm.model(mx.array([greedy[-1:]]), cache=cache)[:, -1]
    assert text == lm.tokenizer.decode(greedy)


def test_resolver_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KVTRANS_WEIGHTS", str(tmp_path / "no-zoo"))
    with pytest.raises(ModelNotFoundError):
        resolve("not-a-model")
    with pytest.raises(ModelNotFoundError):
        resolve("some-org/some-model-that-is-not-cached")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ModelNotFoundError):
        resolve(str(tmp_path / "file.txt"))


def test_zoo_alias_resolves_to_weights_dir(model_dirs, tmp_path, monkeypatch):
    import shutil

    shutil.copytree(model_dirs("qwen3"), tmp_path / "tiny-qwen3")
    monkeypatch.setenv("KVTRANS_WEIGHTS", str(tmp_path))
    assert resolve("tiny-qwen3") == tmp_path / "tiny-qwen3"
    assert kv.load("tiny-qwen3").model_type == "qwen3"
