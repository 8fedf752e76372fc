"""Switch sessions: segment-wise transfer, visible fallbacks, decoding through mlx-lm, and
recording only what translators read."""

from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_kvtrans as kv
from mlx_kvtrans.capture import capture
from mlx_kvtrans.session import Session
from mlx_kvtrans.translators import artifact
from mlx_kvtrans.training.fit import FitConfig, fit
from mlx_kvtrans.training.plan import plan
from mlx_kvtrans.translators.translator import Translator
from mlx_kvtrans.tools.verify import max_abs_diff


def translator_entries(translators: dict) -> dict:
    """(source, target) -> Translator, as the `translators` a `Session` takes (a translator
    carries its own token identity): the one place that knows the shape of an entry."""
    return dict(translators)


def session_for(kimi_pair, strategy="segment", both=True, **options):
    a, b, paths = kimi_pair
    translators = translator_entries({key: artifact.load(p) for key, p in paths.items()
                                      if both or key == (a.name, b.name)})
    return Session({a.name: a, b.name: b}, translators, active=a.name, strategy=strategy,
                   **options)


def plain_reread(lm, tokens):
    """A fresh cache of `lm` that has read `tokens`."""
    cache = make_prompt_cache(lm.model)
    mx.eval(lm.model(mx.array([tokens]), cache=cache))
    return cache


def test_segment_wise_transfer_translates_only_new_tokens(kimi_pair):
    a, b, _ = kimi_pair
    s = session_for(kimi_pair)
    s.add(list(range(60, 90)))
    list(s.generate(5))
    first = s.switch(b.name)
    # 30 read + 4 generated: all but the gate's last 8 translated, those read by b itself
    assert first.status == "applied" and (first.tokens_translated, first.tokens_tail) == (26, 8)
    s.add(list(range(100, 110)))
    list(s.generate(5))
    # b read a's last token, the 10 new ones and 4 of its 5: a lacks those 15
    back = s.switch(a.name)
    assert back.status == "applied" and (back.tokens_translated, back.tokens_tail) == (7, 8)
    s.add([5, 6, 7])
    list(s.generate(3))
    # a read b's last token, the 3 new ones and 2 of its 3 tokens: b lacks those 6, no more
    # than the gate reads, so b reads them all
    again = s.switch(b.name)
    assert (again.tokens_translated, again.tokens_tail) == (0, 6)
    # b read a's last token in the same forward: it holds its first token's logits
    assert s.lines[b.name].seen - 1 == s.lines[a.name].seen == len(s.tokens) - 1


def test_a_switch_is_planned_from_values_and_the_plan_is_what_it_does(kimi_pair):
    a, b, _ = kimi_pair
    s = session_for(kimi_pair, both=False)
    s.add(list(range(60, 90)))
    list(s.generate(5))
    seen = {name: line.seen for name, line in s.lines.items()}
    plan = s.plan(b.name)
    # planning reads nothing and changes nothing
    assert {name: line.seen for name, line in s.lines.items()} == seen and s.active == a.name
    assert (plan.start, plan.upto, plan.reason) == (0, 34, None) and plan.choice is not None
    done = s.switch(b.name)
    assert done.status == "applied" and done.reread == plan.choice.reread
    assert done.tokens_translated + done.tokens_tail + done.tokens_sink == plan.upto
    assert s.plan(b.name).gives_nothing
    s.add([1, 2, 3])
    list(s.generate(3))
    back = s.plan(a.name)  # no translator from b to a
    assert back.choice is None and back.reason == "no translator for this pair"


def test_token_ids_outside_the_vocabulary_are_refused_and_nothing_is_added(kimi_pair):
    a, b, _ = kimi_pair
    s = session_for(kimi_pair)
    s.add([60, 61])
    rows = kv.models.input_embedding(a.model).weight.shape[0]
    for bad in (rows, -1):
        with pytest.raises(ValueError, match="outside .* vocabulary"):
            s.add([62, bad])
    assert s.view(a.name) == [60, 61]
    s.add([rows - 1])
    assert s.view(b.name)[-1] == rows - 1
    # a model whose weights a server has unloaded still has its vocabulary
    from mlx_kvtrans.serve.residency import _empty

    emptied = kv.load(b.name)
    _empty(emptied.model)
    assert kv.models.vocabulary_rows(emptied.model) == rows


