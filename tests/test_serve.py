"""`redrafter-mlx serve`: the generation service on tiny random models (fast), and the real
server on the embedded SmolLM2-135M through the official `openai` client (slow: one server per
module, started once)."""

from __future__ import annotations

import http.client
import json
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from support.families import build_config, config
from support.serving import (
    FRANCE,
    MODEL,
    QUEUE_SIZE,
    STORY,
    Served,
    env,
    reference_tokens,
    run,
    tiny_service,
    wait_until,
)

from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.plan import Plan
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.errors import ConfigError, ContextFull
from redrafter_mlx.core.serving.service import Engine, GenerationService, QueueFull, Request

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- the service, tiny models


def test_answers_equal_plain_decoding_and_an_extending_prompt_reuses_the_cache(target, drafter):
    service = tiny_service(target, drafter)
    first = [5, 6, 7, 8, 9]
    tokens, _ = run(service.submit(Request(first, max_tokens=12)))
    assert tokens == reference_tokens(target, first, 12)
    extended = first + tokens + [10, 11]
    job = service.submit(Request(extended, max_tokens=12))
    started = job.start()
    # the last answer token was never fed (it was the pending one): the rest is cached
    assert started.prompt_tokens == len(extended)
    assert started.cached_tokens >= len(first) + len(tokens) - 1
    steps = list(job.steps())
    assert steps[0].stats.prompt_tokens == len(extended) - started.cached_tokens
    assert [t for s in steps for t in s.tokens] == reference_tokens(target, extended, 12)
    other, _ = run(service.submit(Request([9, 8, 7], max_tokens=12)))  # shares nothing
    assert other == reference_tokens(target, [9, 8, 7], 12)
    service.close()


def conversation_turns(service, target, prompts: dict) -> dict:
    """Two turns of each conversation in ``prompts``, interleaved (a1 b1 a2 b2): the cached
    tokens each second turn found, after checking every answer against plain decoding."""
    histories, cached = dict(prompts), {}
    for turn in range(2):
        for name, history in histories.items():
            job = service.submit(Request(history, max_tokens=6))
            started = job.start()
            tokens = [t for s in job.steps() for t in s.tokens]
            assert tokens == reference_tokens(target, history, 6)
            histories[name] = history + tokens + [10, 11]  # the next user message
            if turn:
                cached[name] = started.cached_tokens
    return cached


@pytest.mark.parametrize("size", [1, 2])
def test_interleaved_conversations_each_keep_their_cache(target, drafter, size):
    """An agent and its sub-agent alternating: with room for two conversations each second
    turn reuses its whole history; with one, every switch re-reads it."""
    service = tiny_service(target, drafter, prompt_cache_size=size)
    prompts = {"agent": [5, 6, 7, 8, 9, 12, 13], "sub": [40, 41, 42, 43, 44, 45]}
    cached = conversation_turns(service, target, prompts)
    for name, prompt in prompts.items():
        if size == 2:  # the first turn's prompt and answer (but its pending last token)
            assert cached[name] >= len(prompt) + 6 - 1
        else:
            assert cached[name] == 0
    assert len(service.prompt_cache.sessions) == size
    service.close()


def respelled(tokens: list[int]) -> list[int]:
    """An answer as a client sends it back and the tokenizer splits it again: other ids
    from the first (a SentencePiece answer's first space is dropped from its text)."""
    return [(t + 1) % 60 for t in tokens]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("order", ["one after another", "interleaved"])
