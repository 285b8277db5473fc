"""`redrafter-mlx chat`: command parsing, history trimming, KV-cache reuse, and the real command
driven in a pseudo-terminal (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import chat_session, decoder_for, decoding_of, make_runtime, tiny_llama
from support.chat import EOS, ToyTokenizer, ask, encode_text, session, toy_template

from redrafter_mlx.backend.cpu import blas
from redrafter_mlx.cli.chat import (
    ChatSession,
    Command,
    accepted_sources,
    drop_oldest_turn,
    fit_history,
    parse_beam,
    parse_command,
    parse_lookup,
    parse_temp,
    save_conversation,
    unknown_hint,
)
from redrafter_mlx.core.decode.cache import common_prefix
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import random_drafter
from redrafter_mlx.core.errors import ContextFull
from redrafter_mlx.core.serving.session import Session

ROOT = Path(__file__).resolve().parent.parent


def fresh_answer(target, messages: list[dict], max_tokens: int) -> str:
    """The autoregressive answer for ``messages`` from an empty cache (no reuse)."""
    ids = toy_template(messages)
    chat = Session(decoder_for(target), ToyTokenizer(), decoding_of(), warm=False)
    return "".join(r.text for r in chat.generate(ids, max_tokens=max_tokens))


# ---------------------------------------------------------------- parsing


def test_parse_command():
    assert parse_command("hello /beam") is None
    assert parse_command("/beam 2 4") == Command("beam", "2 4")
    assert parse_command("/SYSTEM  Be brief. ") == Command("system", "Be brief.")
    assert parse_command("/quit") == Command("quit", "")


def test_parse_beam_and_temp():
    assert parse_beam("2 4") == BeamShape(2, 4)
    assert parse_beam("2 4 0.3") == BeamShape(2, 4, 0.3)
    assert parse_beam("2 4", 0.3) == BeamShape(2, 4, 0.3)  # keeps the current floor
    assert parse_beam("2 4", 0.3, 16) == BeamShape(2, 4, 0.3, 16)  # and search width
    assert parse_beam("4 5 0 16") == BeamShape(4, 5, 0.0, 16)
    assert parse_beam("4 5 0.2 1", 0.3, 16) == BeamShape(4, 5, 0.2)  # S <= W: the plain search
    for bad in ("", "2", "2 x", "2 4 x", "2 4 0.3 x", "2 4 0.3 1.5", "2 4 0.3 1 2", "-1 4"):
        with pytest.raises(ValueError, match="usage"):
            parse_beam(bad)
    for bad in ("0 4", "2 4 1.5"):
        with pytest.raises(ValueError):
            parse_beam(bad)  # BeamShape's own checks
    assert parse_temp("0.7") == 0.7
    for bad in ("", "hot", "-1", "nan"):
        with pytest.raises(ValueError, match="usage"):
            parse_temp(bad)


def test_parse_lookup_and_accepted_sources():
    assert parse_lookup("4") == 4 and parse_lookup("0") == 0
    for bad in ("", "x", "-1", "+2", "1.5", "2 3", "²"):  # "²": str.isdigit, not int()
        with pytest.raises(ValueError, match="usage: /lookup K"):
            parse_lookup(bad)
    counts = Counter(drafter=40, lookup=12, both=3)
    assert accepted_sources(counts) == "drafter 40, lookup 12, both 3"
    assert accepted_sources(Counter(lookup=5)) == "drafter 0, lookup 5, both 0"
    assert accepted_sources(Counter(lookup=5), drafted=False) == "lookup 5"


def test_unknown_command_hint():
    assert "/beam" in unknown_hint("beams")
    assert "/help" in unknown_hint("zzz")


# ---------------------------------------------------------------- history


def turns(n: int, system: bool = True) -> list[dict]:
    msgs = [{"role": "system", "content": "sys"}] if system else []
    for i in range(n):
        msgs += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    return msgs


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_drop_oldest_turn_keeps_system_and_last_turn():
    msgs = turns(2) + [{"role": "user", "content": "now"}]
    shorter = drop_oldest_turn(msgs)
    assert [m["content"] for m in shorter] == ["sys", "q1", "a1", "now"]
    assert drop_oldest_turn(shorter) == [msgs[0], msgs[-1]]  # the system message, the last turn
    assert drop_oldest_turn([msgs[0], msgs[-1]]) is None  # the last turn is never dropped
    assert [m["content"] for m in drop_oldest_turn(turns(2, system=False))] == ["q1", "a1"]


def test_fit_history_drops_oldest_turns_then_refuses():
    msgs = turns(3) + [{"role": "user", "content": "now"}]
    full = toy_template(msgs)
    kept, ids, dropped = fit_history(msgs, toy_template, len(full))
    assert (kept, ids, dropped) == (msgs, full, 0)
    kept, ids, dropped = fit_history(msgs, toy_template, len(full) - 1)
    assert dropped == 1 and [m["content"] for m in kept][:2] == ["sys", "q1"]
    assert len(ids) <= len(full) - 1 and ids == toy_template(kept)
    kept, _, dropped = fit_history(msgs, toy_template, len(toy_template([msgs[0], msgs[-1]])))
    assert dropped == 3 and kept == [msgs[0], msgs[-1]]
    with pytest.raises(ContextFull, match="needs"):
        fit_history(msgs, toy_template, 3)


def test_save_conversation_is_atomic(tmp_path):
    path = tmp_path / "chat.json"
    save_conversation(path, {"messages": turns(1)})
    save_conversation(path, {"messages": turns(2)})
    assert json.loads(path.read_text())["messages"] == turns(2)
    assert [p.name for p in tmp_path.iterdir()] == ["chat.json"]  # no temp file left


# ---------------------------------------------------------------- cache reuse (tiny model)


def test_second_turn_prefills_only_new_tokens(target):
    chat = session(target, max_tokens=8)
    first = ask(chat, "hello there")
    assert chat.last.prompt_tokens == len(toy_template(chat.messages[:1]))
    assert chat.last.reused_tokens == 0
    before = list(chat.session.sequence.ids)
    second = ask(chat, "and again")
    conversation = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "and again"},
    ]
    full = toy_template(conversation)
    reused = common_prefix(before, full)
    assert reused >= len(toy_template(conversation[:1])) + len(first) - 1
    assert chat.last.reused_tokens == reused
    assert chat.last.prompt_tokens == chat.last.stats.prompt_tokens == len(full) - reused
    # at most: the last answer token, <eos> <user> "and again" <eos> <assistant>
    assert chat.last.prompt_tokens <= 1 + 2 + len(encode_text("and again")) + 2
    assert second == fresh_answer(target, conversation, 8)
    assert chat.totals.answers == 2 and chat.totals.tokens == 16


def test_redrafter_chat_equals_autoregressive(target, drafter):
    beam = BeamDrafter(drafter, target.model.embed_tokens)
    fast, slow = session(target, beam, max_tokens=10), session(target, max_tokens=10)
    for question in ("abc", "defg", "hi"):
        assert ask(fast, question) == ask(slow, question)
    fast.set_shape(BeamShape(3, 2))  # /beam mid-conversation
    assert ask(fast, "more") == ask(slow, "more")
    assert fast.messages == slow.messages


def test_answers_compile_nothing_after_a_shape_or_sampler_change(traces):
    """The session compiles at its start, /beam and /temp, never inside an answer (where g++ on
    the CPU backend would swallow Ctrl-C)."""
    model = tiny_llama(seed=11)  # built after ``traces`` patched mx.compile: its traces count
    beam = BeamDrafter(random_drafter(64, 64, seed=12), model.model.embed_tokens)
    chat = session(model, beam, max_tokens=24)
    for change in (None, BeamShape(3, 3), BeamShape(2, 4, 0.05), 0.8):
        if isinstance(change, BeamShape):
            chat.set_shape(change)
        elif change is not None:
            chat.set_temperature(change)
        warmed = len(traces)
        for question in ("abc", "defg", "a longer question"):
            ask(chat, question)
        assert len(traces) == warmed, f"an answer compiled after {change}"


def test_interrupted_answer_stays_in_history(target):
    chat = session(target, max_tokens=20)
    responses = chat.reply("tell me a long story")
    shown = next(responses).text + next(responses).text
    responses.close()  # what Ctrl-C does
    assert chat.messages[-1] == {"role": "assistant", "content": shown}
    assert chat.session.sequence.offset == len(chat.session.sequence.ids)
    ask(chat, "next")
    assert chat.last.reused_tokens > 0 and len(chat.messages) == 4


def test_context_full_trims_then_refuses(target):
    chat = session(target, max_tokens=4, max_context=48)
    dropped = []
    for question in ("one two three", "four five six", "seven eight nine"):
        ask(chat, question)
        dropped.append(chat.last.dropped_turns)
        assert len(toy_template(chat.conversation())) <= 48
    assert dropped[0] == 0 and sum(dropped) > 0  # oldest turns dropped to make room
    assert chat.messages[0]["content"] != "one two three"
    assert chat.last.stats.prompt_tokens + chat.last.reused_tokens == len(
        toy_template(chat.conversation()[:-1])
    )
    before = list(chat.messages)
    with pytest.raises(ContextFull):
        ask(chat, "x" * 60)
    assert chat.messages == before  # refused, conversation unchanged
    ask(chat, "ok")  # and it still works


def test_reset_and_system_prompt(target):
    chat = session(target, max_tokens=4)
    ask(chat, "hi")
    chat.system = "be brief"
    ask(chat, "again")
    assert chat.last.reused_tokens == 0  # the system prompt comes first: nothing shared
    assert chat.conversation()[0] == {"role": "system", "content": "be brief"}
    chat.reset()
    assert chat.messages == [] and chat.session.sequence.offset == 0
    ask(chat, "hi")
    assert chat.last.prompt_tokens == len(toy_template(chat.conversation()[:2]))


# ---------------------------------------------------------------- the real command (slow)


def save_and_quit(child, prompt: str, saved) -> None:
    """At the chat's next prompt: /save the conversation to ``saved``, then /quit (exit 0)."""
    import pexpect

    child.expect(prompt)
    child.sendline(f"/save {saved}")
    child.expect("saved")
    child.expect(prompt)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