def test_translating_ahead_is_the_switch_made_early(kimi_pair):
    """`prepare(target)` between turns gives the target what a switch would, without making
    it active; the switch then gives only what came since, reports the switch made ahead,
    and the target answers as it would have after a plain switch."""
    a, b, _ = kimi_pair
    replies = {}
    for ahead in (False, True):
        s = session_for(kimi_pair)
        s.add(list(range(60, 110)))
        list(s.generate(5))
        if ahead:
            early = s.translate_ahead(b.name)
            assert s.active == a.name and early.tokens_translated > 0
            assert s.lines[b.name].seen == len(s.tokens)  # a's last token read with the gate
        s.add(list(range(120, 130)))  # the next prompt comes before the switch
        status = s.switch(b.name)
        assert status.status == "applied"
        if ahead:
            assert status.tokens_translated_ahead == status.tokens_translated > 0
            assert status.tokens_translated == early.tokens_translated
            assert status.gate == early.gate and status.ahead_seconds == early.translate_seconds
            assert not s.ahead  # reported once
        replies[ahead] = list(s.generate(6))
    assert replies[True] == replies[False]


def test_translating_ahead_without_reread_leaves_a_refused_translation_to_the_switch(
        kimi_pair, monkeypatch):
    """`prepare(target, read_fallback=False)`: a translation the gate refuses reads nothing and is not
    kept; the target's line is as it was. What the caller re-reads of it in its own time, and
    the rest that the switch re-reads without translating again, make one switch."""
    from mlx_kvtrans.translators import gate

    a, b, _ = kimi_pair
    monkeypatch.setattr(gate, "threshold", lambda *args, **kwargs: (-1e9, ""))
    translations, translate = [], Translator.translate

    def counted(*args, **kwargs):
        translations.append(1)
        return translate(*args, **kwargs)

    monkeypatch.setattr(Translator, "translate", counted)
    for part, sink in ((0, 0), (20, 0), (20, 4)):
        s = session_for(kimi_pair, sink=sink)
        s.add(list(range(60, 110)))
        list(s.generate(5))
        early = s.translate_ahead(b.name, read_fallback=False)
        assert early.status == "fallback" and "fidelity gate" in early.reason
        assert early.tokens_fallback == len(s.tokens) - 1 - sink  # what is left to read
        assert s.lines[b.name].seen == sink and not s.ahead  # the sink it read stays
        if part:  # the caller re-reads a part ahead, as the server does in idle time
            s.read(s.lines[b.name], part)
        translations.clear()
        status = s.switch(b.name)
        assert not translations  # judged once, ahead: the switch reads on
        assert status.status == "fallback" and "when translating ahead" in status.reason
        # every token once: the sink, then re-read (ahead or now)
        assert status.tokens_sink == sink and not status.tokens_translated
        assert status.tokens_fallback + status.tokens_sink == len(s.tokens) - 1
        assert s.lines[b.name].seen == s.lines[a.name].seen == len(s.tokens) - 1


def test_a_target_given_the_conversation_from_its_start_reads_the_sink_itself(kimi_pair):
    """`sink=s`: the target reads the first s tokens itself (its own cache there, to float
    rounding: a short read's softmax off a GPU is `fast_math`'s), the translation covers the
    rest but the gate's tail; later switches have no sink to read."""
    a, b, _ = kimi_pair
    s = session_for(kimi_pair, sink=4)
    s.add(list(range(60, 90)))
    list(s.generate(4))
    first = s.switch(b.name)
    assert first.status == "applied" and first.tokens_sink == 4
    assert (first.tokens_translated, first.tokens_tail) == (s.lines[a.name].seen - 4 - 8, 8)
    own = plain_reread(b, s.tokens[:4])
    for mine, native in zip(s.lines[b.name].cache, own):
        if hasattr(native, "keys") and native.keys is not None:
            assert mx.allclose(mine.keys[..., :4, :], native.keys[..., :4, :], atol=1e-5)
    s.add(list(range(100, 120)))
    list(s.generate(2))
    s.switch(a.name)
    s.add(list(range(130, 150)))
    assert s.switch(b.name).tokens_sink == 0


