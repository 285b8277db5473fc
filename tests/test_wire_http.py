"""The server's wire against slow and hostile clients, on the HTTP server with no model behind
it (``tests/support/wire_server.py``, started in about a second): heads and bodies that never
end, idle connections, a flood of slow connections against a small descriptor limit, and
every refusal in the error shape of its path's API."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest
from support.serving import Served, wire_serving

HEADER_TIMEOUT = 1.0  # the test server's: seconds for a head, or between a body's bytes
IDLE_TIMEOUT = 2.0  # the test server's: seconds a connection may wait for its next request
PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
)


@pytest.fixture(scope="module")
def wire(tmp_path_factory):
    log = tmp_path_factory.mktemp("wire") / "server.log"
    timeouts = ("--header-timeout", str(HEADER_TIMEOUT), "--idle-timeout", str(IDLE_TIMEOUT))
    with wire_serving(log, *timeouts) as served:
        yield served


def connect(served: Served, timeout: float = 10) -> socket.socket:
    parts = urlsplit(served.url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (socket.timeout if it does not)."""
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def one_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, read whole; the connection left open."""

    def more(data: bytes) -> bytes:
        chunk = sock.recv(1 << 16)
        assert chunk, f"closed mid-response: {data!r}"
        return data + chunk

    data = b""
    while b"\r\n\r\n" not in data:
        data = more(data)
    head = data.partition(b"\r\n\r\n")[0]
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(data) < len(head) + 4 + length:
        data = more(data)
    return data


def refusal(reply: bytes) -> tuple[int, dict]:
    """(status, JSON body) of a reply of one response."""
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split(b" ", 2)[1]), json.loads(body)


def assert_shape(path: str, error: dict, *, status: int) -> str:
    """The error object of ``path``'s API; returns its message."""
    if path.startswith("/v1/messages"):  # Anthropic's
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
        assert error["error"]["type"] == "invalid_request_error", (status, error)
        return error["error"]["message"]
    assert set(error["error"]) == {"message", "type", "param", "code"}, error  # OpenAI's
    return error["error"]["message"]


# ---------------------------------------------------------------- slow clients


@pytest.mark.parametrize("path", PATHS)
def test_a_head_that_never_ends_gets_a_408_in_its_api_s_shape(wire, path):
    """Partial heads were never timed out: a slow client held its connection for ever."""
    with connect(wire) as sock:
        began = time.monotonic()
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: applic".encode())
        reply = until_closed(sock)
        waited = time.monotonic() - began
    status, error = refusal(reply)
    assert status == 408 and "timed out" in assert_shape(path, error, status=408)
    assert HEADER_TIMEOUT - 0.1 < waited < HEADER_TIMEOUT + 5


def test_a_head_trickled_a_byte_at_a_time_is_timed_from_its_first_byte(wire):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    with connect(wire) as sock:
        began = time.monotonic()
        try:
            for byte in head:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)  # each byte well within the timeout of the one before
        except OSError:  # closed on us mid-way: what the test wants
            pass
        reply = until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - began < HEADER_TIMEOUT + 5  # not 100 x 0.05 s and more


def test_a_body_that_stalls_gets_a_408_and_the_server_goes_on(wire):
    with connect(wire) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        status, error = refusal(until_closed(sock))
    assert status == 408 and "body stalled" in assert_shape("/v1/messages", error, status=408)
    assert wire.health()["status"] == "ok"


