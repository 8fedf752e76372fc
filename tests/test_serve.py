"""`kvtrans serve`: OpenAI's API over translated caches, on loopback with the official client.

The server runs in-process on a free port (the SIGTERM test starts `kvtrans serve` itself);
the zoo pair kimi-linear (MLA + KDA hybrid) / kimi-vl (full MLA) with the shipped translators.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from typer.testing import CliRunner

from mlx_kvtrans.cli.main import app as cli
from mlx_kvtrans.capture.instrument import hook_module
from mlx_kvtrans.serve import Engine, ServeConfig, listen
from mlx_kvtrans.serve.config import find_translators, load_models
from mlx_kvtrans.session import Session
from mlx_kvtrans.translators.translator import Translator
from conftest import running

HYBRID, FULL = "kimi-linear", "kimi-vl"
BODY_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def zoo():
    models = load_models([HYBRID, FULL])
    translators, notes = find_translators(models, [])
    assert set(translators) == {(HYBRID, FULL), (FULL, HYBRID)}, notes
    return models, translators


@pytest.fixture(scope="module")
def served(zoo):
    models, translators = zoo
    engine = Engine(models, translators, ServeConfig(models=list(models),
                                                     max_body_bytes=BODY_LIMIT))
    with running(engine) as url:
        yield engine, url


@pytest.fixture(autouse=True)
def settled(request):
    """After each test, the shared server's idle work (translating ahead) is done: the next
    test may run another engine on the same models, and MLX computes on one thread at once."""
    yield
    if "served" in request.fixturenames:
        request.getfixturevalue("served")[0].settle()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def report(response) -> dict:
    return response.model_extra["kvtrans"]


def post(url: str, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    """A raw POST (the client refuses some bad bodies before sending them)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, data, {"content-type": "application/json", **(headers or {})})
    response = conn.getresponse()
    status, text = response.status, response.read()
    conn.close()
    return status, json.loads(text) if text else {}


def ask(c, model, messages, max_tokens=16, conversation=None, **options):
    headers = {"x-kvtrans-conversation": conversation} if conversation else None
    return c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                     temperature=0, extra_headers=headers, **options)


def test_chat_reply_reports_its_switch_in_body_and_headers(served):
    engine, url = served
    raw = client(url).chat.completions.with_raw_response.create(
        model=FULL, messages=[{"role": "user", "content": "Remember: copper is 552190."}],
        max_tokens=12, temperature=0)
    reply = raw.parse()
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    fields = report(reply)
    assert fields["tokens_new"] == reply.usage.prompt_tokens
    assert raw.headers["x-kvtrans-history"] == fields["status"]
    assert float(raw.headers["x-kvtrans-ttft-seconds"]) == pytest.approx(fields["ttft_seconds"], abs=1e-6)


def test_streamed_chat_equals_the_plain_reply_and_reports_in_its_last_chunk(served):
    _, url = served
    c = client(url)
    messages = [{"role": "user", "content": "What is the number for walnut?"}]
    plain = ask(c, HYBRID, messages, max_tokens=20)
    chunks = list(c.chat.completions.create(model=HYBRID, messages=messages, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish[0].choices[0].finish_reason == plain.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == plain.usage.completion_tokens
    assert report(last)["status"] == "reused"  # the same prompt: read but its last token


def test_concurrent_requests_decode_together_and_answer_as_alone(served):
    engine, url = served
    asks = [(model, f"Note {i} for {model}: the {word} is {300117 * (i + 2)}.")
            for i, word in enumerate(("kettle", "harbor", "lantern"))
            for model in (HYBRID, FULL)]

    def answer(i_asked, kind):
        i, (model, text) = i_asked
        reply = ask(client(url), model, [{"role": "user", "content": text}], max_tokens=16,
                    conversation=f"{kind}-{i}")
        return reply.choices[0].message.content, reply.usage.completion_tokens

    alone = [answer(a, "alone") for a in enumerate(asks)]
    counts = {m: (engine.metrics.value("kvtrans_decode_steps_total", model=m),
                  engine.metrics.value("kvtrans_decode_step_tokens_total", model=m))
              for m in (HYBRID, FULL)}
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda a: answer(a, "together"), enumerate(asks)))
    assert together == alone  # the same replies and usage, greedy
    steps = sum(engine.metrics.value("kvtrans_decode_steps_total", model=m) - counts[m][0]
                for m in counts)
    tokens = sum(engine.metrics.value("kvtrans_decode_step_tokens_total", model=m)
                 - counts[m][1] for m in counts)
    assert tokens == sum(n for _, n in together)  # every token decoded once, in some step
    assert steps < tokens  # some steps decoded several requests