def test_the_sink_defaults_to_what_the_translators_fit_measured(kimi_pair):
    """Without `sink`, a switch reads the first tokens its translator's fit measured the target
    rests on (none for the zoo's models); the session's own `sink` overrides it."""
    a, b, _ = kimi_pair
    for measured, option, read in ((None, {}, 0), (3, {}, 3), (3, {"sink": 0}, 0)):
        s = session_for(kimi_pair, **option)
        if measured is not None:
            s.translators[(a.name, b.name)].info["sink"] = {"tokens": measured}
        s.add(list(range(60, 90)))
        list(s.generate(4))
        assert s.switch(b.name).tokens_sink == read


def test_a_switch_reads_the_tail_and_the_next_prompt_in_one_forward(kimi_pair):
    """The target reads the span's last r tokens and what follows them (the next prompt) in
    one forward, and its first token comes from that forward's logits: the same answer and
    gate reading as reading the prompt after the switch."""
    a, b, _ = kimi_pair
    one, apart = session_for(kimi_pair), session_for(kimi_pair)
    for s in (one, apart):
        s.add(list(range(60, 100)))
        list(s.generate(5))
    one.add([11, 12, 13])
    together = one.switch(b.name)
    assert one.lines[b.name].seen == len(one.tokens)
    alone = apart.switch(b.name)
    apart.add([11, 12, 13])
    assert together.status == alone.status == "applied"
    assert (together.tokens_translated, together.tokens_tail) == (alone.tokens_translated, 8)
    assert together.gate_gap == pytest.approx(alone.gate_gap, abs=1e-4)
    assert list(one.generate(6)) == list(apart.generate(6))
    assert one.lines[b.name].seen == len(one.tokens) - 1
    # a first token that ends the turn at once leaves the line as any turn does
    for s in (one, apart):
        s.add([21, 22])
        s.switch(a.name)
    first = next(iter(apart.generate(1)))
    assert list(one.generate(1)) == [first]
    assert one.lines[a.name].seen == len(one.tokens) - 1


def test_segment_translation_equals_translating_the_whole_prefix(kimi_pair):
    """Appending a translated span to a cache equals translating everything at once, when the
    source computed the whole history itself."""
    a, b, _ = kimi_pair
    seg, naive = session_for(kimi_pair), session_for(kimi_pair, strategy="naive")
    for s in (seg, naive):
        s.add(list(range(40, 80)))
        list(s.generate(4))
    seg.switch(b.name)
    naive.switch(b.name)
    x = mx.array([[11, 12, 13]])
    assert max_abs_diff(b.model(x, cache=seg.lines[b.name].cache),
                        b.model(x, cache=naive.lines[b.name].cache)) <= 1e-4


def test_missing_translator_falls_back_visibly(kimi_pair):
    a, b, _ = kimi_pair
    s = session_for(kimi_pair, both=False)
    s.add(list(range(30, 50)))
    list(s.generate(3))
    s.switch(b.name)
    s.add([1, 2, 3])
    list(s.generate(3))
    back = s.switch(a.name)
    assert back.status == "fallback" and "no translator" in back.reason
    assert back.tokens_fallback > 0 and s.lines[a.name].seen == s.lines[b.name].seen


def test_non_finite_translation_falls_back(kimi_pair):
    a, b, paths = kimi_pair
    s = session_for(kimi_pair)
    tr = artifact.load(paths[(a.name, b.name)])
    poisoned = dict(tr.params)
    key = next(k for k in poisoned if k.endswith(".weight"))
    poisoned[key] = poisoned[key] * mx.nan
    s.translators.update(translator_entries({(a.name, b.name): replace(tr, params=poisoned)}))
    s.add(list(range(30, 50)))
    list(s.generate(2))
    status = s.switch(b.name)
    assert status.status == "fallback" and "not finite" in status.reason
    assert s.lines[b.name].seen == s.lines[a.name].seen


