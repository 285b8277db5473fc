"""`redrafter-mlx serve` for agents and apps, through the official `openai` and `anthropic`
clients: tool calls (a round trip on a tiny model overfit to call a tool, see
tests/support/tool_model.py), Anthropic's Messages API (text, streaming and its event sequence, stop
sequences, errors, usage, count_tokens), interleaved conversations and the answers' split
into text and tool calls. One server per module, on the tiny model (fast to load)."""

from __future__ import annotations

import json
import random
import re

import pytest
from support import tool_model
from support.serving import Served, serving

from redrafter_mlx.core.decode.stream import StepResponse

ANTHROPIC_TOOLS = [
    {
        "name": "get_weather",
        "description": tool_model.WEATHER["function"]["description"],
        "input_schema": tool_model.WEATHER["function"]["parameters"],
    }
]


@pytest.fixture(scope="session")
def tool_model_path(tmp_path_factory):
    from redrafter_mlx.io.embedded import default_model_path

    return tool_model.build(tmp_path_factory.mktemp("tool-model"), default_model_path())


@pytest.fixture(scope="module")
def agents(tmp_path_factory, tool_model_path):
    pytest.importorskip("openai")
    pytest.importorskip("anthropic")
    log = tmp_path_factory.mktemp("serve-agents") / "server.log"
    args = ["--model", str(tool_model_path), "--drafter", "none", "--max-tokens", "64"]
    # the last line printed once ready: the Anthropic API's
    with serving(log, *args, ready_line="serving Anthropic's Messages API at") as served:
        yield served


def anthropic_client(served: Served, **options):
    import anthropic

    return anthropic.Anthropic(base_url=served.url, api_key="none", timeout=60, **options)


def model_of(served: Served) -> str:
    return served.client().models.list().data[0].id


# ---------------------------------------------------------------- tool calls


def test_a_tool_call_makes_the_round_trip_through_openai(agents):
    client, model = agents.client(), model_of(agents)
    first = client.chat.completions.create(
        model=model, messages=tool_model.QUESTION, tools=[tool_model.WEATHER]
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == tool_model.ARGUMENTS
    result = {"role": "tool", "tool_call_id": call.id, "content": tool_model.RESULT}
    history = [*tool_model.QUESTION, choice.message.model_dump(exclude_none=True), result]
    final = client.chat.completions.create(
        model=model, messages=history, tools=[tool_model.WEATHER]
    )
    assert final.choices[0].message.content == tool_model.FINAL
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    # the question and the call were cached: only the result and what follows it were fed
    assert final.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens

    stream = client.chat.completions.create(
        model=model, messages=tool_model.QUESTION, tools=[tool_model.WEATHER], stream=True
    )
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    # as OpenAI streams a call: its id and name first, then its arguments
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert {d.index for d in deltas} == {0} and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_required_and_named(agents):
    client, model = agents.client(), model_of(agents)
    tools = [tool_model.WEATHER]
    plain = client.chat.completions.create(
        model=model, messages=tool_model.QUESTION, tools=tools, tool_choice="none", max_tokens=8
    )
    # no tools in the prompt: the model was never taught this one, and nothing is parsed
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason in ("stop", "length")
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        forced = client.chat.completions.create(
            model=model, messages=tool_model.QUESTION, tools=tools, tool_choice=choice
        )
        (call,) = forced.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == tool_model.ARGUMENTS
    import openai

    with pytest.raises(openai.BadRequestError, match="no tool named 'nowhere'"):
        client.chat.completions.create(
            model=model,
            messages=tool_model.QUESTION,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "nowhere"}},
        )


