"""The relay: a target's own layers read a switch's span again from the source's recorded hidden
state. Fed a model's own hidden state, its layers rebuild its own cache exactly; through a
`Session`, the source records the hidden state a relay reads and the switch runs it; a pair
whose translation copies the history as the target's own cache does gets no relay, and one the
relay cannot run on says why."""

from __future__ import annotations

import copy
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_kvtrans
from mlx_kvtrans.capture import RESIDUAL, capture
from mlx_kvtrans.session import Session
from mlx_kvtrans.training import relay_choice
from mlx_kvtrans.translators import artifact, relay
from mlx_kvtrans.translators.relay import Relay

PROMPT = 40


def prompt_of(lm, n: int = PROMPT, seed: int = 0) -> list[int]:
    text = (mlx_kvtrans.models.held_out_split("test").read_text()[seed * 997:])
    return lm.tokenizer.encode(text)[:n]


def native(model, tokens: list[int]) -> list:
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def same_caches(a: list, b: list, atol: float = 1e-4) -> bool:
    def rows(c):
        return [x[..., :c.offset, :].astype(mx.float32) for x in (c.keys, c.values)]

    return all(ca.offset == cb.offset and float(mx.abs(x - y).max()) <= atol
               for ca, cb in zip(a, b) for x, y in zip(rows(ca), rows(cb)))


@pytest.fixture(scope="module")
def self_translator(zoo):
    """qwen3-small -> itself, fitted in closed form on a few random windows."""
    from mlx_kvtrans.training.fit import fit
    from mlx_kvtrans.training.plan import plan

    lm = zoo("qwen3-small")
    layout = mlx_kvtrans.layout_of(lm.model)
    batches = [mx.random.randint(0, 259, (4, 48), key=mx.random.key(i)) for i in range(3)]
    return lm, fit(lm.model, lm.model, batches, plan(layout, layout))


def test_the_hidden_state_entering_layer_0_is_the_embedding(zoo):
    lm = zoo("qwen3-small")
    tokens = prompt_of(lm)
    found = capture(lm.model, tokens, points=(), residuals=[0, 2]).objects
    embedded = lm.model.model.embed_tokens(mx.array(tokens)[None])
    assert float(mx.abs(found[0][RESIDUAL] - embedded).max()) == 0.0
    assert found[2][RESIDUAL].shape == embedded.shape and RESIDUAL not in found[1]


@pytest.mark.parametrize("first,last", [(0, 3), (1, 2), (3, 3)])
def test_a_models_own_hidden_state_rebuilds_its_cache(first, last, zoo):
    lm = zoo("qwen3-small")
    tokens = prompt_of(lm)
    own = native(lm.model, tokens)
    rebuilt = copy.deepcopy(own)
    for i in range(first, last + 1):  # what the relay overwrites starts out wrong
        rebuilt[i].keys[..., 8:, :] = 0
    h = capture(lm.model, tokens[8:], points=(), cache=native(lm.model, tokens[:8]),
                residuals=[first]).objects[first][RESIDUAL]
    relay.run(lm.model, rebuilt, h, Relay(first, last, first))
    assert same_caches(rebuilt, own)


def test_a_switch_runs_the_relay_from_what_the_source_recorded(self_translator):
    lm, translator = self_translator
    layers = len(lm.model.model.layers)
    noisy = replace(translator, params={k: v + 0.5 for k, v in translator.params.items()})
    relayed = replace(noisy, info={**noisy.info, "relay": {"chosen": [0, layers - 1, 0]}})
    tokens = prompt_of(lm, seed=1)
    caches = {}
    for name, tr in (("noisy", noisy), ("relayed", relayed)):
        session = Session({"a": lm, "b": lm}, {("a", "b"): tr}, active="a", gate_tokens=0)
        session.add(tokens, model="b")
        list(session.generate(0))
        status = session.switch("b")
        assert status.layers_relayed == (layers if name == "relayed" else 0)
        caches[name] = session.lines["b"].cache
    own = native(lm.model, tokens)
    assert not same_caches(caches["noisy"], own)  # the translation alone is far off
    assert same_caches(caches["relayed"], own)  # every layer read again from the embedding


def test_a_translation_that_copies_well_needs_no_relay(self_translator):
    lm, translator = self_translator
    ids = lm.tokenizer.encode(mlx_kvtrans.models.held_out_split("validation").read_text())
    record = relay_choice.choose(translator, lm.model, lm.model, ids, windows=2, length=128)
    assert record["chosen"] is None and abs(record["translated"]) < relay_choice.NEEDED_FROM
    assert relay.relay_of(replace(translator, info={**translator.info, "relay": record})) is None


def test_a_relay_says_why_it_cannot_run(zoo):
    small, large, hybrid = zoo("qwen3-small"), zoo("qwen3-large"), zoo("qwen3.5-a")
    assert "widths" in relay_choice.applicable(small.model, large.model)
    assert "cannot go back" in relay_choice.applicable(hybrid.model, hybrid.model)
    assert relay_choice.applicable(small.model, small.model) is None


def test_a_manifest_keeps_the_relay(self_translator, tmp_path):
    lm, translator = self_translator
    record = {"chosen": [1, 2, 1], "translated": 0.5, "copy_loss": 0.01}
    saved = artifact.save(replace(translator, info={**translator.info, "relay": record}),
                          tmp_path / "t", lm, lm)
    loaded = artifact.load(saved, lm, lm)
    assert relay.relay_of(loaded) == Relay(1, 2, 1)
    assert loaded.residuals() == {1}
    assert (1, *RESIDUAL) in loaded.reads(mlx_kvtrans.layout_of(lm.model))
    assert "layers 1-2" in relay.describe(record)
    np.testing.assert_equal(relay.describe(None), "relay: not measured")


def test_a_conversation_switches_back_and_forth_with_relays(self_translator):
    """A model that is one relay's source and another's target records the hidden state its
    relay reads, and switches both ways."""
    lm, translator = self_translator
    relayed = replace(translator, info={**translator.info, "relay": {"chosen": [1, 2, 1]}})
    session = Session({"a": lm, "b": lm}, {("a", "b"): relayed, ("b", "a"): relayed},
                      active="a", gate_tokens=0)
    session.add(prompt_of(lm), model="a")
    list(session.generate(4))
    assert session.switch("b").layers_relayed == 2
    session.add(prompt_of(lm, 16, seed=2), model="b")
    list(session.generate(4))
    back = session.switch("a")
    assert back.layers_relayed == 2 and not back.reason
