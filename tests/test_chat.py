"""`kvtrans chat`: bad input keeps the chat going, Ctrl-C keeps what was said, the conversation is
the chat template's, and a saved cache continues in mlx-lm."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache
from typer.testing import CliRunner

import mlx_kvtrans as kv
from mlx_kvtrans.chat import Chat, Transcript
from mlx_kvtrans.cli.chat import converse, terminal_lines
from mlx_kvtrans.cli.main import app
from mlx_kvtrans.errors import KvtransError
from mlx_kvtrans.session import Session
from mlx_kvtrans.translators import artifact

A, B = "kimi-linear", "kimi-vl"
FACT, QUESTION = "The number for pepper is 552190.", "What was the number for pepper?"


@pytest.fixture(scope="module")
def zoo():
    """The shipped kimi-linear and kimi-vl with their shipped translators both ways."""
    a, b = kv.load(A), kv.load(B)
    translators = {(A, B): artifact.load(artifact.shipped(A, B), a, b),
                   (B, A): artifact.load(artifact.shipped(B, A), b, a)}
    return a, b, translators


def new_chat(zoo, tmp_path, max_tokens=12, **options) -> Chat:
    a, b, translators = zoo
    session = Session({A: a, B: b}, translators, active=A)
    return Chat(session, Transcript(tmp_path / "chat.json", {}), max_tokens=max_tokens, **options)


def events(path: Path, kind: str) -> list[dict]:
    return [e for e in json.loads(path.read_text())["events"] if e["kind"] == kind]


def kvtrans_chat(tmp_path, *args, script=None, input=None):
    argv = ["chat", "--transcript", str(tmp_path / "chat.json"), *map(str, args)]
    if script is not None:
        (tmp_path / "script.txt").write_text("\n".join(script) + "\n")
        argv += ["--script", str(tmp_path / "script.txt")]
    return CliRunner().invoke(app, argv, input=input)


def rendered(chat: Chat) -> list[int]:
    """The chat template's tokens for the chat's messages."""
    text = chat.tokenizer.apply_chat_template(chat.messages, tokenize=False)
    return chat.tokenizer.encode(text, add_special_tokens=False)


# -- bad input ----------------------------------------------------------------------------------
def test_bad_commands_print_one_line_each_and_the_chat_goes_on(tmp_path):
    result = kvtrans_chat(tmp_path, "--max-tokens", 4, script=[
        "/switch nosuch", "/strategy bogus", "/frobnicate", "/save", "/who now", FACT])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 5, result.stderr
    assert "unknown model 'nosuch'" in lines[0] and "kimi-vl" in lines[0]
    assert "unknown strategy 'bogus'" in lines[1]
    assert all(name in lines[1] for name in ("segment", "naive", "refresh"))
    assert "unknown command /frobnicate" in lines[2] and "usage: /save" in lines[3]
    assert "Traceback" not in result.output and "internal error" not in result.output
    assert [e["text"] for e in events(tmp_path / "chat.json", "user")] == [FACT]
    assert len(events(tmp_path / "chat.json", "reply")) == 1


def test_blank_lines_are_no_turns(zoo, tmp_path):
    chat = new_chat(zoo, tmp_path)
    for blank in ("", "   ", "\t"):
        with pytest.raises(KvtransError, match="empty line"):
            chat.say(blank)
    assert chat.session.tokens == [] and chat.transcript.events == []
    # piped input: blank lines are skipped, not sent
    result = kvtrans_chat(tmp_path, "--max-tokens", 3, input=f"\n   \n{FACT}\n\n/quit\n")
    assert result.exit_code == 0, result.output
    assert [e["text"] for e in events(tmp_path / "chat.json", "user")] == [FACT]


def test_a_reply_of_one_token_is_counted_in_the_singular(tmp_path):
    result = kvtrans_chat(tmp_path, "--max-tokens", 1, input=f"{FACT}\n/quit\n")
    assert result.exit_code == 0, result.output
    assert "· 1 token in" in result.output and "1 tokens" not in result.output


@pytest.mark.parametrize("option", ["--translator", "--back"])
def test_an_explicit_translator_that_cannot_be_used_is_an_error(tmp_path, option):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(artifact.shipped(A, B) if option == "--translator" else artifact.shipped(B, A),
                    corrupt)
    weights = corrupt / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    (tmp_path / "empty").mkdir()
    other_pair = (artifact.shipped(B, A) if option == "--translator"
                  else artifact.shipped(A, B)).name
    for given, says in ((tmp_path / "missing", "not found"), (tmp_path / "empty", "SHA256SUMS"),
                        (corrupt, "does not match"), (other_pair, "fitted with")):
        result = kvtrans_chat(tmp_path, option, given, script=[FACT])
        assert result.exit_code == 2, (given, result.output)
        assert result.stderr.count("\n") == 1 and says in result.stderr, result.stderr
        assert result.stderr.startswith(f"error: {option} {given}")
        assert not (tmp_path / "chat.json").exists()  # refused before the chat started


def test_banner_names_each_directions_translator_or_why_it_re_reads(model_dirs, tmp_path):
    result = kvtrans_chat(tmp_path, "--translator", "kimi-linear__kimi-vl-distilled", script=[])
    assert result.exit_code == 0, result.output
    assert "kimi-linear -> kimi-vl: translator weights/translators/kimi-linear__kimi-vl-distilled" \
           " (stage 2)" in result.stdout
    assert "kimi-vl -> kimi-linear: translator weights/translators/" \
           "kimi-vl__kimi-linear-distilled (stage 2)" in result.stdout
    header = json.loads((tmp_path / "chat.json").read_text())["translators"]
    assert header["kimi-vl -> kimi-linear"].endswith("(stage 2)")
    # models with no shipped translator: a visible note and re-reading, not an error
    a, b = model_dirs("kimi_linear"), model_dirs("kimi_vl")
    result = kvtrans_chat(tmp_path, "--from", a, "--to", b, "--max-tokens", 2, "--force",
                          script=[FACT, "/switch"])  # --force: the transcript above goes
    assert result.exit_code == 0, result.output
    assert result.stdout.count("no translator shipped, so /switch that way re-reads") == 2
    assert events(tmp_path / "chat.json", "switch")[0]["status"] == "fallback"


# -- Ctrl-C -------------------------------------------------------------------------------------
def test_a_reply_interrupted_from_the_token_callback_is_kept_and_marked(zoo, tmp_path):
    chat = new_chat(zoo, tmp_path, max_tokens=20)
    shown = []

    def impatient(segment):
        shown.append(segment)
        if len(shown) == 3:
            raise KeyboardInterrupt

    reply = chat.say(FACT, on_token=impatient)
    assert reply.interrupted and reply.tokens == 3 and reply.text == "".join(shown)
    logged = events(chat.transcript.path, "reply")[-1]
    assert logged["interrupted"] is True and logged["text"] == reply.text
    # in the conversation: the partial reply, closed as the template closes a reply
    assert chat.messages[-1] == {"role": "assistant", "content": reply.text}
    assert chat.session.tokens == rendered(chat)
    # and the chat goes on from a consistent cache: the next reply is mlx-lm's own continuation
    before = len(chat.session.tokens)
    answer = chat.say(QUESTION)
    opening = rendered_opening(chat, QUESTION)
    start = before + len(opening)
    assert chat.session.tokens[before:start] == opening
    expected = [t for t, _ in generate_step(mx.array(chat.session.tokens[:start]), zoo[0].model,
                                            max_tokens=answer.tokens)]
    assert chat.session.tokens[start:start + answer.tokens] == expected


def rendered_opening(chat: Chat, text: str) -> list[int]:
    """The tokens a user turn `text` opens with, after everything before it (the last two
    messages are that turn and its reply)."""
    tok = chat.tokenizer
    before = tok.apply_chat_template(chat.messages[:-2], tokenize=False)
    after = tok.apply_chat_template(chat.messages[:-2] + [{"role": "user", "content": text}],
                                    tokenize=False, add_generation_prompt=True)
    return tok.encode(after[len(before):], add_special_tokens=False)


def test_ctrl_c_stops_the_reply_at_the_next_token_without_raising(zoo, tmp_path):
    chat = new_chat(zoo, tmp_path, max_tokens=20)
    count = []

    def press_ctrl_c(segment):
        count.append(segment)
        if len(count) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.getsignal(signal.SIGINT)  # ignored where the tests run in the background
    reply = chat.say(FACT, on_token=press_ctrl_c)
    assert reply.interrupted and 2 <= reply.tokens <= 3
    assert chat.session.tokens == rendered(chat)
    assert signal.getsignal(signal.SIGINT) is previous  # given back


class Impatient(Chat):
    """Presses Ctrl-C during its first reply."""

    def say(self, text, on_token=None):
        first = not self.messages

        def token(segment):
            on_token(segment)
            if first:
                os.kill(os.getpid(), signal.SIGINT)

        return super().say(text, token)


@pytest.mark.parametrize("interactive", [True, False])
def test_ctrl_c_in_a_reply_returns_to_the_prompt_at_a_terminal_and_stops_a_script(
        zoo, tmp_path, interactive):
    a, b, translators = zoo
    chat = Impatient(Session({A: a, B: b}, translators, active=A),
                     Transcript(tmp_path / "chat.json", {}), max_tokens=8)
    code = converse(chat, [FACT, QUESTION], interactive=interactive)
    replies = events(tmp_path / "chat.json", "reply")
    assert replies[0]["interrupted"] is True
    if interactive:
        assert code == 0 and len(replies) == 2 and replies[1]["interrupted"] is False
    else:
        assert code == 130 and len(replies) == 1


def test_ctrl_c_while_translating_ahead_finishes_it_then_stops_the_chat(zoo, tmp_path):
    """A press once the reply is whole is not lost: the translation ahead finishes, the reply
    stays whole, and the chat stops as between turns (a script stops with 130)."""
    chat = new_chat(zoo, tmp_path, max_tokens=6, translate_ahead=True)
    translate_ahead = chat.translate_ahead

    def pressed_meanwhile():
        os.kill(os.getpid(), signal.SIGINT)
        return translate_ahead()

    chat.translate_ahead = pressed_meanwhile
    with pytest.raises(KeyboardInterrupt):
        converse(chat, [FACT, QUESTION], interactive=False)
    replies = events(tmp_path / "chat.json", "reply")
    assert len(replies) == 1 and replies[0]["interrupted"] is False
    assert B in chat.session.lines and chat.session.lines[B].seen > 0  # translated ahead


def test_terminal_lines_edit_keep_history_and_leave_on_an_empty_ctrl_c():
    import threading
    import time

    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    left, up = "\x1b[D", "\x1b[A"
    for leave in ("\x03", "\x04"):  # Ctrl-C, Ctrl-D
        typed = [f"abc{left}{left}X\r",  # arrows move the cursor, they insert nothing
                 "half typed\x03",        # Ctrl-C clears a typed line ...
                 f"{up}\r",               # ... which Up brings back
                 leave]                   # on an empty line: the lines end
        with create_pipe_input() as keys:
            def typist():  # a person's pace: the prompt reads its history between keys
                for chunk in typed:
                    time.sleep(0.1)
                    keys.send_text(chunk)

            threading.Thread(target=typist, daemon=True).start()
            assert list(terminal_lines(keys, DummyOutput())) == ["aXbc", "half typed"]


# -- the conversation and /save -----------------------------------------------------------------
def test_the_conversation_is_the_chat_templates_rendering(zoo, tmp_path):
    chat = new_chat(zoo, tmp_path, max_tokens=3, system="You are a helpful assistant.")
    chat.say(FACT)  # cut at max_tokens: closed all the same
    chat.command("/switch")
    chat.say(QUESTION)
    assert chat.messages[0]["role"] == "system" and len(chat.messages) == 5
    assert chat.session.tokens == rendered(chat)


def test_save_holds_the_whole_conversation_and_mlx_lm_continues_it(zoo, tmp_path):
    chat = new_chat(zoo, tmp_path)
    chat.say(FACT)
    chat.command("/switch")
    chat.say(QUESTION)
    shown = chat.command(f"/save {tmp_path / 'conversation'}")
    path = tmp_path / "conversation.safetensors"  # mlx names it so: the message says it
    assert str(path) in shown and "mlx_lm.generate --prompt-cache-file" in shown
    cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    offsets = {c.offset for c in cache if hasattr(c, "offset")}
    assert offsets == {len(chat.session.tokens)} == {len(rendered(chat))}
    assert metadata["model"] == str(zoo[1].path.resolve())
    # mlx-lm continues the file with the next turn exactly as the chat continues its cache
    command = chat.continue_command(path, QUESTION)
    prompt = command[command.index("--prompt") + 1].replace("\\n", "\n")
    before = len(chat.session.tokens)
    reply = chat.say(QUESTION)
    turn = chat.tokenizer.encode(prompt, add_special_tokens=False)
    assert chat.session.tokens[before:before + len(turn)] == turn
    continued = [t for t, _ in generate_step(mx.array(turn), zoo[1].model, prompt_cache=cache,
                                             max_tokens=reply.tokens)]
    assert continued == chat.session.tokens[before + len(turn):before + len(turn) + reply.tokens]


def test_save_refuses_what_it_cannot_write(zoo, tmp_path):
    chat = new_chat(zoo, tmp_path)
    with pytest.raises(KvtransError, match="empty"):
        chat.command(f"/save {tmp_path / 'c'}")
    chat.say(FACT)
    with pytest.raises(KvtransError, match="no directory"):
        chat.command(f"/save {tmp_path / 'nowhere' / 'c'}")
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(KvtransError, match="is a directory"):
        chat.command(f"/save {tmp_path / 'd'}")
    saved = tmp_path / "e.safetensors"
    saved.write_bytes(b"kept")
    with pytest.raises(KvtransError, match="already exists"):  # as --transcript: no surprise
        chat.command(f"/save {tmp_path / 'e'}")
    assert saved.read_bytes() == b"kept"
    assert "saved" in chat.command(f"/save --force {tmp_path / 'e'}")
    assert saved.stat().st_size > 4


def test_save_writes_into_a_folder_it_is_given_and_refuses_other_suffixes(zoo, tmp_path):
    chat = new_chat(zoo, tmp_path)
    chat.say(FACT)
    folder = tmp_path / "saves"
    folder.mkdir()
    assert "saved" in chat.command(f"/save {folder}")
    assert (folder / "conversation.safetensors").is_file()
    assert not (tmp_path / "saves.safetensors").exists()
    with pytest.raises(KvtransError, match="ends in .safetensors"):
        chat.command(f"/save {tmp_path / 'x.json'}")
    assert not list(tmp_path.glob("x.json*"))


def test_save_records_an_absolute_model_path(model_dirs, tmp_path, monkeypatch):
    directory = model_dirs("kimi_vl")
    monkeypatch.chdir(directory.parent)
    lm = kv.load(directory.name)  # named relative to the working directory
    chat = Chat(Session({"m": lm}), Transcript(tmp_path / "chat.json", {}), max_tokens=2)
    chat.say(FACT)
    chat.save(tmp_path / "c.safetensors")
    _, metadata = load_prompt_cache(str(tmp_path / "c.safetensors"), return_metadata=True)
    assert metadata["model"] == str(directory.resolve())


@pytest.mark.slow  # spawns mlx_lm.generate
def test_the_printed_mlx_lm_command_continues_the_conversation(zoo, tmp_path):
    chat = new_chat(zoo, tmp_path, max_tokens=16)
    chat.say(FACT)
    shown = chat.command(f"/save {tmp_path / 'c.safetensors'}")
    command = shlex.split(shown.splitlines()[-1].replace("YOUR MESSAGE", QUESTION))
    reply = chat.say(QUESTION)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    executable = Path(sys.executable).parent / command[0]
    proc = subprocess.run([str(executable), *command[1:], "--max-tokens", "16"], cwd=elsewhere,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert reply.text and reply.text in proc.stdout


# -- a chat over the tiny kimi pair (conftest's `kimi_pair`: uncalibrated, so switches apply) --
def tiny_session(kimi_pair, both=True) -> Session:
    a, b, paths = kimi_pair
    return Session({a.name: a, b.name: b}, {key: artifact.load(p) for key, p in paths.items()
                                            if both or key == (a.name, b.name)}, active=a.name)


def test_saved_session_cache_continues_in_mlx_lm(kimi_pair, tmp_path):
    from mlx_kvtrans.tools.verify import max_abs_diff

    a, b, _ = kimi_pair
    s = tiny_session(kimi_pair)
    s.add(list(range(30, 60)))
    list(s.generate(3))
    s.switch(b.name)
    chat = Chat(s, Transcript(tmp_path / "t.json", {}))
    message = chat.command(f"/save {tmp_path / 'c.safetensors'}")
    assert "saved" in message
    x = mx.array([[9, 8, 7]])
    reloaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert max_abs_diff(b.model(x, cache=reloaded), b.model(x, cache=s.lines[b.name].cache)) \
        <= 1e-5


def test_chat_shows_what_each_model_records(kimi_pair, tmp_path):
    a, b, _ = kimi_pair
    s = tiny_session(kimi_pair, both=False)
    s.add(list(range(30, 50)))
    list(s.generate(3))
    shown = Chat(s, Transcript(tmp_path / "t.json", {})).command("/who").splitlines()
    assert f"records {s.lines[a.name].bytes_per_token:,.0f} bytes a token" in shown[0]
    assert "records 0 bytes a token, holds 0.0 KiB" in shown[1]


def chat_script(tmp_path, lines) -> Path:
    path = tmp_path / "script.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow  # spawns subprocesses
def test_scripted_chat_with_two_switches(kimi_pair, tmp_path):
    a, b, paths = kimi_pair
    script = chat_script(tmp_path, ["hello there", "/switch", "and you?", "/switch", "bye"])
    transcript = tmp_path / "chat.json"
    cmd = [sys.executable, "-m", "mlx_kvtrans.cli.main", "chat", "--from", a.name, "--to", b.name,
           "--translator", str(paths[(a.name, b.name)]), "--back", str(paths[(b.name, a.name)]),
           "--script", str(script), "--transcript", str(transcript), "--max-tokens", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    chat_events = json.loads(transcript.read_text())["events"]
    switches = [e for e in chat_events if e["kind"] == "switch"]
    assert [e["status"] for e in switches] == ["applied", "applied"]
    replies = [e["model"] for e in chat_events if e["kind"] == "reply"]
    assert replies == [a.name, b.name, a.name]


@pytest.mark.slow  # spawns subprocesses
def test_killed_chat_keeps_its_transcript(kimi_pair, tmp_path):
    import time

    a, b, paths = kimi_pair
    # turns enough that the chat is still going when it is signalled
    script = chat_script(tmp_path, ["turn one"] + ["another turn"] * 5000)
    transcript = tmp_path / "chat.json"
    cmd = [sys.executable, "-m", "mlx_kvtrans.cli.main", "chat", "--from", a.name, "--to", b.name,
           "--translator", str(paths[(a.name, b.name)]), "--script", str(script),
           "--transcript", str(transcript), "--max-tokens", "20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if transcript.exists() and '"reply"' in transcript.read_text():
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    chat_events = json.loads(transcript.read_text())["events"]  # complete, valid JSON
    assert chat_events[0] == {**chat_events[0], "kind": "user", "text": "turn one"}
    assert any(e["kind"] == "reply" for e in chat_events)
    # Ctrl-C: exit 130, transcript saved
    transcript = tmp_path / "chat2.json"
    cmd[cmd.index("--transcript") + 1] = str(transcript)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (transcript.exists() and
                                          '"reply"' in transcript.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=60)
    stderr = proc.stderr.read()
    assert code == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    assert any(e["kind"] == "reply" for e in json.loads(transcript.read_text())["events"])


def test_translating_ahead_leaves_a_switch_the_last_turn_and_gives_the_same_cache(zoo,
                                                                                    tmp_path):
    ahead = new_chat(zoo, tmp_path, max_tokens=6, translate_ahead=True)
    (tmp_path / "plain").mkdir()
    plain = new_chat(zoo, tmp_path / "plain", max_tokens=6)
    for chat in (ahead, plain):
        chat.say(FACT)
    assert ahead.session.ahead[B].tokens_translated > 0 and not plain.session.ahead
    shown = ahead.command("/switch")
    status, alone = ahead.session.switches[-1], plain.switch()
    assert status.tokens_translated_ahead > 0
    assert f"{status.tokens_translated_ahead} of them ahead" in shown
    # made ahead and now together: the span, outcome and reach of one switch made now
    assert status.status == alone.status
    assert (status.tokens_translated + status.tokens_tail + status.tokens_fallback
            == alone.tokens_translated + alone.tokens_tail + alone.tokens_fallback)
    assert ahead.session.lines[B].seen == plain.session.lines[B].seen
    assert len(events(tmp_path / "chat.json", "ahead")) == 1


def test_a_scripted_chat_across_tokenizers_applies_its_switches_and_answers(tmp_path):
    """qwen3.5-a and qwen3.5-xt read different tokens of the conversation: each switch
    translates through the shipped translator, and the model switched to answers the number."""
    result = kvtrans_chat(tmp_path, "--from", "qwen3.5-a", "--to", "qwen3.5-xt",
                          script=[FACT, "/switch", QUESTION, "/switch", QUESTION])
    assert result.exit_code == 0, result.output
    assert "no translator" not in result.output
    switches = events(tmp_path / "chat.json", "switch")
    assert [e["status"] for e in switches] == ["applied", "applied"]
    replies = events(tmp_path / "chat.json", "reply")
    assert [e["model"] for e in replies] == ["qwen3.5-a", "qwen3.5-xt", "qwen3.5-a"]
    assert all("552190" in e["text"] for e in replies[1:])