EXPECTED_SCRIPT = """
import json, sys
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.cli.chat import encoder
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.serving.session import Session
record = json.load(open(sys.argv[1]))
runtime = rt.load_runtime(None, None, need_drafter=False)
plain = rt.decoding(runtime, runtime.plan.default_shape, mode=Mode.AUTOREGRESSIVE)
encode, messages, out = encoder(runtime), record["messages"], []
for i, m in enumerate(messages):
    if m["role"] == "assistant":
        ids = encode(messages[:i])
        answer = Session(runtime.decoder, runtime.tokenizer, plain, warm=False)
        out.append("".join(r.text for r in answer.generate(ids, max_tokens=int(sys.argv[2]))))
print(json.dumps(out))
"""


def env(**extra: str) -> dict:
    e = dict(os.environ, NO_COLOR="1", TERM="dumb", COLUMNS="200", **extra)
    if os.path.exists(blas.OPENBLAS):
        e["LD_PRELOAD"] = blas.OPENBLAS
    return e


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> str:
    """The shipped drafter if present, else random weights (greedy output is exact anyway)."""
    shipped = ROOT / "weights" / "smollm2-135m-instruct-drafter"
    if (shipped / "config.json").is_file():
        return str(shipped)
    from redrafter_mlx.core.drafters.redrafter import random_drafter, save_drafter

    out = tmp_path_factory.mktemp("drafter")
    save_drafter(random_drafter(576, 49152, seed=0, head="target", draft_vocab_size=4096), out)
    return str(out)