def test_a_tool_call_makes_the_round_trip_through_anthropic(agents):
    client = anthropic_client(agents)
    first = client.messages.create(
        model="any-name", max_tokens=64, messages=tool_model.QUESTION, tools=ANTHROPIC_TOOLS
    )
    assert first.stop_reason == "tool_use" and first.model == model_of(agents)
    (use,) = first.content
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", tool_model.ARGUMENTS)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": tool_model.RESULT}
    history = [
        *tool_model.QUESTION,
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [result]},
    ]
    final = client.messages.create(
        model="any-name", max_tokens=64, messages=history, tools=ANTHROPIC_TOOLS
    )
    assert [b.text for b in final.content] == [tool_model.FINAL]
    assert final.stop_reason == "end_turn"
    assert final.usage.cache_read_input_tokens >= first.usage.input_tokens

    with client.messages.stream(
        model="any-name",
        max_tokens=64,
        messages=tool_model.QUESTION,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any"},
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert message.content[0].input == tool_model.ARGUMENTS and message.stop_reason == "tool_use"
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_an_answer_splits_text_and_calls_however_its_steps_cut_the_tags(tool_model_path):
    """The template's own rendering of a call, between text, cut into steps at random:
    the same text and the same call every time (tags split across steps included)."""
    from mlx_lm.tokenizer_utils import load

    from redrafter_mlx.io.templates import tool_format
    from redrafter_mlx.server.protocol import Answer

    tokenizer = load(tool_model_path)
    rendered = tokenizer.apply_chat_template(
        [tool_model.called()], tools=[tool_model.WEATHER], tokenize=False
    )
    # the assistant's call (the last tags: the system prompt shows them first, empty)
    call = rendered[rendered.rindex("<tool_call>") : rendered.rindex("</tool_call>") + 12]
    text = f"Let me look. {call} Done <tool"
    fmt = tool_format(tokenizer)
    for seed in range(50):
        cuts = sorted(random.Random(seed).sample(range(1, len(text)), 12))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        answer = Answer(fmt, [tool_model.WEATHER])
        for i, piece in enumerate(pieces):
            answer.add(StepResponse(piece, [], None, "stop" if i == len(pieces) - 1 else None))
        assert answer.text == "Let me look.  Done <tool"
        assert [(c.name, c.arguments) for c in answer.calls] == [
            ("get_weather", tool_model.ARGUMENTS)
        ]
        assert answer.finish_reason == "tool_calls"


# ---------------------------------------------------------------- Anthropic's Messages API


def raw_events(served: Served, body: dict) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a streamed ``POST /v1/messages``, as sent."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(served.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", "/v1/messages", json.dumps(body | {"stream": True}).encode())
    text = conn.getresponse().read().decode()
    conn.close()
    found = re.findall(r"event: (\w+)\ndata: (.*)\n\n", text)
    return [(name, json.loads(data)) for name, data in found]


