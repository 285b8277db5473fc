"""The HTTP API under fuzzing: hypothesis draws request bodies, headers and framing, sends them
to the real server (one per module, as in test_serve.py) over raw sockets on 127.0.0.1, and
checks that every response is a JSON error or a valid answer and that after each batch a good
request still gets the right answer; then a bounded soak of mixed requests checks that the
server's memory stays flat and /health stays good.

Bounded for `make test` (about a minute here); more with REDRAFTER_FUZZ_EXAMPLES (examples per
fuzzing test, default 25) and REDRAFTER_SOAK_SECONDS (default 10).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.serving import (
    FRANCE,
    MODEL,
    STORY,
    Served,
)

EXAMPLES = int(os.environ.get("REDRAFTER_FUZZ_EXAMPLES", "25"))
SOAK_SECONDS = float(os.environ.get("REDRAFTER_SOAK_SECONDS", "10"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # no example database written next to the tests
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
GOOD = {"messages": FRANCE, "max_tokens": 8}
ERROR_FIELDS = {"message", "type", "param", "code"}

# ---------------------------------------------------------------- the wire


def exchange(served: Served, data: bytes, timeout: float = 60) -> bytes:
    """What the server sends back for ``data`` on one connection. The client half-closes after
    sending (the server answers, then sees the end and closes): a short body cannot stall."""
    parts = urlsplit(served.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # refused and closed before everything was sent: read what came
            pass
        chunks = []
        try:
            while chunk := sock.recv(1 << 16):
                chunks.append(chunk)
        except ConnectionResetError:  # closed with our bytes unread: the answer came first
            pass
        return b"".join(chunks)


def request(method: str, path: str, body: bytes | None, headers=(), version="HTTP/1.1") -> bytes:
    lines = [f"{method} {path} {version}", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers)]
    if body is not None and not any(k.lower() == "content-length" for k, _ in headers):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def responses(raw: bytes) -> list[tuple[int, dict, bytes]]:
    """The final responses in ``raw``, in order (interim 1xx ones skipped)."""
    found = []
    while raw:
        head, sep, raw = raw.partition(b"\r\n\r\n")
        assert sep, f"a response cut off: {head[:300]!r}"
        status_line, *lines = head.decode("latin-1").split("\r\n")
        version, status, _ = (status_line + " ").split(" ", 2)
        assert version == "HTTP/1.1", status_line
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
        if 100 <= int(status) < 200:
            continue
        if "content-length" in headers:
            length = int(headers["content-length"])
            body, raw = raw[:length], raw[length:]
        else:  # a stream: it ends with the connection
            body, raw = raw, b""
        found.append((int(status), headers, body))
    return found


def check(raw: bytes) -> list[tuple[int, dict]]:
    """Every response in ``raw`` is a JSON error (never a 500: that is a bug) or a valid
    answer; at least one came. Returns (status, body) of each."""
    found = responses(raw)
    assert found, "no response"
    return [check_one(*response) for response in found]


def check_one(status: int, headers: dict, body: bytes) -> tuple[int, dict]:
    if headers.get("content-type") == "text/event-stream":
        assert status == 200
        events = [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] in ("chat.completion.chunk", "text_completion") for c in chunks)
        return status, {"stream": chunks}
    assert headers.get("content-type") == "application/json", (status, headers)
    answer = json.loads(body)
    if status == 200 and "choices" in answer:
        choice = answer["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length"), choice
        return status, answer
    if status == 200:  # GET /v1/models, /v1/models/{model}, /health
        assert answer.get("object") in ("list", "model") or answer.get("status") == "ok"
        return status, answer
    assert 400 <= status < 600 and status != 500, answer
    assert set(answer["error"]) == ERROR_FIELDS and answer["error"]["message"], answer
    return status, answer


def good_answer_is_right(served: Served, reference) -> None:  # noqa: F811
    """A good request after a batch: the library's own greedy answer, and health is good."""
    (status, answer), *_ = check(
        exchange(served, request("POST", "/v1/chat/completions", json.dumps(GOOD).encode()))
    )
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == reference(FRANCE, 8)[0]
    assert served.health() == {"status": "ok", "busy": False, "waiting": 0}


# ---------------------------------------------------------------- strategies

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.just(10**400),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "robot", ""]),
            "content": st.one_of(st.text(max_size=30), json_values),
        }
    ),
    max_size=3,
)
# Never a large valid budget: the fuzzing is of the parsing, not of long answers.
budgets = st.one_of(
    st.integers(1, 4),
    st.integers(max_value=0),
    st.integers(min_value=10**6),
    scalars.filter(lambda value: value is not None),  # None: the server's default, 512
)
FIELDS = {
    "temperature": st.one_of(st.floats(0, 2), st.just(1e-40), scalars),
    "top_p": st.one_of(st.floats(0, 1), scalars),
    "top_k": st.one_of(st.integers(0, 60000), scalars),
    "seed": st.one_of(st.integers(0, 2**64), scalars),
    "stop": st.one_of(
        st.text(max_size=8), st.lists(st.text(max_size=8), max_size=6), st.just("x" * 1001)
    ),
    "stream": st.one_of(st.booleans(), scalars),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": scalars}), scalars),
    "n": st.one_of(st.just(1), scalars),
    "logprobs": scalars,
    "model": st.one_of(st.just(MODEL), scalars),
    "presence_penalty": scalars,
    "max_completion_tokens": st.one_of(st.integers(max_value=4), scalars),
}
chat_bodies = st.fixed_dictionaries(
    {"messages": st.one_of(messages, json_values), "max_tokens": budgets}, optional=FIELDS
)
completion_bodies = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            st.text(max_size=30), st.lists(st.integers(-5, 60000), max_size=6), json_values
        ),
        "max_tokens": budgets,
    },
    optional=FIELDS,
)
header_names = st.text("abcdefghijklmnopqrstuvwxyz-ABCXYZ0123456789", min_size=1, max_size=16)
header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
headers = st.lists(
    st.one_of(
        st.tuples(header_names, header_values),
        st.tuples(st.just("Content-Type"), st.sampled_from(["text/plain", "application/json"])),
        st.tuples(st.just("Expect"), st.just("100-continue")),
        st.tuples(st.just("Connection"), st.sampled_from(["close", "keep-alive", "upgrade"])),
        st.tuples(st.just("Transfer-Encoding"), st.sampled_from(["chunked", "gzip", "x"])),
        st.tuples(
            st.just("Content-Length"), st.sampled_from(["0", "5", "-1", "+5", "1_0", "9" * 30])
        ),
    ),
    max_size=4,
)