def autoregressive_answers(saved: Path, max_tokens: int) -> list[str]:
    """Greedy autoregressive answers, each from an empty cache, for a saved conversation."""
    done = subprocess.run(
        [sys.executable, "-c", EXPECTED_SCRIPT, str(saved), str(max_tokens)],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# soak: the longest test of make test's first pass (its autoregressive reference alone decodes
# four answers of up to 160 tokens in a second process); the terminal's Ctrl-C, the piped chat
# and the chat's exactness on tiny models stay in make test (the tests below and above).
@pytest.mark.slow
@pytest.mark.soak
def test_chat_in_a_terminal(tmp_path, drafter_dir):
    pexpect = pytest.importorskip("pexpect")
    # 160 tokens: the story below streams for seconds, room for a second Ctrl-C (see there)
    saved, max_tokens = tmp_path / "chat.json", 160
    child = pexpect.spawn(
        sys.executable,
        ["-m", "redrafter_mlx", "chat", "--drafter", drafter_dir, "--max-tokens", str(max_tokens)],
        cwd=str(ROOT),
        env=env(TMPDIR=str(tmp_path)),
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 200),
    )
    prompt = ">>> "
    child.expect(prompt)
    # A pruned W2 shape verifies trees of 1..7 nodes. /beam compiles every one of those sizes
    # (MLX builds CPU kernels with g++, here in a fresh TMPDIR), so no answer compiles: a size
    # first met inside the interrupted answer below would build kernels there, and g++ running
    # swallows the Ctrl-C.
    child.sendline("/beam 2 4 0.3")
    child.expect("W=2 L=4 min-prob 0.3")
    child.expect(prompt)
    for line in ("My name is Ada.", "What is my name?"):
        child.sendline(line)
        child.expect("tokens/step")
        child.expect(prompt)
    child.sendline("/stats")
    child.expect("speedup estimate")
    child.expect(prompt)
    child.sendline("/nope")
    child.expect("/help")
    child.expect(prompt)
    child.sendline("Write a long story about a dragon who learns to cook.")
    child.expect_exact("cook.")  # the echo of the line
    child.expect(r"\w\w")  # the first streamed text
    child.sendintr()
    if child.expect(["interrupted", pexpect.TIMEOUT], timeout=1.0) == 1:
        # Twice in about ten full runs (never alone, never under load) this first Ctrl-C was
        # lost and the answer ran to its end. MLX builds CPU kernels through system(), which
        # ignores SIGINT while g++ runs; no compile inside an answer was seen when probing.
        warnings.warn(
            "the first Ctrl-C did not stop the answer within 1 s; sent another", stacklevel=1
        )
        child.sendintr()
        child.expect("interrupted")
    child.expect(prompt)
    child.sendline("What was the story about?")
    child.expect("tokens/step")
    save_and_quit(child, prompt, saved)

    messages = json.loads(saved.read_text())["messages"]
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert [m["content"] for m in messages if m["role"] == "user"][:2] == [
        "My name is Ada.",
        "What is my name?",
    ]
    assert len(answers) == 4
    expected = autoregressive_answers(saved, max_tokens)
    assert answers[:2] == expected[:2]
    assert answers[3] == expected[3]  # after the interrupted answer, with it in the history
    assert expected[2].startswith(answers[2]) and answers[2] != expected[2]