def test_messages_whole_streamed_and_stopped_equal_the_chat_answer(agents):
    client = anthropic_client(agents)
    messages = [{"role": "user", "content": "Say something."}]
    chat = agents.client().chat.completions.create(
        model=model_of(agents),
        messages=[{"role": "system", "content": "Be brief."}, *messages],
        max_tokens=12,
    )
    text = chat.choices[0].message.content
    whole = client.messages.create(model="m", max_tokens=12, system="Be brief.", messages=messages)
    assert [b.text for b in whole.content] == [text]
    assert whole.stop_reason == (
        "max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn"
    )
    usage = whole.usage
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.redrafter["mode"] == "lookup" and usage.redrafter["steps"] >= 1

    body = {"model": "m", "max_tokens": 12, "system": "Be brief.", "messages": messages}
    events = raw_events(agents, body)
    kinds = [name for name, _ in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == text
    start, end = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["usage"]["cache_read_input_tokens"] > 0
    assert end["delta"]["stop_reason"] == whole.stop_reason
    assert end["usage"]["output_tokens"] == usage.output_tokens and "redrafter" in end["usage"]

    stop = text[len(text) // 2 :].strip()[:3]
    stopped = client.messages.create(
        model="m", max_tokens=12, system="Be brief.", messages=messages, stop_sequences=[stop]
    )
    assert stopped.content[0].text == text[: text.index(stop)]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)


def test_the_sdk_s_stream_reads_the_decoding_stats_from_message_delta(agents):
    """``usage.redrafter`` reaches a streaming `anthropic` client on ``message_delta``, with
    the keys a whole answer's has; the SDK's own final message copies only the usage fields
    it knows from that event (anthropic 2.16's accumulator), so it has none: documented."""
    client = anthropic_client(agents)
    request = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi."}]}
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        deltas = [event for event in stream if event.type == "message_delta"]
        final = stream.get_final_message()
    stats = deltas[-1].usage.redrafter
    assert stats.keys() == whole.usage.redrafter.keys() and stats["steps"] >= 1
    assert final.usage.output_tokens == deltas[-1].usage.output_tokens


def test_messages_errors_are_in_anthropic_s_shape_and_count_tokens_counts(agents):
    import anthropic

    client = anthropic_client(agents, max_retries=0)
    user = [{"role": "user", "content": "hi"}]
    bad = [
        ({"max_tokens": 0, "messages": user}, "max_tokens"),
        ({"max_tokens": 5, "messages": user, "extra_body": {"temperature": 1.5}}, "temperature"),
        ({"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, "role"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "image",
        ),
    ]
    for fields, word in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="m", **fields)
        assert e.value.body["type"] == "error", fields
        assert e.value.body["error"]["type"] == "invalid_request_error" and word in str(e.value)
    status, _, body = agents.request("/v1/messages", {"messages": user})
    assert status == 400 and body["error"]["message"] == "missing required parameter: max_tokens"
    status, _, body = agents.request("/v1/messages/nowhere", {})
    assert (status, body["type"], body["error"]["type"]) == (404, "error", "not_found_error")
    counted = client.messages.count_tokens(model="m", messages=user, system="Be brief.")
    done = client.messages.create(model="m", max_tokens=1, messages=user, system="Be brief.")
    assert counted.input_tokens == done.usage.input_tokens + done.usage.cache_read_input_tokens


def test_interleaved_conversations_over_both_apis_prefill_only_their_new_tokens(agents):
    """A (OpenAI), B (Anthropic), A again: A's second turn finds its whole history."""
    openai_client, anthropic_ = agents.client(), anthropic_client(agents)
    model = model_of(agents)
    a = [{"role": "user", "content": "Conversation A."}]
    first = openai_client.chat.completions.create(model=model, messages=a, max_tokens=6)
    anthropic_.messages.create(
        model="m", max_tokens=6, messages=[{"role": "user", "content": "Other talk B."}]
    )
    a += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "More."},
    ]
    second = openai_client.chat.completions.create(model=model, messages=a, max_tokens=6)
    fed = second.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens
    # the new turn's tokens, and the answer's last token (generated, never fed)
    new = second.usage.prompt_tokens - first.usage.prompt_tokens - first.usage.completion_tokens
    assert 1 <= fed <= new + 2, (fed, new)


# ---------------------------------------------------------------- the audit's defects


def with_deep_schema(body: dict, levels: int) -> bytes:
    """``body``'s JSON with its "DEEP" string replaced by a schema nested ``levels`` deep
    (spelled here: json.dumps recurses once per level too)."""
    schema = '{"type": "object", "properties": {"x": ' * levels + "{}" + "}}" * levels
    return json.dumps(body).replace('"DEEP"', schema).encode()


def test_count_tokens_answers_every_prompt_messages_refuses_with_a_400(agents):
    """Each prompt /v1/messages refuses gets the same 400 from count_tokens (it closed the
    connection), in Anthropic's error shape."""
    user = [{"role": "user", "content": "hi"}]
    tool = {"name": "t", "input_schema": {"type": "object"}}
    bodies = [
        {"messages": [{"role": "user", "content": "lone \ud800 surrogate"}]},
        {"messages": user, "tools": [tool | {"description": "lone \ud800"}]},
        {"messages": user, "tools": [tool | {"input_schema": "DEEP"}]},
        {"messages": [{"role": "user", "content": []}], "tools": [tool]},
    ]
    for body in bodies:
        whole = with_deep_schema(body | {"max_tokens": 4}, 900)
        status, _, whole = agents.request("/v1/messages", whole)
        assert status == 400 and whole["type"] == "error", (body, whole)
        status, _, counted = agents.request(
            "/v1/messages/count_tokens", with_deep_schema(body, 900)
        )
        assert status == 400 and counted["error"]["type"] == "invalid_request_error", counted
    status, _, _ = agents.request("/v1/messages/count_tokens", {"messages": user})
    assert status == 200  # the server goes on


def test_a_body_nested_past_the_parser_gets_a_400_on_every_endpoint(agents):
    body = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        status, _, reply = agents.request(path, body)
        assert status == 400 and "nests deeper" in json.dumps(reply), (path, reply)


