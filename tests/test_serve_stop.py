"""`redrafter-mlx serve` stopped by a signal (slow: the real server on the embedded model):
SIGINT (Ctrl-C) and SIGTERM alike give the running answers 5 s, then end each with its API's
last event, refuse the requests that had not started with a 503 in their API's shape, and
exit 0 with no traceback; and a burst of ``--max-batch + --queue-size`` requests is taken
whole."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from urllib.parse import urlsplit

import pytest
from support.serving import SHAPE, STORY, serving, wait_until

pytestmark = pytest.mark.slow


def post(url: str, path: str, body: dict) -> tuple[int, bytes]:
    """(status, whole body) of one request, read to the end of its connection."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def events(data: bytes) -> list[dict]:
    return [json.loads(x[6:]) for x in data.decode().splitlines() if x.startswith("data: {")]


LONG = {"messages": STORY, "max_tokens": 2000}  # about a minute of answer here
REQUESTS = {  # two answered at once (--max-batch 2), two waiting behind them
    "chat": ("/v1/chat/completions", LONG),
    "messages stream": ("/v1/messages", {**LONG, "stream": True}),
    "messages waiting": ("/v1/messages", LONG),
    "chat stream waiting": ("/v1/chat/completions", {**LONG, "stream": True}),
}


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_running_answers_with_their_last_event_and_exits_0(tmp_path, stop):
    log = tmp_path / "server.log"
    with serving(log, "--max-batch", "2", "--queue-size", "4", *SHAPE) as served:
        answers: dict[str, tuple[int, bytes]] = {}
        clients = []
        for name, (path, body) in REQUESTS.items():
            client = threading.Thread(
                target=lambda n=name, p=path, b=body: answers.__setitem__(n, post(served.url, p, b))
            )
            client.start()
            clients.append(client)
            if name == "messages stream":  # the first two are taken up in order
                wait_until(lambda: served.health()["busy"], 60, "the answers to start")
        wait_until(lambda: served.health()["waiting"] == 2, 60, "two requests waiting")
        time.sleep(1)  # a few steps into the answers
        os.kill(served.pid, stop)
        stopped = time.monotonic()
        for client in clients:
            client.join(60)
        ended = time.monotonic() - stopped
        status = wait_for_exit(served.pid, 60)
    text = log.read_text()
    assert status == 0, text
    assert ended >= 4.5  # the running answers had their 5 s
    assert "Traceback" not in text and "terminate called" not in text and " 500 " not in text
    assert text.rstrip().endswith("stopped")
    chat_status, chat = answers["chat"]
    chat = json.loads(chat)
    assert chat_status == 200 and chat["choices"][0]["finish_reason"] == "length", chat
    assert 0 < chat["usage"]["completion_tokens"] < 2000
    assert chat["choices"][0]["message"]["content"]
    stream_status, stream = answers["messages stream"]
    names = [e["type"] for e in events(stream)]
    assert stream_status == 200 and names[-1] == "message_stop", names
    delta = [e for e in events(stream) if e["type"] == "message_delta"]
    assert delta and delta[-1]["delta"]["stop_reason"] == "max_tokens"
    waiting_status, waiting = answers["messages waiting"]  # Anthropic's error shape
    assert waiting_status == 503 and json.loads(waiting)["type"] == "error", waiting
    waiting_status, waiting = answers["chat stream waiting"]  # OpenAI's
    assert waiting_status == 503, waiting
    assert json.loads(waiting)["error"]["code"] == "server_stopping"


def wait_for_exit(pid: int, timeout: float) -> int | None:
    """The exit status of the server (a child of this process), None if it is still running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    return None


def test_a_burst_of_max_batch_plus_queue_size_requests_is_taken_whole(tmp_path):
    """24 clients at once against --max-batch 8 --queue-size 16: none refused (the queue used
    to count the requests the batch had not picked up yet: seven 503s in an audit)."""
    with serving(tmp_path / "server.log", "--max-batch", "8", "--queue-size", "16", *SHAPE) as s:
        barrier, statuses = threading.Barrier(24), []

        def client(i: int) -> None:
            body = {"messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 2}
            barrier.wait()
            statuses.append(post(s.url, "/v1/chat/completions", body)[0])

        clients = [threading.Thread(target=client, args=(i,)) for i in range(24)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(300)
    assert statuses == [200] * 24, statuses