@pytest.mark.slow
def test_chat_piped_stdin(drafter_dir):
    lines = "My name is Ada.\n/stats\n\nWhat is my name?\n"
    runs = [
        subprocess.run(
            [sys.executable, "-m", "redrafter_mlx", "chat", *flags, "--max-tokens", "16"],
            input=lines,
            capture_output=True,
            text=True,
            env=env(),
            cwd=ROOT,
            timeout=300,
        )
        for flags in (["--drafter", drafter_dir], ["--autoregressive"])
    ]
    for done in runs:
        assert done.returncode == 0, done.stderr
        assert "\x1b[" not in done.stdout and ">>>" not in done.stdout
        assert done.stderr.count("tokens/step") >= 2
    fast, slow = (done.stdout for done in runs)
    assert fast == slow
    assert "answers 1" in runs[0].stderr  # piped: notices and /stats go to stderr


def test_piped_chat_keeps_one_output_line_per_input_line(target, capsys):
    """A message too long for the context gets an empty answer line on stdout (the reason on
    stderr), so the answers stay aligned with the input lines."""
    from types import SimpleNamespace

    from redrafter_mlx.cli.chat import ChatOptions, ChatUI

    runtime = SimpleNamespace(model_id="tiny", drafter_id=None)
    ui = ChatUI(
        session(target, max_tokens=4, max_context=48),
        runtime,
        ChatOptions(),
        "default",
        interactive=False,
    )
    for text in ("hi", "x" * 60, "ok"):
        ui.answer(text)
    out, err = capsys.readouterr()
    lines = out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[-1] == ""  # 3 answers, the 2nd empty
    assert "cannot answer" in err


def test_a_long_prompt_reports_its_reading_between_chunks_and_a_short_one_shows_nothing(
    target, capsys, monkeypatch
):
    """``on_prompt`` hears the new tokens read so far after each prompt chunk (8 tokens here);
    the chat's progress line shows once reading has taken PROMPT_NOTE_AFTER seconds."""
    from redrafter_mlx.backend.plan import GENERIC_PLAN
    from redrafter_mlx.cli import chat as chat_cli
    from redrafter_mlx.cli.chat import ChatOptions, ChatUI

    plan = replace(GENERIC_PLAN, prefill_chunk=8)
    chat = session(target, max_tokens=2, plan=plan)
    heard = []
    ask_long = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20"
    answer = "".join(r.text for r in chat.reply(ask_long, on_prompt=lambda *x: heard.append(x)))
    total = chat.last.prompt_tokens
    assert total > 16 and heard == [(n, total) for n in range(8, total, 8)]
    assert answer == fresh_answer(target, chat.messages[:1], 2)
    runtime = SimpleNamespace(model_id="tiny", drafter_id=None)
    for after, shown in ((1e9, False), (0.0, True)):
        monkeypatch.setattr(chat_cli, "PROMPT_NOTE_AFTER", after)
        ui = ChatUI(
            session(target, max_tokens=2, plan=plan),
            runtime,
            ChatOptions(),
            "default",
            interactive=False,
        )
        ui.answer(ask_long)
        err = capsys.readouterr().err
        assert ("reading the prompt" in err) is shown
        if shown:
            assert f"reading the prompt ({total} tokens): 8/{total}" in err