def test_refresh_rereads_fully_every_nth_switch_into_a_model(kimi_pair):
    a, b, _ = kimi_pair
    s = session_for(kimi_pair, strategy="refresh", refresh_every=2)
    s.add(list(range(30, 50)))
    statuses, held = [], []
    for i in range(8):  # into b at even i, into a at odd i: the 2nd and 4th into each refresh
        list(s.generate(2))
        held.append(s.lines[s.active].seen)
        statuses.append(s.switch(b.name if i % 2 == 0 else a.name))
    assert [st.status for st in statuses] == ["applied", "applied", "fallback",
                                              "fallback"] * 2
    for st, n in zip(statuses, held):
        if st.status == "applied":
            assert st.tokens_translated + st.tokens_tail > 0 and st.tokens_fallback == 0
        else:  # the whole conversation, not only the unseen span
            assert "refresh" in st.reason and st.tokens_fallback == n
    x = mx.array([[9, 8, 7]])
    assert max_abs_diff(a.model(x, cache=s.lines[a.name].cache),
                        a.model(x, cache=plain_reread(a, s.tokens[:held[-1]]))) <= 1e-5


def test_context_over_max_context_rereads_like_a_plain_prefill(kimi_pair):
    a, b, _ = kimi_pair
    s, within = session_for(kimi_pair, max_context=17), session_for(kimi_pair, max_context=1000)
    for session in (s, within):
        session.add(list(range(30, 50)))
        list(session.generate(3))
    n = s.lines[a.name].seen
    assert n > 17
    assert within.switch(b.name).status == "applied"  # the limit, not the kimi_pair, is the cause
    status = s.switch(b.name)
    assert status.status == "fallback" and "17" in status.reason, status.reason
    assert status.tokens_translated == 0 and status.tokens_fallback == n
    assert s.lines[b.name].seen == n
    x = mx.array([[11, 12, 13]])
    assert max_abs_diff(b.model(x, cache=s.lines[b.name].cache),
                        b.model(x, cache=plain_reread(b, s.tokens[:n]))) <= 1e-5


def test_multiturn_dialogues_alternate_models_and_find_the_questions(kimi_pair):
    from mlx_kvtrans.evaluation.multiturn import HELD_OUT_DIALOGUES, UNGATED, run_dialogue
    from mlx_kvtrans.evaluation import tasks

    a, b, paths = kimi_pair
    translators = translator_entries({key: artifact.load(p) for key, p in paths.items()})
    rows = run_dialogue({a.name: a, b.name: b}, translators, "segment", HELD_OUT_DIALOGUES, 6,
                        max_tokens=4)
    sample = tasks.dialogue(HELD_OUT_DIALOGUES, turns=6)
    users = [m for m in sample.messages if m["role"] == "user"]
    assert len(rows) == len(users) == 6
    assert [r["model"] for r in rows] == [a.name, b.name] * 3
    assert [r["question"] for r in rows] == [u["content"].startswith("What was the number")
                                            for u in users]
    assert rows[-1]["question"]
    # scored on question turns only; a 4-token reply of a byte-level model cannot hold a
    # 6-digit number, so none is right
    assert [r["right"] for r in rows] == [False if r["question"] else None for r in rows]
    assert rows[0]["gate"] == ""  # no switch into the first turn
    assert all(r["gate"] in ("passed", "fired", "uncalibrated", "unchecked") for r in rows[1:])
    ungated = run_dialogue({a.name: a, b.name: b}, translators, UNGATED, HELD_OUT_DIALOGUES, 4,
                           max_tokens=4)
    assert [r["gate"] for r in ungated] == ["", "off", "off", "off"]


@pytest.mark.parametrize("sink", [0, 4])
def test_naive_retranslates_the_whole_prefix_including_translated_spans(kimi_pair, sink):
    a, b, _ = kimi_pair
    s = session_for(kimi_pair, strategy="naive", sink=sink)
    s.add(list(range(30, 50)))
    for i in range(4):
        list(s.generate(3))
        status = s.switch(b.name if i % 2 == 0 else a.name)
        assert status.status == "applied", status.reason
        # every switch translates everything the source holds, its translated spans included
        # (the gate's last tokens read by the target; a first switch's sink too)
        assert (status.tokens_sink + status.tokens_translated + status.tokens_tail
                == s.lines[status.source].seen)
        assert status.tokens_sink == (sink if i == 0 else 0)  # b held nothing, a all it read
        line = s.lines[status.target]
        offsets = {c.offset for c in line.cache if hasattr(c, "offset")}
        assert offsets == {line.seen}  # the caches hold what the line says
        s.add([1, 2])