def test_a_follow_up_reuses_its_own_previous_prompt_whatever_came_between(target, family, order):
    """Three conversations of three turns, each follow-up resending its answer spelled
    otherwise, with room for two conversations (one after another) or three (interleaved):
    each follow-up finds its own conversation's previous prompt in the cache, on an
    attention model and on a hybrid (whose recurrent state is kept at each prompt's end)."""
    model = target if family == "llama" else build_config(config(family) | {"vocab_size": 64})
    size = 2 if order == "one after another" else 3
    service = tiny_service(model, prompt_cache_size=size)
    histories = {name: [first, 6, 7, 8, 9, 12] for name, first in (("a", 5), ("b", 40), ("c", 50))}
    previous: dict[str, int] = {}  # each conversation's last prompt length
    turns = [(n, t) for n in histories for t in range(3)]
    if order == "interleaved":  # a b c, c b a, a b c: the least recently used is another's
        turns = [(n, t) for t in range(3) for n in (list(histories)[:: 1 - 2 * (t % 2)])]
    for name, turn in turns:
        history = histories[name]
        job = service.submit(Request(history, max_tokens=12))  # longer than a template tail
        started = job.start()
        tokens = [t for s in job.steps() for t in s.tokens]
        assert tokens == reference_tokens(model, history, 12)
        if turn:
            assert started.cached_tokens == previous[name], (name, turn)
        previous[name] = len(history)
        histories[name] = history + respelled(tokens) + [10 + turn, 11]
    service.close()


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_follow_up_whose_answer_changed_midway_resumes_near_there(target, family):
    """A resent answer tokenized otherwise only from its 7th token on (a byte-level token, a
    merge across two): attention reuses the six that came back; a hybrid the states it kept
    nearest before them (checkpoints spread over the answer), not the prompt's end."""
    model = target if family == "llama" else build_config(config(family) | {"vocab_size": 64})
    service = tiny_service(model)
    history, previous = [5, 6, 7, 8, 9, 12], 0  # the last prompt's length
    for turn in range(3):
        job = service.submit(Request(history, max_tokens=12))
        started = job.start()
        tokens = [t for s in job.steps() for t in s.tokens]
        assert tokens == reference_tokens(model, history, 12)
        if turn and family == "llama":
            assert started.cached_tokens == previous + 6
        elif turn:  # checkpoints 4 tokens apart in a 12-token answer (at most 4 of them)
            assert previous + 6 - 4 <= started.cached_tokens <= previous + 6
        previous = len(history)
        history = history + tokens[:6] + respelled(tokens[6:]) + [10 + turn, 11]
    service.close()


def test_the_prompt_cache_drops_least_recently_used_conversations_beyond_its_bytes(target):
    """A byte bound smaller than two caches keeps only the conversation in use."""
    service = tiny_service(target, prompt_cache_size=4, prompt_cache_bytes=1)
    conversation_turns(service, target, {"a": [5, 6, 7], "b": [40, 41, 42]})
    assert len(service.prompt_cache.sessions) == 1
    with pytest.raises(ValueError, match="prompt cache size 0"):
        tiny_service(target, prompt_cache_size=0)
    service.close()


def test_requests_run_in_arrival_order_and_a_full_queue_refuses(target):
    release, order = threading.Event(), []

    def probe(index: int, wait: bool):
        def client_gone() -> bool:
            if index not in order:
                order.append(index)
            if wait:
                release.wait(30)  # holds the worker: the others queue up
            return False

        return client_gone

    service = tiny_service(target, queue_size=2)
    jobs = [service.submit(Request([5, 6], max_tokens=3), probe(0, True))]
    while not service.busy:
        time.sleep(0.01)
    jobs += [service.submit(Request([5, 6 + i], max_tokens=3), probe(i, False)) for i in (1, 2)]
    with pytest.raises(QueueFull, match="2 requests are already waiting"):
        service.submit(Request([5, 9], max_tokens=3))
    assert service.waiting == 2
    release.set()
    for job in jobs:
        assert len(run(job)[0]) == 3
    assert order == [0, 1, 2]
    service.close()


def test_a_client_that_leaves_stops_its_generation_before_the_next_step(target, drafter):
    calls = []

    def client_gone() -> bool:  # asked before the job starts, then after each step
        calls.append(1)
        return len(calls) > 3

    service = tiny_service(target, drafter)
    job = service.submit(Request([5, 6, 7], max_tokens=200), client_gone)
    job.start()
    steps = list(job.steps())
    assert job.outcome == "cancelled"
    assert len(steps) == 3 and steps[-1].finish_reason is None  # the prefill's token + 2 steps
    assert steps[-1].stats.steps == 2
    # the service goes on, from the cache the cancelled answer left consistent
    tokens, _ = run(service.submit(Request([5, 6, 7, 8], max_tokens=8)))
    assert tokens == reference_tokens(target, [5, 6, 7, 8], 8)
    queued = service.submit(Request([5], max_tokens=8))
    queued.cancel()
    assert queued.start() is None and queued.outcome == "cancelled"
    service.close()