def test_alternating_models_translate_and_match_the_session_api(served, zoo):
    engine, url = served
    models, translators = zoo
    turns = [(HYBRID, "The lantern is 318402."), (FULL, "And the anchor is 774120?"),
             (HYBRID, "What is the lantern?"), (FULL, "What is the anchor?")]
    c, messages, statuses = client(url), [], []
    for model, text in turns:
        messages.append({"role": "user", "content": text})
        reply = ask(c, model, messages, max_tokens=24, conversation="alternating")
        switch = report(reply)["switch"] or {}
        statuses.append((report(reply)["status"], switch.get("gate", "")))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    # every switch translates; the fidelity gate sends back the ones whose tail the target
    # cannot continue (a reply ending in a number kimi-vl cannot recall) to a re-read, and a
    # span within the dial's default R is read by the target itself (unchecked)
    assert statuses[0] == ("none", "")
    assert all(s in (("applied", "passed"), ("fallback", "fired"),
                     ("applied", "unchecked")) for s in statuses[1:]), statuses
    assert ("applied", "passed") in statuses

    # the same conversation through the Session API, greedy
    tok = models[HYBRID].tokenizer
    eos = set(tok.eos_token_ids)
    engine.settle()  # its idle work done: MLX computes on one thread at once
    session = Session(models, translators, active=HYBRID)
    history = []
    for (model, text), said in zip(turns, messages[1::2]):
        history.append({"role": "user", "content": text})
        prompt = tok.apply_chat_template(history, add_generation_prompt=True)
        assert prompt[:len(session.tokens)] == session.tokens  # the template extends it
        if model != session.active:
            status = session.switch(model)  # the server's switch, the same way
            assert (status.status, status.gate) == statuses[len(history) // 2]
        session.add(prompt[len(session.tokens):])
        ids = list(session.generate(24, stop=eos))
        assert tok.decode([t for t in ids if t not in eos]) == said["content"]
        history.append(said)
    entry = next(e for e in engine.store.entries() if e.conversation == "alternating")
    assert entry.tokens == session.tokens  # every prompt and reply token, the same


def test_repeated_prefix_is_reused_and_the_original_stays(served):
    _, url = served
    c = client(url)
    for model in (HYBRID, FULL):
        messages = [{"role": "user", "content": f"A fresh question for {model}: the kettle?"}]
        first = ask(c, model, messages)
        again = ask(c, model, messages)
        assert report(again)["status"] == "reused"
        assert report(again)["tokens_reused"] == again.usage.prompt_tokens - 1
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
        assert again.choices[0].message.content == first.choices[0].message.content
        ask(c, model, messages, max_tokens=2)  # a shorter branch of the same prompt
        # continuing the first reply still finds it: branches are copies. The reply comes back
        # as text, which may tokenise differently ("\n\n" generated as two tokens is one), so
        # the hybrid may go back to its checkpoint at the end of the prompt.
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Thanks."}]
        later = report(ask(c, model, messages))
        assert later["status"] == "reused"
        assert later["tokens_reused"] >= first.usage.prompt_tokens - 1
        if model == FULL:
            assert later["tokens_reused"] > first.usage.prompt_tokens + 2


def test_an_edited_reply_reuses_up_to_the_message_boundary(served):
    """A trimmable cache keeps the common prefix; a hybrid's goes back to its checkpoint at the
    end of the first prompt."""
    _, url = served
    c = client(url)
    for model, kept in ((FULL, 0), (HYBRID, 1)):
        messages = [{"role": "user", "content": f"{model}: tell me about the ferry."}]
        first = ask(c, model, messages)
        edited = messages + [{"role": "assistant", "content": "Zebra zebra."},
                             {"role": "user", "content": "Go on."}]
        second = ask(c, model, edited)
        assert report(second)["status"] == "reused"
        assert report(second)["tokens_reused"] == first.usage.prompt_tokens - kept


def test_a_switch_after_idle_time_was_translated_ahead(served):
    """Between turns the server hands the conversation to the model a header names: the next
    request there finds it translated, says so, and reads only its new prompt."""
    engine, url = served
    c = client(url)
    messages = [{"role": "user", "content": "Ahead of time: the beacon is 903114. " * 6}]
    first = c.chat.completions.create(
        model=HYBRID, messages=messages, max_tokens=8, temperature=0,
        extra_headers={"x-kvtrans-conversation": "ahead", "x-kvtrans-next-model": FULL})
    engine.settle()  # the idle time between turns
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "What is the beacon?"}]
    fields = report(ask(c, FULL, messages, conversation="ahead"))
    assert fields["status"] == "applied" and fields["switch"]["source"] == HYBRID
    assert fields["switch"]["tokens_translated_ahead"] == fields["switch"]["tokens_translated"] > 0
    assert fields["switch"]["ahead_seconds"] > 0 and fields["tokens_new"] > 0
    status, body = post(url, "/v1/chat/completions",
                        {"model": FULL, "messages": messages, "max_tokens": 1},
                        {"x-kvtrans-next-model": "nope"})
    assert status == 400 and "x-kvtrans-next-model" in body["error"]["message"]