def test_empty_stop_lists_mean_no_stop_strings(agents):
    user = [{"role": "user", "content": "hi"}]
    status, _, chat = agents.request(
        "/v1/chat/completions", {"messages": user, "max_tokens": 3, "stop": []}
    )
    assert status == 200 and chat["choices"][0]["finish_reason"] in ("stop", "length")
    status, _, message = agents.request(
        "/v1/messages", {"messages": user, "max_tokens": 3, "stop_sequences": []}
    )
    assert status == 200 and message["type"] == "message"


def test_json_response_formats_and_tool_choice_without_tools_are_refused(agents):
    user = [{"role": "user", "content": "hi"}]
    for form in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {}}):
        status, _, reply = agents.request(
            "/v1/chat/completions", {"messages": user, "max_tokens": 3, "response_format": form}
        )
        assert status == 400 and reply["error"]["param"] == "response_format", reply
    status, _, reply = agents.request(
        "/v1/chat/completions",
        {"messages": user, "max_tokens": 3, "response_format": {"type": "text"}},
    )
    assert status == 200
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        body = {"messages": user, "max_tokens": 3, "tool_choice": choice}
        status, _, reply = agents.request("/v1/chat/completions", body)
        assert status == 400 and reply["error"]["param"] == "tool_choice", reply
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        body = {"messages": user, "max_tokens": 3, "tool_choice": choice}
        status, _, reply = agents.request("/v1/messages", body)
        assert status == 400 and "tool_choice" in reply["error"]["message"], reply


def test_a_developer_message_is_the_system_prompt(agents):
    client, model = agents.client(), model_of(agents)
    user = {"role": "user", "content": "Say something."}
    answers = [
        client.chat.completions.create(
            model=model, messages=[{"role": role, "content": "Be brief."}, user], max_tokens=8
        )
        for role in ("system", "developer")
    ]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens


def test_a_text_completion_is_its_log_prob_tokens_joined(agents):
    """The detokenizer drops an answer's first space (right for chat, wrong for a
    continuation): the text is its tokens, whole and streamed; the end token that ended it
    has the last log-prob entry (one per token counted, as mlx-lm's server gives them), and
    no text."""
    client, model = agents.client(), model_of(agents)
    texts = []
    for prompt in ("The weather in Paris is", "Once upon a time", "1, 2, 3,", "Hello", "Q: A"):
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=6, logprobs=0)
        choice = whole.choices[0]
        tokens = choice.logprobs.tokens
        assert len(tokens) == whole.usage.completion_tokens, prompt
        ended = choice.finish_reason == "stop"
        assert choice.text == "".join(tokens[: len(tokens) - ended]), prompt
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=6, logprobs=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text
        texts.append(choice.text)
    assert any(text.startswith(" ") for text in texts), texts  # the case that was wrong


# ---------------------------------------------------------------- Claude Code's requests


def test_system_messages_inside_messages_join_the_system_prompt(agents):
    """Claude Code's environment notes after a user turn (role "system" in messages): the
    same prompt as their text after the system prompt; its other fields are accepted."""
    user = {"role": "user", "content": "Say something."}
    folded = {"max_tokens": 8, "system": "Be brief.\n\nNote one.\n\nNote two.", "messages": [user]}
    inline = {
        "max_tokens": 8,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            user,
            {"role": "system", "content": "Note one."},
            {"role": "system", "content": [{"type": "text", "text": "Note two."}]},
        ],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "output_config": {"effort": "medium"},
        "metadata": {"user_id": "someone"},
    }
    status, _, one = agents.request("/v1/messages", folded)
    assert status == 200, one
    status, _, two = agents.request("/v1/messages?beta=true", inline)
    assert status == 200, two
    assert one["content"] == two["content"]
    tokens = [
        m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"] for m in (one, two)
    ]
    assert tokens[0] == tokens[1]
    for refused, word in (
        ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config"),
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({"messages": [{"role": "system", "content": "Only a note."}]}, "no user"),
    ):
        status, _, error = agents.request("/v1/messages", folded | refused)
        assert status == 400 and word in error["error"]["message"], (refused, error)