def test_codebook_translator_switches_away_from_a_translated_span(kimi_pair):
    """A span the source holds by translation has no layer-0 latent of its own to decode; the
    conversation's token ids stand in, and the switch still applies."""
    from mlx_kvtrans.models import input_embedding
    from mlx_kvtrans.translators.token_identity import build_codebook

    a, b, paths = kimi_pair
    book = build_codebook(b.model, input_embedding(b.model).weight.shape[0])
    batches = [mx.random.randint(0, 259, (4, 48), key=mx.random.key(i)) for i in range(3)]
    back = fit(b.model, a.model, batches, plan(kv.layout_of(b.model), kv.layout_of(a.model)),
               FitConfig(token_identity="codebook"), codebook=book)
    translators = translator_entries({(a.name, b.name): artifact.load(paths[(a.name, b.name)]),
                                      (b.name, a.name): back})
    s = Session({a.name: a, b.name: b}, translators, active=a.name, strategy="naive")
    s.add(list(range(30, 50)))
    list(s.generate(3))
    assert s.switch(b.name).status == "applied"
    s.add([1, 2])
    list(s.generate(3))
    status = s.switch(a.name)
    assert status.status == "applied", status.reason
    assert status.tokens_translated + status.tokens_tail == s.lines[b.name].seen


# -- decoding through mlx-lm, recording only what translators read ---------------------------

def reference_tokens(model, prompt, n, sampler=None):
    """mlx-lm's own greedy (or `sampler`) continuation of `prompt`: n tokens."""
    from mlx_lm.generate import generate_step

    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=sampler)]


def zoo_pair(source, target):
    """A zoo model with its shipped translator to `target`, as a two-model session."""
    path = artifact.shipped(source, target)
    if path is None:
        pytest.skip(f"no shipped translator {source} -> {target}")
    src, tgt = kv.load(source), kv.load(target)
    return Session({source: src, target: tgt},
                   {(source, target): kv.load_translator(path, src, tgt)}, active=source)


def sessions_for_decoding(kimi_pair, loaded, zoo=True):
    """(session, model name): the tiny kimi_linear with translators both ways, a tiny qwen3_5
    without any (it records nothing), and (`zoo`) the zoo's kimi-linear and qwen3.5-a with
    their shipped translators."""
    a, _, _ = kimi_pair
    q = loaded("qwen3_5")
    out = [(session_for(kimi_pair), a.name), (Session({q.name: q}), q.name)]
    if zoo:
        out += [(zoo_pair("kimi-linear", "kimi-vl"), "kimi-linear"),
                (zoo_pair("qwen3.5-a", "qwen3.5-b"), "qwen3.5-a")]
    return out


def test_session_generation_equals_mlx_lm_token_for_token(kimi_pair, loaded):
    for s, name in sessions_for_decoding(kimi_pair, loaded):
        model = s.lines[name].lm.model
        prompt = list(range(40, 72))
        s.add(prompt)
        first = list(s.generate(12))
        assert first == reference_tokens(model, prompt, 12), name
        # the next turn reads the last generated token first, then the new ones
        s.add([7, 8, 9])
        second = list(s.generate(6))
        assert second == reference_tokens(model, s.tokens[:-6], 6), name
        assert s.lines[name].seen == len(s.tokens) - 1


def test_stop_token_ends_the_turn_and_is_read_with_the_next(kimi_pair, loaded):
    for s, name in sessions_for_decoding(kimi_pair, loaded, zoo=False):
        lm = s.lines[name].lm
        prompt = list(range(50, 70))
        expected = reference_tokens(lm.model, prompt, 8)
        s.add(prompt)
        got = list(s.generate(8, stop={expected[3]}))
        assert got == expected[:expected.index(expected[3]) + 1]
        line = s.lines[name]
        assert line.seen == len(s.tokens) - 1  # the stop token is not read yet
        # a turn whose iterator is left early behaves the same way
        s.add([3, 4])
        for i, _ in enumerate(s.generate(8)):
            if i == 2:
                break
        assert line.seen == len(s.tokens) - 1
        one = list(s.generate(1))  # nothing added: it reads the last token, then samples
        assert one == reference_tokens(lm.model, s.tokens[:-1], 1)
        s.add([1])
        assert list(s.generate(4)) == reference_tokens(lm.model, s.tokens[:-4], 4)
        x = mx.array([[s.tokens[-1], 5, 6]])
        assert max_abs_diff(lm.model(x, cache=line.cache),
                            lm.model(x, cache=plain_reread(lm, s.tokens[:-1]))) <= 1e-4