def test_an_edited_last_turn_on_the_hybrid_rereads_only_itself(served):
    """A hybrid's caches cannot be trimmed: it keeps a snapshot where each prompt's last message
    begins, so a user who edits (or regenerates from) their last turn has the whole history
    before it reported cached, as OpenAI reports cached tokens."""
    engine, url = served
    c = client(url)
    story = " ".join(f"The {w} came home at {i} o'clock." for i, w in
                     enumerate(["ferry", "lantern", "kettle", "anchor", "copper"] * 12))
    messages = [{"role": "user", "content": story}]
    reply = ask(c, HYBRID, messages, conversation="edits").choices[0].message.content
    messages.append({"role": "assistant", "content": reply})
    asked = ask(c, HYBRID, messages + [{"role": "user", "content": "When did the ferry come?"}],
                conversation="edits")
    edited = ask(c, HYBRID, messages + [{"role": "user", "content": "And the kettle?"}],
                 conversation="edits")
    history = len(engine.models[HYBRID].tokenizer.apply_chat_template(messages))
    assert report(edited)["status"] == "reused"
    assert report(edited)["tokens_reused"] == history
    assert edited.usage.prompt_tokens_details.cached_tokens == history
    assert history >= 0.8 * edited.usage.prompt_tokens
    assert asked.usage.prompt_tokens > history