def test_any_model_name_is_answered_by_the_model_served_on_both_apis(agents, tool_model_path):
    """One rule for both APIs: the served name is the folder's; any name is answered."""
    client = agents.client()
    (listed,) = client.models.list().data
    assert listed.id == tool_model_path.name
    user = [{"role": "user", "content": "hi"}]
    for name in (listed.id, str(tool_model_path), "gpt-5-codex"):
        answer = client.chat.completions.create(model=name, messages=user, max_tokens=2)
        assert answer.model == listed.id
    message = anthropic_client(agents).messages.create(
        model="claude-sonnet-4-5", max_tokens=2, messages=user
    )
    assert message.model == listed.id
    status, _, found = agents.request(f"/v1/models/{listed.id}", method="GET")
    assert status == 200 and found["id"] == listed.id


RESPONSE_OPTIONS = {  # what parse_responses puts in a call's options
    "instructions": None,
    "max_output_tokens": None,
    "tools": [],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {},
    "custom": frozenset(),
    "left_out": (),
}
THOUGHT = "<think>\nFirst, the city.\n</think>\n\nIt is sunny."


def pieces_of(text: str, seed: int) -> list[StepResponse]:
    """``text`` cut into 6 steps at random, the last one finishing."""
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), 5))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return [StepResponse(p, [], None, "stop" if i == 5 else None) for i, p in enumerate(parts)]


@pytest.mark.parametrize("opened", [False, True])
def test_reasoning_splits_from_the_answer_however_steps_cut_its_tags(opened):
    """Qwen3 thinks between <think> tags, opened by the model or (Qwen3.5, thinking on) by
    the template's generation prompt: reasoning and text apart, whatever the cuts."""
    from redrafter_mlx.server.protocol import Answer

    text = THOUGHT.removeprefix("<think>") if opened else THOUGHT
    for seed in range(40):
        answer = Answer(None, None, reasoning=("<think>", "</think>"), thinking=opened)
        for step in pieces_of(text, seed):
            answer.add(step)
        assert (answer.reasoning, answer.text) == ("First, the city.\n", "It is sunny.")
    plain = Answer(None, None, reasoning=("<think>", "</think>"))
    plain.add(StepResponse("No thoughts < here.", [], None, "stop"))
    assert (plain.reasoning, plain.text) == ("", "No thoughts < here.")


def test_reasoning_streams_as_thinking_blocks_and_reasoning_content():
    from redrafter_mlx.core.decode.stream import GenerationStats
    from redrafter_mlx.core.serving.service import Request, Started
    from redrafter_mlx.server.anthropic import Anthropic
    from redrafter_mlx.server.openai import OpenAI
    from redrafter_mlx.server.protocol import Answer, Call, Outcome
    from redrafter_mlx.server.responses import Responses

    started = Started(10, 0, None)
    apis = [
        (Anthropic("m"), "messages"),
        (OpenAI("m", None), "chat"),
        (Responses("m"), "responses"),
    ]
    for api, kind in apis:
        call = Call(kind, Request([1]), stream=True, options=RESPONSE_OPTIONS)
        answer = Answer(None, None, reasoning=("<think>", "</think>"))
        stream = api.stream(call, started)
        events = [e for step in pieces_of(THOUGHT, 0) for e in stream.piece(answer.add(step))]
        if kind == "messages":
            starts = [e["content_block"]["type"] for n, e in events if n == "content_block_start"]
            assert starts == ["thinking", "text"]
            deltas = [e["delta"] for n, e in events if n == "content_block_delta"]
            thought = "".join(d.get("thinking", "") for d in deltas)
            assert [d["type"] for d in deltas].count("signature_delta") == 1
        elif kind == "chat":
            deltas = [e["choices"][0]["delta"] for _, e in events]
            thought = "".join(d.get("reasoning_content", "") for d in deltas)
            assert "".join(d.get("content", "") for d in deltas) == "It is sunny."
        else:
            events += stream.end(answer, Outcome(started, GenerationStats(), None))
            items = events[-1][1]["response"]["output"]
            assert [i["type"] for i in items] == ["reasoning", "message"]
            thought = items[0]["summary"][0]["text"]
            assert items[1]["content"][0]["text"] == "It is sunny."
        assert thought == "First, the city.\n"