def test_switching_mid_generation_ends_the_turn_first(kimi_pair):
    a, b, _ = kimi_pair
    s = session_for(kimi_pair)
    s.add(list(range(30, 60)))
    turn = s.generate(10)
    got = [next(turn), next(turn), next(turn)]
    status = s.switch(b.name)  # the open turn ends: a has read all but its last token
    assert list(turn) == [] and s.tokens[-3:] == got
    assert status.status == "applied" and status.tokens_translated + status.tokens_tail == 32
    # b read a's last token too, in the switch's one forward
    assert s.lines[a.name].seen == s.lines[b.name].seen - 1 == len(s.tokens) - 1


def test_sampled_generation_uses_mlx_lm_sampler(kimi_pair):
    from mlx_lm.sample_utils import make_sampler

    a, _, _ = kimi_pair
    s = session_for(kimi_pair)
    prompt = list(range(40, 60))
    s.add(prompt)
    mx.random.seed(3)
    got = list(s.generate(10, temperature=0.8))
    mx.random.seed(3)
    assert got == reference_tokens(a.model, prompt, 10, sampler=make_sampler(temp=0.8))


class Reads:
    """A stand-in translator that reads `keys` of its source (never asked to translate)."""

    def __init__(self, keys):
        self.keys = keys

    def prepare(self):
        return self

    def reads(self, layout):
        return self.keys

    def source_points(self):
        return {point for _, _, point in self.keys}


@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_5"])
def test_recorded_objects_equal_a_plain_capture_of_the_same_tokens(loaded, family):
    """A turn's prefill (generate_step's chunks) and decode steps record what one plain
    capture of the same tokens gives, recurrence inputs included."""
    from mlx_kvtrans.session import RECORD_POINTS
    from mlx_kvtrans.capture import join_recorded

    lm, other = loaded(family), loaded("qwen3")
    probe = capture(lm.model, [1, 2], points=RECORD_POINTS)
    everything = {(i, name, point) for i, found in enumerate(probe.objects)
                  for name, point in found}
    assert any(name == "state" for _, name, _ in everything)
    s = Session({"a": lm, "b": other}, {("a", "b"): Reads(everything)}, strategy="naive")
    s.add(list(range(40, 80)))
    list(s.generate(9))
    s.add([1, 2, 3])
    list(s.generate(5))
    line = s.lines["a"]
    assert line.recorded_from == 0 and line.recorded_tokens == line.seen
    recorded = join_recorded(line.recorded, 0, line.seen, 0)
    plain = capture(lm.model, s.tokens[:line.seen], points=RECORD_POINTS)
    assert [set(found) for found in recorded] == [set(found) for found in plain.objects]
    for layer, (mine, theirs) in enumerate(zip(recorded, plain.objects)):
        for key, value in mine.items():
            ref = theirs[key]
            pairs = zip(value.arrays(), ref.arrays()) if hasattr(value, "arrays") \
                else [(value, ref)]
            for x, y in pairs:  # the same up to the rounding of other matmul shapes
                assert x.shape == y.shape and max_abs_diff(x, y) <= 2e-5, (layer, key)


def test_session_records_only_what_its_outgoing_translators_read(kimi_pair):
    a, b, _ = kimi_pair
    s = session_for(kimi_pair, strategy="naive", both=False)  # a -> b only: b records nothing
    s.add(list(range(40, 70)))
    list(s.generate(4))
    line = s.lines[a.name]
    keys = {(layer, name, point) for part in line.recorded
            for layer, found in enumerate(part.objects) for name, point in found}
    assert keys == s.translators[(a.name, b.name)].reads(line.layout) == s.selection(a.name)
    everything = capture(a.model, s.tokens[:line.seen], points=(1, 2))
    full = sum(v.nbytes if hasattr(v, "nbytes") else sum(x.nbytes for x in v.arrays())
               for found in everything.objects for v in found.values()) / line.seen
    assert 0 < line.bytes_per_token < full
    assert line.bytes_per_token * line.seen == line.recorded_bytes()
    s.switch(b.name)
    s.add([1, 2])
    list(s.generate(3))
    assert s.lines[b.name].recorded == [] and s.lines[b.name].bytes_per_token == 0