def test_a_long_read_on_the_hybrid_keeps_snapshots_along_it(served):
    """Every SNAPSHOT_EVERY tokens of a long prompt a hybrid keeps a snapshot: a prompt that
    changes late re-reads from the last one before the change."""
    from mlx_kvtrans.serve.engine import SNAPSHOT_EVERY

    _, url = served
    c = client(url)
    ids = [(7 * i) % 200 + 40 for i in range(2 * SNAPSHOT_EVERY + 200)]
    c.completions.create(model=HYBRID, prompt=ids, max_tokens=1, temperature=0)
    changed = ids[:2 * SNAPSHOT_EVERY + 100] + [41, 42, 43]
    again = c.completions.create(model=HYBRID, prompt=changed, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 2 * SNAPSHOT_EVERY


@pytest.mark.parametrize("streamed", [False, True])
def test_text_completions(served, streamed):
    _, url = served
    c = client(url)
    kwargs = dict(model=FULL, prompt="The number for copper is", max_tokens=8, temperature=0)
    plain = c.completions.create(**kwargs)
    assert plain.object == "text_completion" and isinstance(plain.choices[0].text, str)
    if streamed:
        chunks = list(c.completions.create(stream=True, **kwargs))
        assert "".join(ch.choices[0].text for ch in chunks) == plain.choices[0].text
        assert report(chunks[-1])["status"] == "reused"


def test_stop_sequences_seed_and_models(served):
    _, url = served
    c = client(url)
    messages = [{"role": "user", "content": "Remember: the harbor is 404112."}]
    full = ask(c, FULL, messages, max_tokens=20).choices[0].message.content
    cut = full[len(full) // 2:][:3]
    stopped = ask(c, FULL, messages, max_tokens=20, stop=[cut])
    assert stopped.choices[0].message.content == full[:full.index(cut)]
    assert stopped.choices[0].finish_reason == "stop"
    sampled = [c.chat.completions.create(model=FULL, messages=messages, max_tokens=12,
                                         temperature=1.0, top_p=0.9, seed=7)
               .choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert [m.id for m in c.models.list().data] == [HYBRID, FULL]
    health = json.loads(urllib.request.urlopen(f"{url}/health").read())
    assert health["status"] == "ok"


BAD = [
    ("malformed JSON", b'{"model": "kimi-vl", "messages": [', 400, None),
    ("a body that is not an object", b"[1, 2]", 400, None),
    ("missing messages", {"model": FULL}, 400, "messages"),
    ("empty messages", {"model": FULL, "messages": []}, 400, "messages"),
    ("numeric content", {"model": FULL, "messages": [{"role": "user", "content": 12}]}, 400,
     "messages.0.content"),
    ("object content", {"model": FULL, "messages": [{"role": "user", "content": {"a": 1}}]},
     400, "messages.0.content"),
    ("unknown model", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
     404, "model"),
    ("a prompt over the context", {"model": FULL, "messages": [
        {"role": "user", "content": "word " * 17000}]}, 400, "messages"),
    ("max_tokens 0", {"model": FULL, "max_tokens": 0,
                      "messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
    ("max_tokens -3", {"model": FULL, "max_tokens": -3,
                       "messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
    ("absurd max_tokens", {"model": FULL, "max_tokens": 10 ** 9,
                           "messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
    ("fractional max_tokens", {"model": FULL, "max_tokens": 2.5,
                               "messages": [{"role": "user", "content": "hi"}]}, 400,
     "max_tokens"),
    ("an oversized body", b"{" + b" " * (BODY_LIMIT + 10) + b"}", 413, None),
]


def test_bad_input_gets_its_code_and_the_next_request_succeeds(served):
    _, url = served
    c = client(url)
    good = [{"role": "user", "content": "Still there?"}]
    for why, body, code, param in BAD:
        status, answer = post(url, "/v1/chat/completions", body)
        assert status == code, (why, answer)
        assert set(answer["error"]) >= {"message", "type", "param", "code"}, why
        assert answer["error"]["message"], why
        if param is not None:
            assert answer["error"]["param"] == param, (why, answer)
        assert ask(c, FULL, good, max_tokens=2).choices[0].finish_reason in ("stop", "length")
    status, _ = post(url, "/v1/nothing-here", {})
    assert status == 404
    assert post(url, "/v1/completions", {"model": FULL})[0] == 400
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=FULL, messages=good, max_tokens=0)


def test_a_fault_inside_a_generation_is_a_500_and_every_cache_stays_usable(served):
    _, url = served
    c = client(url)
    kept = [{"role": "user", "content": "Kept: the compass is 909011."}]
    ask(c, HYBRID, kept)

    def boom(module, args, kwargs):
        raise RuntimeError("injected fault")

    victim = [{"role": "user", "content": "This one fails."}]
    with hook_module(served[0].models[FULL].model, before=boom):
        status, answer = post(url, "/v1/chat/completions",
                              {"model": FULL, "messages": victim, "max_tokens": 4})
    assert status == 500 and "injected fault" in answer["error"]["message"]
    assert answer["error"]["type"] == "server_error"
    assert ask(c, FULL, victim, max_tokens=4).choices[0].finish_reason in ("stop", "length")
    assert report(ask(c, HYBRID, kept))["status"] == "reused"


def refused_ahead(served, monkeypatch, conversation: str, text: str, parts_run: int = 0,
                  read_part: int = 16):
    """The gate forced to refuse, READ_PART `read_part`: the hybrid answers `text` and its
    conversation
    is translated ahead to the full-MLA model, refused, and re-read in parts (all of them, or
    only the first `parts_run`: requests keep the worker busy after them). Returns (the reply,
    the line's length at each part, the tokens read so far, the messages to send on)."""
    from mlx_kvtrans.translators import gate
    from mlx_kvtrans.serve import engine as engine_module

    engine, url = served
    monkeypatch.setattr(gate, "threshold", lambda *args, **kwargs: (-1e9, ""))
    monkeypatch.setattr(engine_module, "READ_PART", read_part)
    parts, read_ahead = [], engine_module.Engine._read_ahead

    def counted(self, *args):
        parts.append(args[0].session.lines[FULL].seen)
        if not parts_run or len(parts) <= parts_run:
            return read_ahead(self, *args)

    monkeypatch.setattr(engine_module.Engine, "_read_ahead", counted)
    messages = [{"role": "user", "content": text}]
    first = client(url).chat.completions.create(
        model=HYBRID, messages=messages, max_tokens=8, temperature=0,
        extra_headers={"x-kvtrans-conversation": conversation, "x-kvtrans-next-model": FULL})
    engine.settle()
    read = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And?"}]
    return first, parts, read, messages


def test_a_gate_fired_ahead_is_reread_in_parts_a_request_can_come_between(served, monkeypatch):
    """Translating ahead that the gate refuses does not re-read the conversation in one job:
    it reads at most READ_PART tokens per idle job (a request waits for one part at most), and the
    next request finds the whole re-read made ahead, with the gate's reason."""
    _, parts, read, messages = refused_ahead(served, monkeypatch, "refused",
                                             "Refused ahead: the beacon is 415926. " * 6)
    assert len(parts) == -(-read // 16) and parts == list(range(0, read, 16))
    fields = report(ask(client(served[1]), FULL, messages, max_tokens=4, conversation="refused"))
    assert fields["status"] == "fallback" and "fidelity gate" in fields["switch"]["reason"]
    assert fields["switch"]["tokens_reread"] == read and fields["switch"]["ahead_seconds"] > 0


def test_a_follow_up_before_the_reply_is_read_in_reads_it_as_the_models_own(served,
                                                                           monkeypatch):
    """While other requests are busy a reply is read into its conversation in idle time; a
    follow-up that comes first reads the reply with its own turn in one read, and marks the
    reply's tokens as the model's own samples for the gate, as the reply's own read would."""
    from mlx_kvtrans.serve import engine as engine_module
    from mlx_kvtrans.session import decode

    engine, url = served
    monkeypatch.setattr(engine_module.Engine, "_read_reply", lambda self, *args: None)
    c, conversation = client(url), "follow-up-first"
    messages = [{"role": "user", "content": "Before the reply is read: the beacon is 577215."}]
    first = ask(c, HYBRID, messages, max_tokens=8, conversation=conversation)
    engine.settle()
    reads, read = [], decode.read

    def recorded(line, tokens, upto, whole=False, split_at=None, generated=None):
        reads.append((line.name, line.seen, upto, generated))
        return read(line, tokens, upto, whole, split_at, generated)

    monkeypatch.setattr(decode, "read", recorded)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And?"}]
    second = ask(c, HYBRID, messages, max_tokens=1, conversation=conversation)
    replied = first.usage.prompt_tokens  # where the reply begins; its line holds one less
    assert report(second)["tokens_new"] == second.usage.prompt_tokens - (replied - 1)
    sampled = [g for name, seen, upto, g in reads if name == HYBRID and seen <= replied < upto]
    assert sampled and sampled[0].start == replied
    assert 0 < len(sampled[0]) <= first.usage.completion_tokens


def test_an_idle_reread_goes_in_parts_paced_to_take_little_time(served, monkeypatch):
    """A part of a re-read ahead is sized from the last part's pace (deep in a long
    conversation a part of READ_PART tokens takes most of a second): with an aim no read can
    meet, every part after the first is the smallest."""
    from mlx_kvtrans.serve import engine as engine_module

    monkeypatch.setattr(engine_module, "IDLE_PART_SECONDS", 1e-9)
    _, parts, read, _ = refused_ahead(served, monkeypatch, "paced",
                                      "Paced: the beacon is 161803. " * 12, read_part=512)
    first, smallest = engine_module.FIRST_IDLE_PART, engine_module.SMALLEST_IDLE_PART
    assert read > first + smallest
    assert parts == [0, *range(first, read, smallest)]


def test_a_request_during_a_reread_ahead_reads_on_without_translating_again(served,
                                                                           monkeypatch):
    """A request that comes while a refused translation ahead is being re-read in parts: its
    switch reads the rest itself, judged once, and reports every token re-read."""
    engine, url = served
    _, parts, read, messages = refused_ahead(served, monkeypatch, "read-on",
                                             "Read on: the beacon is 271828. " * 6, parts_run=2)
    assert parts == [0, 16, 32] and read > 32  # interrupted after 32 tokens
    translations, translate = [], Translator.translate
    full = engine.models[FULL].model

    def counted(self, source, target, *args, **kwargs):
        translations.append(target is full)  # translating ahead back after it may run too
        return translate(self, source, target, *args, **kwargs)

    monkeypatch.setattr(Translator, "translate", counted)
    second = ask(client(url), FULL, messages, max_tokens=4, conversation="read-on")
    fields = report(second)
    engine.settle()
    assert not any(translations)  # the gate refused it ahead: not translated again
    assert fields["status"] == "fallback" and "when translating ahead" in fields["switch"]["reason"]
    assert fields["switch"]["ahead_seconds"] > 0 and fields["switch"]["tokens_translated"] == 0
    # every prompt token counted once: re-read (ahead or now), or new since the reply
    assert fields["tokens_reused"] == 0
    assert fields["switch"]["tokens_reread"] + fields["tokens_new"] == second.usage.prompt_tokens


def test_a_reread_ahead_after_the_sink_counts_each_prompt_token_once(zoo, monkeypatch):
    """With --sink 4 the target reads its sink before the gate refuses the translation ahead:
    the switch counts the sink and the re-read once each."""
    models, translators = zoo
    engine = Engine(models, translators, ServeConfig(models=list(models), sink=4))
    with running(engine) as url:
        _, parts, read, messages = refused_ahead((engine, url), monkeypatch, "sunk",
                                                 "Sunk: the beacon is 161803. " * 6)
        assert parts[0] == 4  # the sink was read before the first part
        second = ask(client(url), FULL, messages, max_tokens=4, conversation="sunk")
        fields = report(second)
        assert fields["status"] == "fallback" and fields["tokens_reused"] == 0
        assert fields["switch"]["tokens_reread"] + fields["tokens_new"] == second.usage.prompt_tokens


def test_a_failed_translation_falls_back_to_rereading_visibly(served, monkeypatch):
    _, url = served
    c = client(url)
    messages = [{"role": "user", "content": "Failing over: the beacon is 111222."}]

    def broken(*args, **kwargs):
        raise RuntimeError("translator broke")

    monkeypatch.setattr(Translator, "translate", broken)  # translating ahead fails too
    first = ask(c, HYBRID, messages, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And?"}]
    second = ask(c, FULL, messages, max_tokens=6)
    fields = report(second)
    assert fields["status"] == "fallback" and "translator broke" in fields["switch"]["reason"]
    assert fields["switch"]["tokens_reread"] > 0 and fields["switch"]["source"] == HYBRID


def switched_reply(zoo, config: ServeConfig, first_text: str, second_text: str):
    """A server of `config`: the hybrid answers `first_text`, then the full-MLA model answers
    `second_text` after it (a switch). Returns (the first reply, the second's raw response)."""
    models, translators = zoo
    with running(Engine(models, translators, config)) as url:
        c = client(url)
        messages = [{"role": "user", "content": first_text}]
        first = ask(c, HYBRID, messages, max_tokens=6)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": second_text}]
        raw = c.chat.completions.with_raw_response.create(
            model=FULL, messages=messages, max_tokens=6, temperature=0)
        raw.parse()  # read while the server runs
    return first, raw


def test_without_translation_a_switch_rereads_and_says_why(zoo):
    first, raw = switched_reply(zoo, ServeConfig(models=list(zoo[0]), translate=False),
                                "No translation here.", "Next.")
    fields = report(raw.parse())
    assert fields["status"] == "fallback"
    assert fields["switch"]["reason"] == "translation is off (--no-translate)"
    assert fields["switch"]["tokens_reread"] == first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert raw.headers["x-kvtrans-reason"] == fields["switch"]["reason"]


def test_a_client_that_disconnects_stops_its_generation(served):
    engine, url = served
    before = engine.metrics.value("kvtrans_tokens_total", model=FULL, kind="generated")
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": FULL, "messages": [{"role": "user", "content": "Talk for a long time."}],
            "max_tokens": 8000, "temperature": 1.0, "seed": 3, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.read(200)
    conn.close()
    ask(client(url), FULL, [{"role": "user", "content": "after"}], max_tokens=2)  # queued behind
    cancelled = engine.metrics.value("kvtrans_generations_total", model=FULL, finish="cancelled")
    generated = engine.metrics.value("kvtrans_tokens_total", model=FULL, kind="generated")
    assert cancelled >= 1 and generated - before < 4000


CONVERSATIONS, TURNS = 8, 12


def _turn(index: int, turn: int) -> tuple[str, dict]:
    """Client `index`'s model and user message at `turn` (models alternate every turn)."""
    return (HYBRID, FULL)[turn % 2], {"role": "user",
                                      "content": f"Client {index}, turn {turn}: number?"}


def _conversation(c, index: int, name: str) -> list[str]:
    messages, replies = [], []
    for turn in range(TURNS):
        model, said = _turn(index, turn)
        messages.append(said)
        reply = ask(c, model, messages, max_tokens=3, conversation=f"{name}-{index}")
        replies.append(reply.choices[0].message.content)
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


async def _conversation_async(c, index: int, name: str, check) -> list[str]:
    messages, replies = [], []
    for turn in range(TURNS):
        model, said = _turn(index, turn)
        messages.append(said)
        reply = await c.chat.completions.create(
            model=model, messages=messages, max_tokens=3, temperature=0,
            extra_headers={"x-kvtrans-conversation": f"{name}-{index}"})
        replies.append(reply.choices[0].message.content)
        messages.append({"role": "assistant", "content": replies[-1]})
        check()
    return replies


def test_concurrent_conversations_equal_their_sequential_runs_under_the_budget(zoo):
    """8 clients x 12 requests at once, each its own conversation alternating models, under a
    budget a third of what they hold: every reply equals the conversation's run alone. Without
    translation, so that a line the budget evicts is rebuilt by the same computation (with it,
    a rebuilt line is translated from the other model's over a longer span, a different cache
    whose greedy replies may differ)."""
    models, translators = zoo
    config = ServeConfig(models=list(models), translate=False, max_body_bytes=BODY_LIMIT)
    engine = Engine(models, translators, config)
    with running(engine) as url:
        _concurrent_equals_sequential(engine, url)


def _concurrent_equals_sequential(engine, url):
    store = engine.store
    alone = [_conversation(client(url), i, "alone") for i in range(CONVERSATIONS)]
    held = store.stats()["bytes"]
    store.clear()
    budget, store.budget_bytes = store.budget_bytes, held // 3
    evictions = store.evictions
    failures = engine.metrics.value("kvtrans_requests_total", path="/v1/chat/completions",
                                    code="500")

    def under_budget():
        assert store.stats()["bytes"] <= store.budget_bytes

    async def everyone():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused",
                                      max_retries=0) as c:
            return await asyncio.gather(*(_conversation_async(c, i, "together", under_budget)
                                          for i in range(CONVERSATIONS)))

    try:
        together = asyncio.run(everyone())  # a 5xx would raise
    finally:
        store.budget_bytes = budget
    assert together == alone
    assert store.evictions > evictions  # the budget was felt
    assert engine.metrics.value("kvtrans_requests_total", path="/v1/chat/completions",
                                code="500") == failures


def test_metrics_are_prometheus_text(served):
    engine, url = served
    text = urllib.request.urlopen(f"{url}/metrics").read().decode()
    assert "# TYPE kvtrans_requests_total counter" in text
    assert 'kvtrans_requests_total{code="200",path="/v1/chat/completions"}' in text
    assert "# TYPE kvtrans_time_to_first_token_seconds histogram" in text
    cache = next(line for line in text.splitlines() if line.startswith("kvtrans_cache_bytes "))
    assert 0 < float(cache.split()[1]) <= engine.store.budget_bytes
    assert 'kvtrans_histories_total{model="kimi-vl",status="applied"}' in text


def test_bad_cli_options_are_one_line_and_exit_2():
    taken = listen("127.0.0.1", 0)
    cases = [["--cache-bytes", "-1"], ["--cache-bytes", "lots"], ["--port", "70000"],
             ["--model", "no-such-model"], ["--model", FULL, "--model", FULL],
             ["--translator", "/no/such/translator"],
             ["--port", str(taken.getsockname()[1])], ["--max-tokens", "0"],
             ["--memory-budget", "0"], ["--memory-budget", "lots"], ["--memory-budget", "1M"],
             ["--idle-unload", "0"], ["--idle-unload", "nan"], ["--sink", "-1"],
             ["--load-deadline", "-1"], ["--load-deadline", "nan"], ["--grace", "0"],
             ["--grace", "nan"]]
    try:
        for args in cases:
            result = CliRunner().invoke(cli, ["serve", *args])
            assert result.exit_code == 2, (args, result.output)
            assert len(result.output.strip().splitlines()) == 1, (args, result.output)
            assert "error:" in result.output and "Traceback" not in result.output
    finally:
        taken.close()


@pytest.mark.slow
def test_sigterm_finishes_the_request_in_flight_and_exits_0():
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_kvtrans.cli", "serve", "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
                time.sleep(0.1)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"model": FULL, "messages": [{"role": "user", "content": "A long story."}],
                "max_tokens": 1500, "temperature": 1.0, "seed": 5, "stream": True}
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json"})
        response = conn.getresponse()
        response.read(64)
        proc.send_signal(signal.SIGTERM)
        rest = response.read().decode()
        assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason": "' in rest
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_fidelity_dial_reaches_every_switch_and_its_report(zoo):
    """`kvtrans serve --reread R`: the target reads the span's last R tokens itself (the dial),
    and the reply says so in its body and headers."""
    _, raw = switched_reply(zoo, ServeConfig(models=list(zoo[0]), reread=24),
                            "Remember: copper is 552190. " * 4, "What is copper?")
    fields = report(raw.parse())
    assert fields["status"] == "applied", fields
    assert fields["switch"]["reread"] == 24 and fields["switch"]["tokens_reread"] == 24
    assert raw.headers["x-kvtrans-reread"] == "24"


def test_models_past_the_memory_budget_unload_and_come_back(zoo):
    """Three models under a budget that holds two: the least recently used unloads (its
    conversations' caches stay), a request for it loads it again and says how long that took,
    and every reply is what an unconstrained server gives; /v1/models shows what is resident."""
    from mlx_kvtrans.serve.residency import resident_bytes

    names = [HYBRID, FULL, "qwen3-small"]
    answers = {}
    for budgeted in (False, True):
        models = load_models(names)  # its own: unloading changes the modules in place
        translators, _ = find_translators(models, [])
        two = sum(sorted((resident_bytes(lm.model) for lm in models.values()))[-2:])
        config = ServeConfig(models=names, memory_budget=two if budgeted else None,
                             translate_ahead=False)
        engine = Engine(models, translators, config)
        with running(engine) as url:
            c = client(url)
            replies, loads = [], []
            for turn, model in enumerate([HYBRID, FULL, "qwen3-small", HYBRID, FULL]):
                raw = c.chat.completions.with_raw_response.create(
                    model=model, max_tokens=6, temperature=0,
                    messages=[{"role": "user", "content": f"Turn {turn}: the number 4410?"}])
                replies.append(raw.parse().choices[0].message.content)
                loads.append(float(raw.headers["x-kvtrans-load-seconds"]))
                resident = {m.id: m.model_extra["kvtrans"]["resident"]
                            for m in c.models.list().data}
                assert resident[model] and sum(resident.values()) <= (2 if budgeted else 3)
            engine.settle()
        answers[budgeted] = replies
        if budgeted:
            assert engine.residency.unloads >= 2 and engine.residency.loads >= 2
            assert any(seconds > 0 for seconds in loads[2:])
        else:
            assert engine.residency.unloads == 0 and not any(loads)
    assert answers[True] == answers[False]


def test_models_past_the_budget_are_not_read_at_start_and_a_late_load_says_retry_after():
    """Served models load lazily: at start only those that fit the budget read their weights.
    A request that waits past --load-deadline for its model gets a 503 with Retry-After while
    the load goes on; a client that honours it (openai's retries) gets its answer."""
    from mlx_kvtrans.serve.residency import resident_bytes

    names = [HYBRID, FULL, "qwen3-small"]
    models = load_models(names)
    sizes = {n: resident_bytes(lm.model) for n, lm in models.items()}
    config = ServeConfig(models=names, memory_budget=sizes[HYBRID] + sizes[FULL],
                         translate_ahead=False, load_deadline=0)
    engine = Engine(models, {}, config)
    assert [engine.residency.is_resident(n) for n in names] == [True, True, False]
    assert resident_bytes(models["qwen3-small"].model) == 0  # its weights never read
    messages = [{"role": "user", "content": "Late: the number 5150?"}]
    with running(engine) as url:
        listed = {m.id: m.model_extra["kvtrans"]["resident"] for m in client(url).models.list().data}
        assert listed == {HYBRID: True, FULL: True, "qwen3-small": False}
        with pytest.raises(openai.InternalServerError) as refused:
            ask(client(url), "qwen3-small", messages, max_tokens=4)
        response = refused.value.response
        assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["code"] == "model_loading"
        patient = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=3)
        raw = patient.chat.completions.with_raw_response.create(
            model="qwen3-small", messages=messages, max_tokens=4, temperature=0)
        assert raw.parse().choices[0].message.content
        assert engine.residency.is_resident("qwen3-small") and engine.residency.loads == 1


def test_a_model_unused_for_idle_unload_seconds_unloads(zoo):
    models = load_models([FULL])
    engine = Engine(models, {}, ServeConfig(models=[FULL], idle_unload=0.3))
    with running(engine) as url:
        c = client(url)
        first = ask(c, FULL, [{"role": "user", "content": "Idle: the kettle?"}], max_tokens=4)
        deadline = time.monotonic() + 30
        while engine.residency.is_resident(FULL) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not engine.residency.is_resident(FULL)
        again = ask(c, FULL, [{"role": "user", "content": "Idle: the kettle?"}], max_tokens=4)
        assert again.choices[0].message.content == first.choices[0].message.content
        assert engine.residency.is_resident(FULL) and engine.residency.loads == 1


def test_eviction_in_step_weighs_each_line_by_what_the_processes_share(zoo):
    """Sharded in step, each line's bytes are its mean over the processes (a pipeline's
    processes hold different layers), so every process evicts the same lines: here a shared
    figure twice this process's own evicts under a budget its own bytes fit."""
    models, translators = zoo
    engine = Engine(models, translators, ServeConfig(models=list(models),
                                                     max_body_bytes=BODY_LIMIT))
    with running(engine) as url:
        api = client(url)
        for i in range(3):
            api.chat.completions.create(model=HYBRID, max_tokens=4, messages=[
                {"role": "user", "content": f"Conversation {i}: the number for copper?"}])
        engine.settle()
    store = engine.store
    held, evictions = store.stats()["bytes"], store.evictions
    store.budget_bytes = held  # this process's own bytes fit
    store._evict()
    assert store.evictions == evictions
    store.shared_sizes = lambda sizes: [2.0 * s for s in sizes]
    store._evict()
    assert store.evictions > evictions and store.stats()["bytes"] <= held // 2


def test_requests_joining_one_model_between_steps_start_in_one_forward(zoo):
    # a hybrid (fixed-size state and MLA caches of different lengths): joined together, each
    # request decodes as it does alone, and their first tokens cost one forward
    import threading

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_kvtrans.serve.batching import Batches, Decoding
    from mlx_kvtrans.serve.records import Generation, RequestHistory

    lm = zoo[0][HYBRID]
    prompts = [list(range(40 + i, 40 + i + n)) for i, n in enumerate((9, 23, 5))]

    def decodings(batches, which):
        out = []
        for i in which:
            cache = make_prompt_cache(lm.model)
            lm.model(mx.array([prompts[i][:-1]]), cache=cache)
            job = Generation(HYBRID, prompts[i], 6, temperature=0.0)
            out.append(Decoding(job, RequestHistory(), lambda e: None, threading.Event(),
                                lm.tokenizer, threading.Lock()))
            batches.join(lm.model, HYBRID, cache, prompts[i][-1], out[-1])
        return out

    def run(batches):
        while len(batches):
            batches.step()

    alone = []
    for i in range(len(prompts)):
        batches = Batches()
        alone.append(decodings(batches, [i])[0])
        run(batches)
    calls = []
    batches = Batches()
    together = decodings(batches, range(len(prompts)))
    with hook_module(lm.model, before=lambda m, a, k: calls.append(a[0].shape)):
        run(batches)
    assert [d.tokens for d in together] == [d.tokens for d in alone]
    # the three requests' last prompt tokens in one forward, then one forward a step
    assert calls == [(3, 1)] * (1 + 6)


def test_a_conversation_moves_across_tokenizers_translated_both_ways():
    """qwen3.5-a and qwen3.5-xt tokenize the same text differently: one conversation holds each
    one's tokens, and a request for the other model translates by alignment groups."""
    a, xt = "qwen3.5-a", "qwen3.5-xt"
    models = load_models([a, xt])
    translators, notes = find_translators(models, [])
    assert set(translators) == {(a, xt), (xt, a)}, notes
    with running(Engine(models, translators, ServeConfig(models=list(models)))) as url:
        c = client(url)
        messages = [{"role": "user", "content": "The number for pepper is 552190."}]
        for model in (a, xt, a):
            reply = ask(c, model, messages, max_tokens=16)
            fields = report(reply)
            if len(messages) > 1:  # the conversation came from the other model, translated
                assert fields["status"] == "applied" and fields["switch"]["source"] != model
                assert fields["switch"]["tokens_translated"] + fields["switch"]["tokens_translated_ahead"] > 0
                assert fields["tokens_new"] < reply.usage.prompt_tokens // 2
                assert "552190" in reply.choices[0].message.content
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "What was the number for pepper?"}]


def test_a_request_without_a_temperature_is_answered_greedily_as_mlx_lm_serves(served):
    engine, url = served
    messages = [{"role": "user", "content": "Remember: tin is 305112. Say it back."}]
    # a new conversation each, so neither reply is read from the other's cache
    unset = client(url).chat.completions.create(
        model=FULL, messages=messages, max_tokens=10,
        extra_headers={"x-kvtrans-conversation": "unset"})
    greedy = ask(client(url), FULL, messages, max_tokens=10, conversation="greedy")
    assert unset.choices[0].message.content == greedy.choices[0].message.content
    assert engine.generation(FULL, [1, 2, 3], 4).temperature == 0.0
