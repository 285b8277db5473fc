"""`redrafter-mlx serve` for agents and apps, through the official `openai` and `anthropic`
clients: tool calls (a round trip on a tiny model overfit to call a tool, see
tests/tool_model.py), Anthropic's Messages API (text, streaming and its event sequence, stop
sequences, errors, usage, count_tokens), interleaved conversations and the answers' split
into text and tool calls. One server per module, on the tiny model (fast to load)."""

from __future__ import annotations

import json
import random
import re

import pytest
from support import tool_model
from support.serving import Served, serving

from redrafter_mlx.core.generate import StepResponse

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

    from redrafter_mlx.cli.http_api import Answer
    from redrafter_mlx.io.templates import tool_format

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