def test_a_ctrl_c_whose_exception_is_swallowed_still_stops_the_answer(target, capsys):
    """The chat's SIGINT handler remembers the interrupt: when code between two tokens swallows
    the KeyboardInterrupt, the answer stops at the next token and keeps what was shown."""
    import signal
    from types import SimpleNamespace

    from redrafter_mlx.cli.chat import ChatOptions, ChatUI

    runtime = SimpleNamespace(model_id="tiny", drafter_id=None)
    chat = session(target, max_tokens=12)
    ui = ChatUI(chat, runtime, ChatOptions(), "default", interactive=False)
    shown = []

    def show(text):
        shown.append(text)
        if len(shown) == 2:
            try:
                ui.ctrl_c(signal.SIGINT, None)  # what the signal runs, inside library code...
            except KeyboardInterrupt:
                pass  # ...that swallows the exception
        sys.stdout.write(text)

    ui.show = show
    ui.answer("tell me more")
    assert len(shown) == 2 < 12
    assert "interrupted" in capsys.readouterr().err
    assert chat.messages[-1] == {"role": "assistant", "content": "".join(shown)}
    ui.show = lambda text: shown.append(text)  # the next answer is not cut by the old Ctrl-C
    ui.answer("go on")
    assert len(shown) == 2 + 12


def test_a_beam_wider_than_the_draft_vocabulary_is_refused_and_nothing_changes(target):
    """/beam 65 3 with a 64-token drafter: refused, and the session keeps its shape and works
    (it used to keep the refused shape and crash on the next answer)."""
    beam = BeamDrafter(random_drafter(64, 64, seed=1), target.model.embed_tokens)
    chat = session(target, beam, max_tokens=6)
    ask(chat, "abc")
    for too_wide in (BeamShape(65, 3), BeamShape(2, 3, search_width=65)):
        with pytest.raises(ValueError, match="65 beams exceed the drafter's vocabulary"):
            chat.set_shape(too_wide)
    assert chat.shape == BeamShape(2, 3)
    assert ask(chat, "def") and chat.messages[-1]["role"] == "assistant"


def test_redrafter_chat_drops_old_turns_exactly_when_plain_decoding_does(target):
    """Near the context's end the two modes keep the same history and give the same answers
    (ReDrafter used to reserve W * L tokens more and drop turns earlier)."""
    beam = BeamDrafter(random_drafter(64, 64, seed=1), target.model.embed_tokens)
    options = {"tokenizer": ToyTokenizer(), "max_context": 64, "max_tokens": 8}
    fast = chat_session(target, beam, BeamShape(4, 4), toy_template, **options)
    slow = chat_session(target, beam, BeamShape(4, 4), toy_template, autoregressive=True, **options)
    assert fast.room() == slow.room()
    for question in ("one two three", "four five", "six", "seven eight nine ten"):
        assert ask(fast, question) == ask(slow, question)
        assert fast.last.dropped_turns == slow.last.dropped_turns
    assert fast.messages == slow.messages


def test_a_line_that_is_not_utf8_is_one_error_line_and_the_chat_goes_on(
    target, monkeypatch, capsys
):
    """Undecodable input bytes reach the chat as lone surrogates (surrogateescape); the
    tokenizer would raise a TypeError and end the session with the conversation lost."""
    import io
    from types import SimpleNamespace

    from redrafter_mlx.cli.chat import ChatOptions, ChatUI

    raw = io.TextIOWrapper(io.BytesIO(b"hi\n\xfe oops\nok\n"), errors="surrogateescape")
    monkeypatch.setattr("sys.stdin", raw)
    chat = session(target, max_tokens=4)
    ui = ChatUI(
        chat,
        SimpleNamespace(model_id="t", drafter_id=None),
        ChatOptions(),
        "default",
        interactive=False,
    )
    ui.run()
    out, err = capsys.readouterr()
    assert "input: byte 0xfe at byte offset 0 is not UTF-8 text" in err
    assert len(out.splitlines()) == 2 and chat.totals.answers == 2  # both good lines answered


# ---------------------------------------------------------------- prompt-lookup beams (#24)

SMALL_ROLE = {"system": 0, "user": 2, "assistant": 3}


def small_template(messages: list[dict]) -> list[int]:
    """``toy_template`` for an 8-token vocabulary: text folds onto tokens 4..7."""
    ids = []
    for m in messages:
        ids += [SMALL_ROLE[m["role"]], *(ord(c) % 4 + 4 for c in m["content"]), EOS]
    return ids + [SMALL_ROLE["assistant"]]


@pytest.fixture(scope="module")
def looping():
    """A target whose greedy answers fall into loops lookup beams can copy (8 tokens, seed 5),
    and a drafter for it."""
    model = tiny_llama(seed=5, vocab=8)
    return model, BeamDrafter(random_drafter(64, 8, seed=4), model.model.embed_tokens)


def small_session(model, drafter=None, shape=None, **kwargs) -> ChatSession:
    shape = shape or BeamShape(2, 4, lookup=3)
    return chat_session(model, drafter, shape, small_template, tokenizer=ToyTokenizer(), **kwargs)


def chat_ui(chat: ChatSession, source: str = "default"):
    from redrafter_mlx.cli.chat import ChatOptions, ChatUI

    runtime = SimpleNamespace(model_id="tiny", drafter_id=None)
    return ChatUI(chat, runtime, ChatOptions(), source, interactive=False)