def test_segment_drops_spans_every_receiver_has_read_and_naive_keeps_them(kimi_pair):
    a, b, _ = kimi_pair
    seg, naive = session_for(kimi_pair), session_for(kimi_pair, strategy="naive")
    for s in (seg, naive):
        s.add(list(range(40, 70)))
        list(s.generate(4))
        assert s.lines[a.name].recorded_tokens == s.lines[a.name].seen == 33
        s.switch(b.name)
        s.add([1, 2])
        list(s.generate(3))
    # segment: b has read all a recorded (and a all b's translated span): both dropped; b holds
    # only its own turn, which a has not read yet
    assert seg.lines[a.name].recorded == []
    assert seg.lines[b.name].recorded_from == 33 and seg.lines[b.name].recorded_tokens == 5
    # after the switch only b's record of a's last token (read in the switch's forward) was held
    assert seg.switches[0].recorded_bytes == seg.lines[b.name].bytes_per_token > 0
    assert seg.switch(a.name).status == "applied" and seg.lines[b.name].recorded == []
    # naive: everything kept, translated spans included
    assert naive.lines[a.name].recorded_tokens == 33
    assert naive.lines[b.name].recorded_from == 0 and naive.lines[b.name].recorded_tokens == 38
    assert naive.switches[0].recorded_bytes > 0


def test_kept_bytes_count_the_gate_rows_and_the_state_snapshots_once(zoo):
    """What a line keeps beside its cache for switching (the store's budget counts it): the
    final-norm rows and the fixed-size states of its snapshots, an array the cache or another
    snapshot holds counted once."""
    a, b = zoo("qwen3.5-a"), zoo("qwen3.5-b")  # its translator copies the recurrent state
    tr = artifact.load(artifact.shipped(a.name, b.name), a, b)
    s = Session({a.name: a, b.name: b}, {(a.name, b.name): tr})
    s.add(a.tokenizer.encode("The harbour was quiet that morning, and the ships lay still. " * 6))
    list(s.generate(6))
    line = s.lines[a.name]
    assert line.tail is not None and line.states  # snapshots for the state copy
    line.states = {}
    assert line.kept_bytes() == line.tail.rows.nbytes
    state = [[mx.zeros((2, 3)), None], [mx.ones((4,))]]  # 24 + 16 bytes, float32
    line.states = {10: state, 20: state}  # the same arrays at two positions: counted once
    assert line.kept_bytes() == line.tail.rows.nbytes + 40
    line.states[30] = [[[c for c in line.cache if not c.is_trimmable()][0].cache[0]]]
    assert line.kept_bytes() == line.tail.rows.nbytes + 40  # the cache holds it already


def arrays(cache) -> list:
    """The arrays a cache holds (a cache's state may hold offsets too)."""
    from mlx.utils import tree_flatten

    return [x for _, x in tree_flatten(cache.state) if isinstance(x, mx.array)]


def test_a_switch_that_recomputes_its_first_layers_holds_them_as_native_does(kimi_pair):
    """DroidSpeak's knob: the target's first k layers read the translated span themselves,
    so their caches are the target's own; the layers above keep the translation."""
    a, b, _ = kimi_pair
    prompt = list(range(60, 100))
    caches, layers = {}, len(make_prompt_cache(b.model))
    for k in (0, 2, layers):
        s = session_for(kimi_pair, gate_tokens=0, recompute=k)
        s.add(prompt)
        list(s.generate(0))
        status = s.switch(b.name)
        assert status.status == "applied" and status.layers_recomputed == k
        caches[k] = s.lines[b.name].cache
    native = plain_reread(b, prompt)
    for i in range(len(native)):
        for got, want in zip(arrays(caches[layers][i]), arrays(native[i])):
            assert max_abs_diff(got, want) < 1e-4, i  # every layer read natively
        recomputed = arrays(caches[2][i])
        same_as = arrays(native[i] if i < 2 else caches[0][i])
        for got, want in zip(recomputed, same_as):
            assert max_abs_diff(got, want) < 1e-4, i
    assert max(max_abs_diff(g, w) for g, w in zip(arrays(caches[0][0]), arrays(native[0]))) > 1e-3