def test_a_client_that_leaves_during_the_prompt_stops_it_between_chunks(target, drafter):
    """A long prompt is fed in chunks; a client gone meanwhile stops it before the next chunk
    (it used to run the whole prefill, minutes for a long prompt), the chunks fed stay a
    prefix the next request reuses, and the service goes on."""
    calls = []

    def client_gone() -> bool:  # before the job starts, then between prompt chunks
        calls.append(1)
        return len(calls) > 2

    service = tiny_service(target, drafter, plan=Plan(prefill_chunk=8))
    prompt = [5 + i % 50 for i in range(80)]  # 10 chunks
    job = service.submit(Request(prompt, max_tokens=8), client_gone)
    assert job.start() is None and job.outcome == "cancelled"
    assert service.session.sequence.offset == 16  # two chunks fed, stopped before the third
    again = service.submit(Request(prompt, max_tokens=8))
    assert again.start().cached_tokens == 16
    assert [t for s in again.steps() for t in s.tokens] == reference_tokens(target, prompt, 8)
    service.close()


def test_a_prompt_longer_than_the_context_is_refused_and_the_service_goes_on(target):
    service = tiny_service(target, max_context=16)
    with pytest.raises(ContextFull, match="the prompt is 16 tokens; the model's context is 16"):
        service.submit(Request(list(range(5, 21)), max_tokens=4)).start()
    tokens, _ = run(service.submit(Request([5, 6], max_tokens=4)))
    assert tokens == reference_tokens(target, [5, 6], 4)
    service.close()


def test_a_failing_setup_is_raised_by_start():
    def setup():
        raise ConfigError("no drafter for this model")

    with pytest.raises(ConfigError, match="no drafter"):
        GenerationService(setup).start()


# ---------------------------------------------------------------- request parsing (pure)