def test_lookup_command_sets_k_keeps_the_rest_and_refuses_bad_values(target, capsys):
    beam = BeamDrafter(random_drafter(64, 64, seed=1), target.model.embed_tokens)
    chat = session(target, beam, max_tokens=6)
    chat.set_shape(BeamShape(2, 3, 0.05, 4))
    ui = chat_ui(chat)
    ui.run_command(Command("lookup", "3"))
    assert chat.shape == BeamShape(2, 3, 0.05, 4, lookup=3)
    assert "lookup beams 3 per step" in capsys.readouterr().err
    assert ui.mode() == "ReDrafter W=2 L=3 search 4 min-prob 0.05 lookup 3 (default + /lookup)"
    for bad in ("", "x", "-1", "2 3", "1.5"):
        ui.run_command(Command("lookup", bad))
        assert "usage: /lookup K" in capsys.readouterr().err
        assert chat.shape.lookup == 3
    ui.run_command(Command("beam", "3 4"))  # /beam keeps K (and the floor, the search)
    assert chat.shape == BeamShape(3, 4, 0.05, 4, lookup=3)
    ui.run_command(Command("lookup", "0"))  # with a drafter, 0 turns lookup off
    assert chat.shape == BeamShape(3, 4, 0.05, 4)
    assert "lookup beams off" in capsys.readouterr().err
    ui.answer("abc")
    assert "accepted:" not in capsys.readouterr().err  # no lookup beams: no sources
    ui.run_command(Command("help"))
    assert "/lookup  K: prompt-lookup beams" in capsys.readouterr().err


def test_a_temperature_change_keeps_the_lookup_beams_of_the_lookup_command(target, monkeypatch):
    """/temp switches to the sampling profile's shape, K included, unless /lookup chose K."""
    from redrafter_mlx.cli import chat as C

    profiles = {False: BeamShape(2, 4, lookup=1), True: BeamShape(3, 4, lookup=4)}
    monkeypatch.setattr(
        C, "resolve_shape", lambda runtime, overrides, temp: (profiles[temp > 0], "profile")
    )
    beam = BeamDrafter(random_drafter(64, 64, seed=1), target.model.embed_tokens)
    chat = session(target, beam, max_tokens=6)
    ui = chat_ui(chat, "profile")
    ui.run_command(Command("temp", "0.5"))
    assert chat.shape == profiles[True]  # the sampling profile's K
    ui.run_command(Command("lookup", "2"))
    ui.run_command(Command("temp", "0"))
    assert chat.shape == replace(profiles[False], lookup=2)  # K stays /lookup's
    assert ui.mode() == "ReDrafter W=2 L=4 lookup 2 (profile + /lookup)"


@pytest.mark.parametrize("with_drafter", [True, False])
def test_lookup_commands_warm_up_what_the_answers_run(traces, with_drafter):
    """/lookup and /beam with lookup beams compile at the command, never inside an answer."""
    from redrafter_mlx.backend.plan import CPU_PLAN

    # built after ``traces`` patched mx.compile: its traces count; its loops make lookup
    # beams (and so trees of many sizes) at most steps
    model = tiny_llama(seed=5, vocab=8)
    beam = BeamDrafter(random_drafter(64, 8, seed=4), model.model.embed_tokens)
    shape = BeamShape(2, 3, lookup=1)
    # CPU_PLAN: compiled forwards per tree size (the default plan compiles only the drafter)
    drafter = beam if with_drafter else None
    chat = chat_session(
        model,
        drafter,
        shape,
        small_template,
        plan=CPU_PLAN,
        tokenizer=ToyTokenizer(),
        max_tokens=24,
    )
    ui = chat_ui(chat)
    for command in (Command("lookup", "4"), Command("beam", "1 5"), Command("lookup", "2")):
        ui.run_command(command)
        warmed = len(traces)
        for question in ("abc abc abc", "defg", "abc abc abc"):
            ask(chat, question)
        assert len(traces) == warmed, f"an answer compiled after /{command.name} {command.arg}"


def test_stats_say_where_accepted_tokens_came_from(looping, capsys):
    model, beam = looping
    chat = small_session(model, beam, max_tokens=32)
    ui = chat_ui(chat, "flags")
    counts = []
    for question in ("abc", "defg"):
        ui.answer(question)
        err = capsys.readouterr().err
        got = chat.last.stats.accepted_from
        counts.append(got)
        assert f"accepted: {accepted_sources(got)}" in err  # drafter N, lookup N, both N
        assert "ReDrafter W=2 L=4 lookup 3 (flags)" in err
    total = counts[0] + counts[1]
    assert total["lookup"] > 0  # the loops were copied
    # every accepted draft has a source: a step of k tokens accepted k - 1 drafts
    assert sum(total.values()) == sum((k - 1) * n for k, n in chat.totals.histogram.items())
    assert chat.totals.accepted_from == total  # the session totals add the answers up
    ui.run_command(Command("stats"))
    stats = capsys.readouterr().err
    assert f"accepted drafted tokens by source: {accepted_sources(total)}" in stats
    assert "a ReDrafter step" in stats