def test_a_body_promised_after_100_continue_and_never_sent_gets_a_408(wire):
    with connect(wire) as sock:
        sock.sendall(
            b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        reply = until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    status, error = refusal(reply.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n"))
    assert status == 408 and "body stalled" in assert_shape("/v1/responses", error, status=408)


def test_connections_idle_past_the_idle_timeout_are_closed_before_and_after_a_request(wire):
    with connect(wire) as silent, connect(wire) as kept:
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert one_response(kept).startswith(b"HTTP/1.1 200 ")
        began = time.monotonic()
        assert until_closed(silent) == b"" and until_closed(kept) == b""
        assert time.monotonic() - began < IDLE_TIMEOUT + 5


def test_a_flood_of_slow_connections_leaves_room_for_a_good_request(tmp_path):
    """3,000 slow connections took every descriptor (2,048) and a good request waited; here
    700 of them against a server allowed 512 descriptors, whose heads would time out only
    after a minute: the oldest waiting ones are closed for the new ones."""
    log = tmp_path / "server.log"
    slow = []
    with wire_serving(log, "--header-timeout", "60", "--files", "512") as served:
        try:
            for _ in range(700):
                sock = connect(served)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                slow.append(sock)
            began = time.monotonic()
            with connect(served, timeout=30) as good:  # before: never (the heads' 60 s)
                good.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                reply = until_closed(good)
            waited = time.monotonic() - began  # at once, unless the machine is loaded
            assert reply.startswith(b"HTTP/1.1 200 ") and waited < 20, (reply[:100], waited)
            assert all(closed(sock) for sock in slow[:100])  # the oldest
        finally:
            for sock in slow:
                sock.close()
    assert "Traceback" not in log.read_text()


def closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock``: with a 408, or reset (when it closed the connection
    before reading its bytes); False if it is still open after 10 s."""
    try:
        reply = until_closed(sock)
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return reply == b"" or reply.startswith(b"HTTP/1.1 408 ")


# ---------------------------------------------------------------- refusals' shapes


@pytest.mark.parametrize("path", PATHS)
def test_a_content_length_past_what_python_parses_is_refused_in_the_path_s_shape(wire, path):
    """A 4,401-digit Content-Length on /v1/messages got OpenAI's error shape."""
    with connect(wire) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {'9' * 4401}\r\n\r\n".encode()
        )
        status, error = refusal(until_closed(sock))
    assert status == 400 and assert_shape(path, error, status=400)


@pytest.mark.parametrize("path", PATHS)
def test_malformed_and_oversized_heads_are_refused_in_the_path_s_shape(wire, path):
    for head, status in [
        (f"POST {path} HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400),
        (f"POST {path} HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 70000}", 431),  # no end
    ]:
        with connect(wire) as sock:
            try:
                sock.sendall(head.encode())
            except OSError:  # refused before all of it was sent
                pass
            got, error = refusal(until_closed(sock))
        assert got == status and assert_shape(path, error, status=status)


def test_a_head_request_for_an_unknown_path_gets_a_quiet_404(wire):
    """Claude Code's ``HEAD /api/hello`` on every run logged a 501 warning."""
    logged = len(wire.log.read_text())
    with connect(wire) as sock:
        sock.sendall(b"HEAD /api/hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 404 ")
    time.sleep(0.2)  # the log line, if any, is written after the answer
    assert "WARNING" not in wire.log.read_text()[logged:]


SURROGATE = "caf\ud800"  # a lone surrogate: JSON can carry it (as \ud800), text cannot
SILENTLY_ACCEPTED = [
    # (path, body, the field the 400 must name)
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": SURROGATE}]},
        "messages[0].content",
    ),
    (
        "/v1/messages",
        {"max_tokens": 8, "messages": [{"role": "user", "content": SURROGATE}]},
        "messages[0].content",
    ),
    ("/v1/responses", {"input": [{"role": "user", "content": SURROGATE}]}, "input[0].content"),
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi", "name": 7}]},
        "messages[0].name",
    ),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "bogus"}}, "reasoning.effort"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "bogus"},
        "reasoning_effort",
    ),
    (
        "/v1/messages",
        {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": "x"},
        "stop_sequences",
    ),
    (
        "/v1/responses",
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_9", "output": "42"},
            ]
        },
        "input[1].call_id",
    ),
]


@pytest.mark.parametrize(
    "path,body,param", SILENTLY_ACCEPTED, ids=[f"{p} {f}" for p, _, f in SILENTLY_ACCEPTED]
)
def test_fields_once_accepted_silently_get_a_400_naming_them(wire, path, body, param):
    status, _, error = wire.request(path, json.dumps(body).encode())
    message = assert_shape(path, error, status=status)
    assert status == 400 and message.startswith(f"{param}: "), message
    assert "\n" not in message and "surrogates not allowed" not in message
    if not path.startswith("/v1/messages"):
        assert error["error"]["param"] == param