def test_requests_are_checked_field_by_field():
    from redrafter_mlx.server.openai import ApiError, Limits, parse_chat, parse_completion

    limits = Limits(("m",), max_context=100, vocab_size=50)
    user = [{"role": "user", "content": "hi"}]
    call = parse_chat({"messages": user, "stop": "x", "top_k": 49, "seed": 3}, limits)
    assert call.request.stop_strings == ("x",) and call.request.sampling.top_k == 49
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert parse_chat({"messages": parts}, limits).request.prompt.messages[0]["content"] == "ab"
    assert parse_completion({"prompt": [1, 2, 49]}, limits).request.prompt == [1, 2, 49]
    assert parse_chat({"messages": user}, limits).request.max_tokens == 100  # default, capped
    bad = [
        ({"messages": user, "top_k": 50}, "top_k"),
        ({"messages": user, "seed": -1}, "seed"),
        ({"messages": user, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": user, "max_tokens": True}, "max_tokens"),
        ({"messages": user, "max_completion_tokens": 101}, "max_completion_tokens"),
        ({"messages": user, "temperature": "hot"}, "temperature"),
        ({"messages": user, "stream": "yes"}, "stream"),
        ({"messages": user, "presence_penalty": 0.5}, "presence_penalty"),
        ({"messages": user, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "\udcff"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({"prompt": [1, 50]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
    ]
    for body, param in bad:
        parse = parse_completion if "prompt" in body else parse_chat
        with pytest.raises(ApiError) as e:
            parse(body, limits)
        assert e.value.status == 400 and e.value.param == param, body


def test_numbers_past_what_python_parses_and_long_stops_are_refused_by_field():
    """A 5000-digit integer made json.loads raise ValueError, 10**400 made math.isfinite raise
    OverflowError: both escaped as an empty reply. A 1001-character stop costs per-step work."""
    from redrafter_mlx.server.openai import ApiError, Limits, parse_chat, parse_json

    limits = Limits(("m",), max_context=100, vocab_size=50)
    user = '"messages": [{"role": "user", "content": "hi"}]'
    huge = "9" * 5000
    cases = [
        (f'{{{user}, "max_tokens": {huge}}}', "max_tokens"),
        (f'{{{user}, "seed": -{huge}}}', "seed"),
        (f'{{{user}, "temperature": 1{"0" * 400}}}', "temperature"),
        (f'{{{user}, "top_p": {huge}}}', "top_p"),
        (f'{{{user}, "stop": "{"x" * 1001}"}}', "stop"),
    ]
    for raw, param in cases:
        with pytest.raises(ApiError) as e:
            parse_chat(parse_json(raw.encode()), limits)
        assert e.value.status == 400 and e.value.param == param, raw[:80]
        assert len(e.value.message) < 200  # the value is cut, not echoed whole
    assert parse_chat(parse_json(f'{{{user}, "stop": "{"x" * 1000}"}}'.encode()), limits)


def test_a_temperature_too_small_to_sample_at_runs_at_the_greedy_shape():
    from redrafter_mlx.core.serving.service import Sampling
    from redrafter_mlx.server.openai import Limits, parse_chat

    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1e-40}
    sampling = parse_chat(body, Limits(("m",))).request.sampling
    engine = Engine(None, None, list, Mode.REDRAFTER, BeamShape(1, 2), BeamShape(3, 4))
    assert engine.shape_for(sampling) == BeamShape(1, 2)
    assert engine.decoding_for(sampling).shape == BeamShape(1, 2)
    assert engine.shape_for(Sampling(0.7)) == BeamShape(3, 4)


# ---------------------------------------------------------------- the real server (slow)


@pytest.mark.slow
def test_chat_completion_whole_and_streamed_equal_generate(server, reference):
    client = server.client()
    whole = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24)
    text = whole.choices[0].message.content
    assert "Paris" in text and whole.choices[0].finish_reason == "stop"
    assert (text, "stop") == reference(FRANCE, 24)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=FRANCE,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert (
        not chunks[-1].choices
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    # the same conversation again: all of its prompt but the last token came from the cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1


@pytest.mark.slow
def test_usage_carries_the_redrafter_block(server):
    done = server.client().chat.completions.create(model=MODEL, messages=STORY, max_tokens=20)
    usage = done.usage.model_dump()
    assert usage["completion_tokens"] == 20 and done.choices[0].finish_reason == "length"
    assert usage["total_tokens"] == usage["prompt_tokens"] + 20
    block = usage["redrafter"]
    assert block["mode"] == "redrafter" and block["shape_source"] == "flags"
    assert block["drafter_type"] == "redrafter"  # the shipped drafter's type
    assert (block["beam_width"], block["beam_length"], block["lookup"]) == (1, 3, 0)
    assert set(block["accepted_from"]) == {"drafter", "lookup", "both"}
    assert sum(block["accepted_from"].values()) == block["accepted_tokens"]
    histogram = {int(k): n for k, n in block["accept_histogram"].items()}
    steps = block["steps"]
    assert sum(histogram.values()) == steps > 0
    assert block["drafted_tokens"] == 2 * steps  # one beam of 3: two drafted tokens per step
    assert block["accepted_tokens"] == sum((k - 1) * n for k, n in histogram.items())
    assert block["accepted_tokens"] <= block["drafted_tokens"]
    # the prefill's token, then each step's (the last may be cut at max_tokens)
    assert 20 <= 1 + sum(k * n for k, n in histogram.items()) < 20 + 3
    assert block["tokens_per_step"] == pytest.approx(
        sum(k * n for k, n in histogram.items()) / steps, abs=1e-3
    )


@pytest.mark.slow
def test_text_completion_models_health_and_a_continued_conversation(server, reference):
    client = server.client()
    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8)
    # a continuation keeps its first space (" Paris"), which generate's text drops
    text = done.choices[0].text
    assert text.startswith(" ")
    assert (text[1:], done.choices[0].finish_reason) == reference("The capital of France is", 8)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert server.health() == {"status": "ok", "busy": False, "waiting": 0}
    first = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24)
    conversation = FRANCE + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=16)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 2
    assert second.choices[0].message.content == reference(conversation, 16)[0]


@pytest.mark.slow
def test_a_continue_turn_whose_last_user_message_grew_finds_its_prompt_cached(server):
    """Claude Code's ``--continue`` appends its new text to the last user message: the
    replayed prompt differs from the cached one only after that message's old end (fewer
    tokens than a new turn), and all but those last tokens come from the cache (Anthropic's
    usage: ``cache_read_input_tokens`` read, ``input_tokens`` fed)."""
    rivers = ", ".join(["the Nile", "the Amazon", "the Danube", "the Mekong", "the Volga"] * 6)
    question = f"Here are some rivers I like: {rivers}. Which one is the longest?"

    def ask(text: str) -> dict:
        body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
        status, _, reply = server.request("/v1/messages", body)
        assert status == 200, reply
        return reply["usage"]

    first = ask(question)
    grown = ask(question + " And count to three.")
    prompt = grown["input_tokens"] + grown["cache_read_input_tokens"]
    assert prompt > first["input_tokens"] + first["cache_read_input_tokens"] > 100
    assert grown["input_tokens"] <= 12  # " And count to three." and the template's tail
    assert grown["cache_read_input_tokens"] >= first["input_tokens"] - 6


@pytest.mark.slow
def test_a_stop_string_ends_the_answer_before_it(server, reference):
    client = server.client()
    full, _ = reference(FRANCE, 24)
    done = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=24, stop=["Paris"]
    )
    assert done.choices[0].message.content == full[: full.index("Paris")]
    assert done.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=24, stop="Paris", stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == full[: full.index("Paris")]


@pytest.mark.slow
def test_logprobs_over_http_equal_mlx_lm_s_autoregressive_ones(server, runtime):
    """Chat and text completions' log-probs (ReDrafter steps W1 L3, float32 on the CPU)
    equal those of mlx-lm's own decoding within 1e-4: each token's, and its top 5."""
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    from redrafter_mlx.io import runtime as rt

    client = server.client()
    done = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=16, logprobs=True, top_logprobs=5
    )
    ids = rt.encode_chat(runtime, FRANCE)
    theirs = list(
        mlx_lm.stream_generate(runtime.model, runtime.tokenizer, mx.array(ids), max_tokens=16)
    )
    entries = done.choices[0].logprobs.content
    # one entry per token usage counts: the end token too, as mlx-lm's server gives it one
    assert done.choices[0].finish_reason == "stop"
    assert len(entries) == done.usage.completion_tokens == len(theirs)
    assert theirs[-1].token in runtime.tokenizer.eos_token_ids  # mlx-lm yields the EOS too
    assert done.usage.redrafter["accepted_tokens"] > 0  # multi-token steps were read
    for entry, want in zip(entries, theirs, strict=True):
        row = np.array(want.logprobs)
        assert entry.token == runtime.tokenizer.decode([want.token])
        assert entry.logprob == pytest.approx(float(row[want.token]), abs=1e-4)
        top = np.argsort(-row)[:5]
        assert [t.token for t in entry.top_logprobs] == [
            runtime.tokenizer.decode([int(t)]) for t in top
        ]
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], row[top], atol=1e-4)
    stream = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=16, logprobs=True, top_logprobs=5, stream=True
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    # again from the cache (its prompt's last token fed alone): equal within float32 sums
    assert [e.token for e in streamed] == [e.token for e in entries]
    np.testing.assert_allclose(
        [e.logprob for e in streamed], [e.logprob for e in entries], atol=1e-4
    )
    text = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, logprobs=2)
    assert len(text.choices[0].logprobs.tokens) == text.usage.completion_tokens
    np.testing.assert_allclose(
        text.choices[0].logprobs.token_logprobs, [e.logprob for e in entries], atol=1e-4
    )
    np.testing.assert_allclose(
        [list(t.values()) for t in text.choices[0].logprobs.top_logprobs],
        [[t.logprob for t in e.top_logprobs[:2]] for e in entries],
        atol=1e-4,
    )