def test_lookup_only_session_answers_as_autoregressive_and_refuses_k0(looping, capsys):
    """A model without a drafter: lookup beams alone give the autoregressive answers (greedy),
    in fewer steps; /lookup 0 would leave nothing to speculate with, so it is refused."""
    model, _ = looping
    fast = small_session(model, None, BeamShape(1, 5, lookup=4), max_tokens=32)
    slow = small_session(model, None, max_tokens=32, autoregressive=True)
    ui = chat_ui(fast, "flags + default")
    assert fast.lookup_only and not slow.lookup_only
    assert ui.mode() == "lookup only L=5 lookup 4 (flags + default)"
    for question in ("abc", "defg", "abc"):
        assert ask(fast, question) == ask(slow, question)
    assert fast.messages == slow.messages
    assert fast.totals.tokens == slow.totals.tokens
    assert fast.totals.steps < slow.totals.steps  # copied loops: several tokens a step
    assert set(fast.totals.accepted_from) == {"lookup"}
    ui.report(fast.last)  # without a drafter only lookup's share is shown
    accepted = fast.last.stats.accepted_from["lookup"]
    assert capsys.readouterr().err.rstrip().endswith(f"· accepted: lookup {accepted}")
    ui.run_command(Command("lookup", "0"))
    assert "no drafter" in capsys.readouterr().err
    assert fast.shape == BeamShape(1, 5, lookup=4)  # the old shape stays
    ui.run_command(Command("beam", "2 3"))  # L counts, W does not
    assert fast.shape == BeamShape(2, 3, lookup=4)
    assert "L=3 lookup 4 (no drafter: W, P and S are unused)" in capsys.readouterr().err
    assert ask(fast, "more") == ask(slow, "more")
    ui.run_command(Command("stats"))
    stats = capsys.readouterr().err
    assert f"by source: lookup {fast.totals.accepted_from['lookup']}\n" in stats
    assert "a lookup step" in stats


def test_chat_main_with_lookup_runs_a_model_without_drafter(looping, monkeypatch, capsys):
    """`chat --lookup K` on a model that has no drafter loads it (need_drafter false) and
    answers with lookup beams alone, exactly as `chat --autoregressive`; without --lookup it
    speculates with the default shape's lookup beam (one is added where it has none)."""
    import io

    from redrafter_mlx.cli import chat as C
    from redrafter_mlx.core.errors import ConfigError
    from redrafter_mlx.io import runtime as rt

    model, _ = looping
    config = {"vocab_size": 8, "max_position_embeddings": 4096}

    def load_runtime(model_path, drafter_path, *, need_drafter):
        if need_drafter:  # what the real one says for a model without a drafter
            raise ConfigError("no drafter for this model: pass --drafter DIR")
        return make_runtime(model, ToyTokenizer(), config)

    monkeypatch.setattr(rt, "load_runtime", load_runtime)
    monkeypatch.setattr(rt, "encode_chat", lambda runtime, messages: small_template(messages))
    monkeypatch.setattr(C.CtrlC, "install", lambda self: None)  # keep pytest's SIGINT
    outputs = {}
    for argv in (["--lookup", "3", "--beam-length", "5"], ["--autoregressive"], []):
        lines = b"abc\n/stats\nhello there\n"
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(lines)))
        args = C.setup_arg_parser().parse_args([*argv, "--max-tokens", "24"])
        try:
            C.main(args)
        except SystemExit as e:
            assert e.code == 1
        outputs[tuple(argv)] = capsys.readouterr()
    lookup, plain, fallback = outputs.values()
    assert lookup.out == plain.out
    assert [len(answer) for answer in lookup.out.splitlines()] == [24, 24]
    assert "lookup only L=5 lookup 3 (flags + default)" in lookup.err
    assert "accepted: lookup" in lookup.err and "by source: lookup" in lookup.err
    assert fallback.out == plain.out
    assert "lookup only L=" in fallback.err and " lookup 1 (default" in fallback.err


def test_an_answer_cut_by_max_tokens_says_so_in_its_stats_line(looping, capsys):
    """The stats line of a cut answer looked like any other."""
    from redrafter_mlx.cli.chat import Turn
    from redrafter_mlx.core.decode.stream import GenerationStats

    model, beam = looping
    chat = small_session(model, beam, max_tokens=5)
    ui = chat_ui(chat)
    ui.answer("abc")
    assert chat.last.finish_reason == "length"
    assert "tokens/step" in (err := capsys.readouterr().err)
    assert "5 tokens (cut at --max-tokens) · " in err
    ui.report(Turn(stats=GenerationStats(generation_tokens=3), finish_reason="stop"))
    assert "cut at" not in capsys.readouterr().err