# ---------------------------------------------------------------- the tests


@pytest.mark.slow
def test_fuzzed_bodies_get_a_json_error_or_a_valid_answer(server, reference):  # noqa: F811
    @FUZZ
    @given(
        st.one_of(
            st.tuples(st.just("/v1/chat/completions"), chat_bodies),
            st.tuples(st.just("/v1/completions"), completion_bodies),
        ),
        st.booleans(),
    )
    def body_is_answered(case, corrupt):
        path, body = case
        data = json.dumps(body).encode()
        if corrupt:  # cut: the JSON decoder's errors
            data = data[: len(data) // 2]
        check(exchange(server, request("POST", path, data)))

    body_is_answered()
    good_answer_is_right(server, reference)


@pytest.mark.slow
def test_fuzzed_headers_and_raw_bodies_get_json_answers(server, reference):  # noqa: F811
    @FUZZ
    @given(
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "BREW"]),
        st.sampled_from(
            ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/x", "*"]
        ),
        headers,
        st.one_of(st.none(), st.binary(max_size=64), st.just(json.dumps(GOOD).encode())),
    )
    def request_is_answered(method, path, extra, body):
        check(exchange(server, request(method, path, body, extra)))

    request_is_answered()
    good_answer_is_right(server, reference)


@pytest.mark.slow
def test_fuzzed_framing_gets_json_answers_and_never_a_smuggled_one(server, reference):  # noqa: F811
    """Lengths off by some bytes, lengths twice, request lines of other versions, requests
    sent ahead: each one answered in JSON; a conflict answered once, then closed."""
    body = json.dumps({"messages": FRANCE, "max_tokens": 2}).encode()
    ahead = request("GET", "/v1/models", None)

    @FUZZ
    @given(
        st.integers(-len(body), 40),
        st.sampled_from(["one", "twice the same", "two different", "absent"]),
        st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTX/1.1", "HTTP/1.1 x"]),
        st.booleans(),
    )
    def framing_is_answered(offset, lengths, version, pipelined):
        stated = str(len(body) + offset)
        declared = {
            "one": [stated],
            "twice the same": [stated, stated],
            "two different": [stated, str(len(body))],
            "absent": [],
        }[lengths]
        extra = [("Content-Length", v) for v in declared] or [("X-No-Length", "1")]
        data = request("POST", "/v1/chat/completions", body, extra, version)
        answers = check(exchange(server, data + (ahead if pipelined else b"")))
        if len(declared) == 2:  # refused (or the request line was), then closed: one answer
            assert len(answers) == 1 and answers[0][0] in (400, 505), answers

    framing_is_answered()
    good_answer_is_right(server, reference)


def rss_bytes(pid: int) -> int:
    done = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(done.stdout.strip()) * 1024


def stream_and_leave(served: Served) -> None:
    """A streamed answer whose client closes after its first chunk."""
    parts = urlsplit(served.url)
    data = request(
        "POST",
        "/v1/chat/completions",
        json.dumps({"messages": STORY, "max_tokens": 200, "stream": True}).encode(),
    )
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(data)
        assert sock.recv(1 << 12).startswith(b"HTTP/1.1 200")


MIXED = [
    lambda s: check(
        exchange(s, request("POST", "/v1/chat/completions", json.dumps(GOOD).encode()))
    ),
    lambda s: check(
        exchange(
            s,
            request(
                "POST",
                "/v1/completions",
                json.dumps(
                    {"prompt": "Once upon a time", "max_tokens": 4, "stream": True}
                ).encode(),
            ),
        )
    ),
    lambda s: check(exchange(s, request("POST", "/v1/chat/completions", b'{"messages": ['))),
    lambda s: check(exchange(s, request("GET", "/v1/models", None))),
    stream_and_leave,
]


@pytest.mark.slow
@pytest.mark.soak
def test_a_soak_of_mixed_requests_keeps_memory_flat_and_health_good(server, reference):  # noqa: F811
    for run in MIXED:  # warm: the first answers allocate what every later one reuses
        run(server)
    time.sleep(0.5)
    before = rss_bytes(server.pid)
    deadline, rounds = time.monotonic() + SOAK_SECONDS, 0
    while time.monotonic() < deadline:
        for run in MIXED:
            run(server)
        rounds += 1
        assert server.health()["status"] == "ok"
    good_answer_is_right(server, reference)
    grown = rss_bytes(server.pid) - before
    assert rounds >= 1 and grown < max(64 << 20, before // 5), (rounds, before, grown)