def test_the_thinking_switch_reaches_the_chat_template(tool_model_path):
    from mlx_lm.tokenizer_utils import load

    from redrafter_mlx.io.templates import apply_chat_template

    tokenizer = load(tool_model_path)
    tokenizer._tokenizer.chat_template = (
        "{{ messages[0]['content'] }}|{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% elif enable_thinking is defined %}<think>{% endif %}"
    )
    user = [{"role": "user", "content": "x"}]
    shown = {
        thinking: tokenizer.decode(apply_chat_template(tokenizer, user, thinking=thinking))
        for thinking in (None, True, False)
    }
    assert [shown[t].split("|")[-1] for t in (None, True, False)] == [
        "",
        "<think>",
        "<think></think>",
    ]


# ---------------------------------------------------------------- OpenAI's Responses API


RESPONSES_TOOLS = [
    {"type": "function", **tool_model.WEATHER["function"]},
    {"type": "web_search"},  # hosted: left out of the prompt
]


def test_a_tool_call_makes_the_round_trip_through_responses(agents):
    """Codex's API through the official SDK: a function call item, its output fed back
    (with a reasoning item and a hosted tool's call item, both left out), the answer."""
    client = agents.client()
    first = client.responses.create(
        model="gpt-5-codex", input=tool_model.QUESTION, tools=RESPONSES_TOOLS, store=False
    )
    assert first.status == "completed" and first.model == model_of(agents)
    (call,) = first.output
    assert (call.type, call.name) == ("function_call", "get_weather")
    assert json.loads(call.arguments) == tool_model.ARGUMENTS
    history = [
        *tool_model.QUESTION,
        {"type": "reasoning", "id": "rs_1", "summary": []},
        call.model_dump(exclude_none=True),
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"type": "function_call_output", "call_id": call.call_id, "output": tool_model.RESULT},
    ]
    final = client.responses.create(model="m", input=history, tools=RESPONSES_TOOLS, store=False)
    assert final.output_text == tool_model.FINAL and final.output[0].type == "message"
    assert final.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert final.usage.model_extra["redrafter"]["steps"] >= 1
    log = agents.log.read_text()
    assert log.count("left out of the prompt (hosted tools): web_search\n") == 1, log


