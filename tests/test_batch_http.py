"""Four clients at once through the real server batching them (`serve --max-batch 4`): both
APIs, streamed and whole, greedy and seeded; each answer equals the same request served
alone, with its own usage and acceptance statistics (a seeded one's the same as alone; a
greedy one's trees are fitted to the batch on the CPU plan, so its steps may differ)."""

from __future__ import annotations

import http.client
import json
import threading
from urllib.parse import urlsplit

import pytest
from support.serving import SHAPE, serving

pytestmark = pytest.mark.slow

USER = [
    "What is the capital of France?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "What is 17 times 3?",
]


@pytest.fixture(scope="module")
def batching(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-batch") / "server.log"
    with serving(log, "--max-batch", "4", "--queue-size", "8", *SHAPE) as served:
        yield served


def events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]


def openai_answer(served, body: dict) -> tuple[str, dict]:
    """(text, usage) of one chat completion, whole or streamed."""
    path, payload = "/v1/chat/completions", dict(body)
    if payload.get("stream"):
        payload["stream_options"] = {"include_usage": True}
    response = post(served, path, payload)
    if not payload.get("stream"):
        done = json.loads(response.read())
        return done["choices"][0]["message"]["content"], done["usage"]
    text, usage = "", None
    for event in events(response):
        usage = event.get("usage") or usage
        if event.get("choices") and event["choices"][0]["delta"].get("content"):
            text += event["choices"][0]["delta"]["content"]
    return text, usage


def anthropic_answer(served, body: dict) -> tuple[str, dict]:
    """(text, usage) of one Messages API call, whole or streamed."""
    response = post(served, "/v1/messages", body)
    if not body.get("stream"):
        done = json.loads(response.read())
        return "".join(b.get("text", "") for b in done["content"]), done["usage"]
    text, usage = "", None
    for event in events(response):
        if event.get("type") == "content_block_delta":
            text += event["delta"].get("text", "")
        if event.get("type") == "message_delta":
            usage = event["usage"]
    return text, usage


def post(served, path: str, body: dict):
    parts = urlsplit(served.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return conn.getresponse()


def requests() -> list[tuple]:
    """(api, body): each API whole and streamed, greedy and seeded sampling."""
    seeded = {"temperature": 0.8, "seed": 7}
    return [
        (openai_answer, {"messages": chat(0), "max_tokens": 24}),
        (openai_answer, {"messages": chat(1), "max_tokens": 24, "stream": True} | seeded),
        (anthropic_answer, {"messages": chat(2), "max_tokens": 24, "stream": True}),
        (anthropic_answer, {"messages": chat(3), "max_tokens": 24} | seeded),
    ]


def chat(i: int) -> list[dict]:
    return [{"role": "user", "content": USER[i]}]


@pytest.mark.soak
def test_four_clients_at_once_get_their_answers_served_alone(batching):
    alone = [api(batching, body) for api, body in requests()]
    together, failures = [None] * 4, []
    barrier = threading.Barrier(4)

    def client(i: int) -> None:
        try:
            api, body = requests()[i]
            barrier.wait()
            together[i] = api(batching, body)
        except Exception as e:  # reported below
            failures.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failures, failures
    for i, ((text, usage), (alone_text, alone_usage)) in enumerate(
        zip(together, alone, strict=True)
    ):
        assert text == alone_text and text
        block, alone_block = usage["redrafter"], alone_usage["redrafter"]
        histogram = {int(k): n for k, n in block["accept_histogram"].items()}
        assert sum(histogram.values()) == block["steps"] > 0
        assert sum((k - 1) * n for k, n in histogram.items()) == block["accepted_tokens"]
        if "seed" in requests()[i][1]:  # its trees, and so its draws, are the ones alone
            assert block["steps"] == alone_block["steps"]
            assert block["accepted_tokens"] == alone_block["accepted_tokens"] > 0