@pytest.mark.slow
def test_tools_for_a_template_without_tool_support_get_a_400_that_says_so(server):
    import openai

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=MODEL, messages=FRANCE, tools=[tool])
    assert e.value.body["param"] == "tools"
    assert "the chat template of smollm2-135m-instruct takes no tools" in e.value.body["message"]


class Holder:
    """A streamed answer that keeps the worker busy until :meth:`close` (which leaves)."""

    def __init__(self, served: Served):
        parts = urlsplit(served.url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        body = {"messages": STORY, "max_tokens": 2000, "stream": True}
        self.conn.request("POST", "/v1/chat/completions", json.dumps(body).encode())
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        assert self.response.fp.readline().startswith(b"data: ")

    def close(self) -> None:
        self.response.close()
        self.conn.close()


PROMPTS = ["What is the capital of France?", "Name a colour.", "What is 2 + 2?", "Say hi."]


@pytest.mark.slow
@pytest.mark.soak
def test_eight_clients_at_once_get_their_serial_answers_and_a_full_queue_gets_503(server):
    import openai

    def ask(client, prompt: str):
        messages = [{"role": "user", "content": prompt}]
        done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
        return done.choices[0].message.content, done.choices[0].finish_reason

    serial = {p: ask(server.client(), p) for p in PROMPTS}
    results, refusals, failures = {}, [], []
    barrier = threading.Barrier(8)

    def client(i: int) -> None:
        try:
            api = server.client(max_retries=0)
            barrier.wait()
            for r in range(3):
                prompt = PROMPTS[(i + r) % len(PROMPTS)]
                while (i, r) not in results:
                    try:
                        results[i, r] = prompt, ask(api, prompt)
                    except openai.APIStatusError as e:
                        refusals.append(
                            (e.status_code, e.code, e.response.headers.get("retry-after"))
                        )
                        time.sleep(float(e.response.headers["retry-after"]))
        except Exception as e:  # reported below: an exception would end this thread quietly
            failures.append(e)

    holder = Holder(server)  # the worker is busy: the first 8 requests queue or are refused
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    wait_until(
        lambda: server.health()["waiting"] == QUEUE_SIZE and len(refusals) >= 8 - QUEUE_SIZE,
        60,
        "a full queue",
    )
    holder.close()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not failures, failures
    assert len(results) == 24
    for prompt, answer in results.values():
        assert answer == serial[prompt]
    assert len(refusals) >= 8 - QUEUE_SIZE
    assert set(refusals) == {(503, "queue_full", "1")}
    wait_until(lambda: server.health() == {"status": "ok", "busy": False, "waiting": 0}, 10, "idle")


KILLED_CLIENT = """
import sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="none", max_retries=0)
messages = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
stream = client.chat.completions.create(
    model=sys.argv[2], messages=messages, max_tokens=2000, stream=True
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content.replace("\\n", " "), flush=True)
"""


@pytest.mark.slow
def test_a_client_killed_mid_stream_frees_the_server_at_once(server):
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, f"{server.url}/v1", MODEL],
        stdout=subprocess.PIPE,
        text=True,
        env=env(),
    )
    try:
        assert select.select([child.stdout], [], [], 120)[0], "no streamed text"
        assert child.stdout.readline().strip()
        assert server.health()["busy"]  # 2000 tokens: about a minute of generation here
    finally:
        child.kill()
        child.wait()
    killed = time.monotonic()
    wait_until(lambda: not server.health()["busy"], 10, "the generation to stop")
    freed = time.monotonic() - killed
    done = server.client().chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24)
    assert "Paris" in done.choices[0].message.content
    # a step takes tens of milliseconds here; the 2000 tokens would have taken a minute
    assert freed < 2.0, freed
    left = re.findall(r"the client left after (\d+) tokens", server.log.read_text())
    assert left and int(left[-1]) < 2000