def test_responses_stream_the_event_sequence_the_sdk_parses(agents):
    client = agents.client()
    whole = client.responses.create(
        model="m", input=tool_model.QUESTION, tools=RESPONSES_TOOLS, store=False
    )
    events = list(
        client.responses.create(
            model="m", input=tool_model.QUESTION, tools=RESPONSES_TOOLS, store=False, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    arguments = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
    done = events[-1].response
    assert done.output[0].arguments == arguments == whole.output[0].arguments
    text = client.responses.create(
        model="m", input="Say something.", max_output_tokens=6, store=False, stream=True
    )
    events = list(text)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response
    assert last.output_text == deltas and events[-1].type == f"response.{last.status}"
    assert last.status in ("completed", "incomplete")


def test_responses_refuse_what_needs_stored_state(agents):
    import openai

    client = agents.client(max_retries=0)
    for fields, word in (
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ):
        with pytest.raises(openai.BadRequestError, match=word):
            client.responses.create(model="m", input="hi", max_output_tokens=2, **fields)


# ---------------------------------------------------------------- tool-call formats

CALLS_AS_WRITTEN = {  # a get_weather call as each family's template writes it
    "json_tools": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>",
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>",
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
}


@pytest.mark.parametrize("family", sorted(CALLS_AS_WRITTEN))
def test_each_family_s_calls_are_read_by_mlx_lm_s_parser_however_steps_cut_them(family):
    """Hermes JSON, Qwen3-Coder's XML and Mistral's [TOOL_CALLS] (no closing tag: the call
    runs to the answer's end) through mlx-lm's own parsers."""
    import importlib

    from redrafter_mlx.io.templates import ToolFormat
    from redrafter_mlx.server.protocol import Answer

    parser = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    fmt = ToolFormat(parser.tool_call_start, parser.tool_call_end, parser.parse_tool_call)
    text = "Let me look. " + CALLS_AS_WRITTEN[family]
    for seed in range(30):
        answer = Answer(fmt, [tool_model.WEATHER])
        for step in pieces_of(text, seed):
            answer.add(step)
        assert answer.text == "Let me look. "
        assert [(c.name, c.arguments) for c in answer.calls] == [
            ("get_weather", tool_model.ARGUMENTS)
        ]
        assert answer.finish_reason == "tool_calls"


def test_codex_s_input_items_and_custom_tools_become_the_chat_template_s_messages():
    """A Codex request as its second turn sends it: developer messages into the system
    prompt, a custom tool (apply_patch) as a function of one string, its call and output,
    a reasoning item left out; the custom call comes back as a custom_tool_call item."""
    import importlib

    from redrafter_mlx.core.decode.stream import GenerationStats
    from redrafter_mlx.core.serving.service import Started
    from redrafter_mlx.io.templates import ToolFormat
    from redrafter_mlx.server.protocol import Answer, Call, Limits, Outcome
    from redrafter_mlx.server.responses import Responses, parse_responses

    parser = importlib.import_module("mlx_lm.tool_parsers.json_tools")
    limits = Limits(("m",), tools=ToolFormat("<tool_call>", "</tool_call>", parser.parse_tool_call))
    body = {
        "model": "gpt-5-codex",
        "instructions": "You are Codex.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Sandbox."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Fix it."}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
            {
                "type": "custom_tool_call",
                "call_id": "c1",
                "name": "apply_patch",
                "input": "*** Begin",
            },
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done."},
        ],
        "tools": [
            {"type": "custom", "name": "apply_patch", "description": "Patch files."},
            {"type": "web_search"},
            {"type": "namespace", "name": "mcp", "tools": []},
        ],
        "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "store": False,
        "prompt_cache_key": "abc",
        "parallel_tool_calls": False,
        "stream": True,
    }
    call = parse_responses(body, limits)
    chat = call.request.prompt
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[0]["content"] == "You are Codex.\n\nSandbox."
    assert chat.messages[2]["tool_calls"][0]["function"] == {
        "name": "apply_patch",
        "arguments": {"input": "*** Begin"},
    }
    assert chat.thinking is True and [t["function"]["name"] for t in chat.tools] == ["apply_patch"]
    assert call.options["left_out"] == ("web_search", "namespace")
    answer = Answer(limits.tools, call.tools)
    written = '<tool_call>{"name": "apply_patch", "arguments": {"input": "*** End"}}</tool_call>'
    answer.add(StepResponse(written, [], None, "stop"))
    outcome = Outcome(Started(10, 0, None), GenerationStats(), None)
    (item,) = Responses("m").response(
        Call("responses", call.request, options=call.options), answer, outcome
    )["output"]
    assert (item["type"], item["name"], item["input"]) == (
        "custom_tool_call",
        "apply_patch",
        "*** End",
    )


# the tool parts of Llama 3.1's chat template, as Meta wrote them
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its \
proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and \
its value}.Do not use variables.

{% for t in tools %}{{ t | tojson }}

{% endfor %}<|eot_id|>{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- set tool_call = message.tool_calls[0].function %}\
<|start_header_id|>assistant<|end_header_id|>

{{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}\
{{- tool_call.arguments | tojson }}{{- "}" }}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


def test_llama3_s_bare_json_calls_are_read_from_its_template_s_own_rendering(
    tool_model_path, tmp_path
):
    """mlx-lm has no parser for Llama 3.x, whose calls are a bare JSON object: read here,
    on the call as its template renders it, however steps cut it; JSON that names no tool
    offered stays text."""
    import shutil

    from mlx_lm.tokenizer_utils import load

    from redrafter_mlx.io.templates import apply_chat_template, tool_format
    from redrafter_mlx.server.protocol import Answer

    shutil.copytree(tool_model_path, tmp_path / "llama3")
    config_file = tmp_path / "llama3" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config | {"chat_template": LLAMA3_TEMPLATE}))
    tokenizer = load(tmp_path / "llama3")
    fmt = tool_format(tokenizer)
    assert fmt is not None and fmt.parse is not None and not tokenizer.has_tool_calling
    ids = apply_chat_template(
        tokenizer,
        [*tool_model.QUESTION, tool_model.called()],
        tools=[tool_model.WEATHER],
        add_generation_prompt=False,
    )
    rendered = tokenizer.decode(ids)
    call = rendered[rendered.rindex("<|end_header_id|>") + 17 : rendered.rindex("<|eot_id|>")]
    assert call.startswith('{"name": "get_weather"')
    for seed in range(30):
        answer = Answer(fmt, [tool_model.WEATHER])
        for step in pieces_of(call, seed):
            answer.add(step)
        assert answer.text == "" and answer.finish_reason == "tool_calls"
        assert [(c.name, c.arguments) for c in answer.calls] == [
            ("get_weather", tool_model.ARGUMENTS)
        ]
    quoted = 'As JSON: {"name": "Paris", "country": "France"}'
    answer = Answer(fmt, [tool_model.WEATHER])
    for step in pieces_of(quoted, 0):
        answer.add(step)
    assert (answer.text, answer.calls) == (quoted, [])