def test_an_answer_its_context_band_decodes_plainly_says_so_in_its_stats_line(looping, capsys):
    """With bands (the default's plain_from, a profile's), a long conversation's answers decode
    one token per step: the stats line says so instead of naming the session's shape."""
    from redrafter_mlx.tuning.profiles import ContextBands, decoding_by_context

    model, beam = looping
    chat = small_session(model, beam, max_tokens=5)
    inner = chat.session
    bands = ContextBands(((0, inner.decoding.shape), (12, None)))
    inner.by_context = decoding_by_context(bands, inner.decoding, inner.decoder.warm_up)
    ui = chat_ui(chat)
    ui.answer("abc")  # a short first prompt: the shape
    assert not chat.last.plain_here and "plain decoding" not in capsys.readouterr().err
    ui.answer("defg")  # the conversation has passed 12 tokens: plain
    err = capsys.readouterr().err
    assert chat.last.plain_here and chat.last.stats.tokens_per_step == 1.0
    assert "tokens/step · plain decoding at this context length · " in err
    assert "accepted:" not in err


def test_ctrl_c_at_the_prompt_cancels_the_line_and_says_how_to_leave(looping, monkeypatch):
    """It ended the chat silently (exit 0, the conversation lost)."""
    model, beam = looping
    ui = chat_ui(small_session(model, beam, max_tokens=4))
    ui.interactive = True
    keys = iter([KeyboardInterrupt, KeyboardInterrupt, "abc", EOFError])
    notes = []

    def read(prompt):
        key = next(keys)
        if isinstance(key, type):
            raise key
        return key

    monkeypatch.setattr(ui.out, "input", read)
    monkeypatch.setattr(ui, "note", lambda text, style="dim": notes.append(text))
    monkeypatch.setattr(ui, "banner", lambda: None)
    ui.run()  # returns at Ctrl-D only
    assert notes[:2] == ["cancelled; to leave the chat: Ctrl-D or /quit"] * 2
    assert [m["role"] for m in ui.session.messages] == ["user", "assistant"]  # "abc" answered


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_at_the_prompt_before_and_during_an_answer(tmp_path, drafter_dir):
    """A pty: Ctrl-C at the prompt (with and without a line typed), right after Enter (the
    prompt's prefill or the first tokens) and mid-answer; the chat goes on each time, and
    the conversation is all there at the end."""
    pexpect = pytest.importorskip("pexpect")
    saved = tmp_path / "chat.json"
    child = pexpect.spawn(
        sys.executable,
        ["-m", "redrafter_mlx", "chat", "--drafter", drafter_dir, "--max-tokens", "200"],
        cwd=str(ROOT),
        env=env(TMPDIR=str(tmp_path)),
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 200),
    )
    prompt, leave = ">>> ", "Ctrl-D or /quit"
    child.expect(prompt)
    child.sendintr()  # an empty prompt
    child.expect_exact(leave)
    child.expect(prompt)
    child.send("half a line")
    # Once readline has echoed it: a SIGINT that lands while readline handles typed keys is
    # only acted on at the next key (CPython's readline waits in select() with no timeout).
    child.expect_exact("half a line")
    time.sleep(0.2)
    child.sendintr()  # the line is dropped, not sent
    child.expect_exact(leave)
    child.expect(prompt)
    child.sendline("Write a long story about a dragon who learns to cook.")
    # the echo first: a SIGINT readline gets while it still handles the typed keys waits for
    # the next key (as above), and under a loaded machine that race was lost
    child.expect_exact("cook.")
    child.sendintr()  # right after Enter: while the prompt is prefilled, or just after
    child.expect(["interrupted", leave])
    child.expect(prompt)
    child.sendline("Write a long story about a knight who learns to sing.")
    child.expect_exact("sing.")  # the echo of the line
    child.expect(r"\w\w")  # the first streamed text
    child.sendintr()
    if child.expect(["interrupted", pexpect.TIMEOUT], timeout=1.0) == 1:
        # as in test_chat_in_a_terminal: MLX's g++ kernel builds ignore SIGINT while they run
        warnings.warn("the Ctrl-C did not stop the answer within 1 s; sent another", stacklevel=1)
        child.sendintr()
        child.expect("interrupted")
    save_and_quit(child, prompt, saved)
    users = [m["content"] for m in json.loads(saved.read_text())["messages"] if m["role"] == "user"]
    assert "half a line" not in users and users[-1].endswith("learns to sing.")