@pytest.mark.slow
def test_a_client_that_leaves_before_its_whole_answer_frees_the_server_at_once(server):
    """No stream: nothing is written until the end, so only the check before each step can
    see the client go."""
    parts = urlsplit(server.url)
    body = json.dumps({"messages": STORY, "max_tokens": 2000}).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: server.health()["busy"], 30, "the generation to start")
        time.sleep(0.5)  # a few steps into the answer
    left = time.monotonic()
    wait_until(lambda: not server.health()["busy"], 10, "the generation to stop")
    assert time.monotonic() - left < 2.0
    assert re.findall(r"chat: the client left after (\d+) tokens", server.log.read_text())


BIG = 4 << 20  # the server's default --max-body-bytes


def oversized_body() -> bytes:
    head, tail = b'{"messages": [{"role": "user", "content": "', b'"}]}'
    return head + b"a" * (BIG + 1 - len(head) - len(tail)) + tail


BAD_INPUTS = [
    # (name, path, body, status, param, code)
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, None, "invalid_json"),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None, "invalid_json"),
    (
        "no messages",
        "/v1/chat/completions",
        {"model": MODEL},
        400,
        "messages",
        "missing_required_parameter",
    ),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages", "empty_array"),
    (
        "unknown role",
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "hi"}]},
        400,
        "messages[0].role",
        "invalid_value",
    ),
    (
        "content not text",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 7}]},
        400,
        "messages[0].content",
        "invalid_value",
    ),
    (
        "prompt longer than the context",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello " * 9000}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "negative max_tokens",
        "/v1/chat/completions",
        {"messages": FRANCE, "max_tokens": -1},
        400,
        "max_tokens",
        "invalid_value",
    ),
    (
        "absurd max_tokens",
        "/v1/chat/completions",
        {"messages": FRANCE, "max_tokens": 10**9},
        400,
        "max_tokens",
        "invalid_value",
    ),
    (
        "negative temperature",
        "/v1/chat/completions",
        {"messages": FRANCE, "temperature": -0.5},
        400,
        "temperature",
        "invalid_value",
    ),
    (
        "a model name not a string",
        "/v1/chat/completions",
        {"messages": FRANCE, "model": 4},
        400,
        "model",
        "invalid_value",
    ),
    ("n = 2", "/v1/chat/completions", {"messages": FRANCE, "n": 2}, 400, "n", "unsupported_value"),
    (
        "too many top_logprobs",
        "/v1/chat/completions",
        {"messages": FRANCE, "logprobs": True, "top_logprobs": 11},
        400,
        "top_logprobs",
        "invalid_value",
    ),
    (
        "empty stop string",
        "/v1/chat/completions",
        {"messages": FRANCE, "stop": [""]},
        400,
        "stop",
        "invalid_value",
    ),
    (
        "no prompt",
        "/v1/completions",
        {"max_tokens": 4},
        400,
        "prompt",
        "missing_required_parameter",
    ),
    (
        "body over the limit",
        "/v1/chat/completions",
        oversized_body(),
        413,
        None,
        "request_too_large",
    ),
    ("unknown endpoint", "/v1/embeddings", {"input": "hi"}, 404, None, "not_found"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,path,body,status,param,code", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_a_bad_request_gets_its_json_error_and_the_next_one_is_served(
    server, name, path, body, status, param, code
):
    got, headers, error = server.request(path, body)
    assert got == status and headers["Content-Type"] == "application/json"
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert (error["error"]["param"], error["error"]["code"]) == (param, code)
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
    done, _, answer = server.request("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 2})
    assert done == 200 and answer["usage"]["completion_tokens"] == 2


@pytest.mark.slow
def test_wire_level_refusals(server):
    parts = urlsplit(server.url)
    # an oversized body announced with Expect: 100-continue is refused before it is sent
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {BIG + 1}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        reply = sock.makefile("rb").read()
    assert reply.startswith(b"HTTP/1.1 413") and b'"error"' in reply
    status, _, error = server.request("/v1/chat/completions", method="GET")
    assert status == 405 and error["error"]["code"] == "method_not_allowed"
    status, _, error = server.request("/v1/models/gpt-4o", method="GET")
    assert status == 404 and error["error"]["code"] == "model_not_found"
    # a refused request's body is read: the next request on the same connection is served
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    conn.request("POST", "/v1/embeddings", json.dumps({"input": "hi"}).encode())
    assert conn.getresponse().read() and conn.sock is not None  # kept alive
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": FRANCE, "max_tokens": 2}))
    assert conn.getresponse().status == 200
    conn.close()
    status, _, error = server.request("/v1/models", method="DELETE")
    assert status == 501 and error["error"]["message"]


def exchange(served: Served, data: bytes, *, half_close: bool = False) -> bytes:
    """Everything the server sends back on one connection for ``data``, until it closes."""
    parts = urlsplit(served.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return sock.makefile("rb").read()


def post(body: bytes, *headers: str) -> bytes:
    head = ["POST /v1/chat/completions HTTP/1.1", "Host: x", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    "headers,status",
    [
        (("Content-Length: 2", f"Content-Length: {2 + len(SMUGGLED)}"), 400),
        ((f"Content-Length: 2, {2 + len(SMUGGLED)}",), 400),
        (("Transfer-Encoding: gzip", f"Content-Length: {2 + len(SMUGGLED)}"), 400),
        (("Transfer-Encoding: chunked", "Content-Length: 2"), 411),
    ],
    ids=["two lengths", "a list of lengths", "gzip and a length", "chunked and a length"],
)
def test_a_body_of_uncertain_length_is_refused_and_the_connection_closed(server, headers, status):
    """Two Content-Length headers were served by the first, and the rest of the body answered
    as a second request on the same connection (request smuggling behind a proxy)."""
    reply = exchange(server, post(b"{}" + SMUGGLED, *headers))
    assert reply.startswith(f"HTTP/1.1 {status} ".encode()) and reply.count(b"HTTP/1.1 ") == 1
    assert b'"error"' in reply and b"Connection: close" in reply


@pytest.mark.slow
def test_a_client_that_half_closes_after_its_request_gets_its_answer(server):
    """Its end of stream was taken for a client gone: the request was dropped unanswered. A
    client that closed for good still frees the worker (see the test above)."""
    body = json.dumps({"messages": FRANCE, "max_tokens": 4}).encode()
    reply = exchange(server, post(body, f"Content-Length: {len(body)}"), half_close=True)
    final = reply[reply.index(b"HTTP/1.1 200 ") :]  # after a "100 Continue" probe, if any
    assert reply[: reply.index(b"HTTP/1.1 200 ")] in (b"", b"HTTP/1.1 100 Continue\r\n\r\n")
    answer = json.loads(final.split(b"\r\n\r\n", 1)[1])
    assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["message"]


@pytest.mark.slow
def test_clients_that_hang_up_at_once_leave_no_traceback(server):
    """A health check that gave up during start-up was a BrokenPipeError traceback: a hang-up
    is no error of the server's. Reset (SO_LINGER 0) right after the request, many times."""
    parts = urlsplit(server.url)
    logged = len(server.log.read_text())
    for _ in range(30):
        sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    assert server.health()["status"] == "ok"
    time.sleep(0.5)  # the handlers of the last ones may still be writing to the log
    assert "Traceback" not in server.log.read_text()[logged:]


@pytest.mark.slow
def test_every_interface_warns_and_a_taken_port_fails_before_the_model_loads(server):
    port = urlsplit(server.url).port
    done = subprocess.run(
        [sys.executable, "-m", "redrafter_mlx", "serve", "--host", "0.0.0.0", "--port", str(port)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env(),
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "anyone on the network who can reach it can use the model" in done.stderr
    assert done.stderr.strip().endswith(
        f"cannot listen on 0.0.0.0 port {port}: Address already in use"
    )


@pytest.mark.slow
@pytest.mark.soak
def test_a_refused_setup_exits_1_in_one_line_every_time(tmp_path):
    """After the worker thread that loaded the model ended, the interpreter's exit aborted in
    MLX's teardown ("terminate called without an active exception", rc 134) in a third to
    half of the runs here: six runs, so that the old code fails this test almost surely."""
    from redrafter_mlx.core.drafters.redrafter import random_drafter, save_drafter

    save_drafter(random_drafter(64, 49152), tmp_path / "drafter")  # the target's is 576
    refused = [["--top-k", "99999999"]] * 6 + [["--drafter", str(tmp_path / "drafter")]]
    for flags in refused:
        done = subprocess.run(
            [sys.executable, "-m", "redrafter_mlx", "serve", "--port", "0", *flags],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env(),
            timeout=120,
        )
        said = [x for x in done.stderr.splitlines() if not x.startswith("loading ")]
        assert (done.returncode, len(said)) == (1, 1), done.stderr
        assert said[0].startswith("error: ")