# ---------------------------------------------------------------- the SDKs' types, strictly


def raw_reply(served: Served, path: str, body: dict) -> str | list[str]:
    """The raw text of a reply: its JSON, or a stream's ``data:`` payloads (``[DONE]`` left
    out), as the SDKs would read them before their lenient parsing."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(served.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    assert response.status == 200, text
    if not body.get("stream"):
        return text
    data = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    return [d for d in data if d != "[DONE]"]


def strictly(kind, text: str):
    """``text`` validated as the SDK's ``kind`` in pydantic's strict mode: every field it
    declares required present, of its type (the SDKs' own parsing lets either pass)."""
    from pydantic import TypeAdapter

    return TypeAdapter(kind).validate_json(text, strict=True)


def test_replies_validate_strictly_as_the_sdks_declare_them(agents):
    """Whole and streamed replies of the Responses API, chat completions and Anthropic's
    Messages (text and a tool call): each validates as the installed SDK's pydantic models
    in strict mode, usage included (the Responses API's ``cache_write_tokens``)."""
    from anthropic.types import Message, RawMessageStreamEvent
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent

    tools = [t for t in RESPONSES_TOOLS if t["type"] == "function"]
    for request in (
        {"input": tool_model.QUESTION, "tools": tools},
        {"input": "Say something.", "max_output_tokens": 6},
    ):
        body = {"model": "m", "store": False, **request}
        done = strictly(Response, raw_reply(agents, "/v1/responses", body))
        assert done.usage.input_tokens_details.cache_write_tokens == 0
        events = raw_reply(agents, "/v1/responses", body | {"stream": True})
        last = [strictly(ResponseStreamEvent, e) for e in events][-1]
        assert last.response.usage.input_tokens == done.usage.input_tokens
    body = {"model": "m", "messages": tool_model.QUESTION, "tools": [tool_model.WEATHER]}
    strictly(ChatCompletion, raw_reply(agents, "/v1/chat/completions", body))
    stream = body | {"stream": True, "stream_options": {"include_usage": True}}
    for chunk in raw_reply(agents, "/v1/chat/completions", stream):
        strictly(ChatCompletionChunk, chunk)
    body = {"model": "m", "max_tokens": 64, "messages": tool_model.QUESTION}
    body["tools"] = ANTHROPIC_TOOLS
    strictly(Message, raw_reply(agents, "/v1/messages", body))
    events = raw_reply(agents, "/v1/messages", body | {"stream": True})
    for event in events:
        if json.loads(event)["type"] != "ping":  # a keep-alive, which the SDK's stream skips
            strictly(RawMessageStreamEvent, event)


def test_the_agent_docs_name_a_model_with_tools_and_cap_qwen_code_s_output():
    """docs/serving.md: the Anthropic agent example does not name the embedded model (whose
    template takes no tools: every agent request would get a 400), and Qwen Code's settings
    block is valid JSON capping its 32,768-token default."""
    from pathlib import Path

    from redrafter_mlx.io.embedded import default_model_path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    named = re.findall(r"ANTHROPIC_MODEL=(\S+)", docs)
    assert named and "smollm2-135m-instruct" not in named
    config = json.loads((default_model_path() / "tokenizer_config.json").read_text())
    assert "tools" not in config["chat_template"]  # why the embedded model serves no agent
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", docs, re.S)]
    (qwen,) = [b for b in blocks if "generationConfig" in b.get("model", {})]
    assert 0 < qwen["model"]["generationConfig"]["samplingParams"]["max_tokens"] < 32768
    assert "qwen --auth-type openai --openai-base-url http://127.0.0.1:8080/v1" in docs
