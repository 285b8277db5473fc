"""The HTTP server of `redrafter-mlx serve` with no model behind it, for the tests of its wire
(timeouts, slow clients, refusals and their error shapes): every endpoint and API as served,
over a service that is always idle and refuses every request that passes the API's checks
with a full queue (503). Started by ``support.serving.wire_serving``; prints the same ready
line as `serve`.

    python tests/support/wire_server.py [--header-timeout S] [--idle-timeout S] [--files N]

``--files N``: at most N open file descriptors (set after the imports: mlx-lm's sets its own).
"""

from __future__ import annotations

import argparse
import resource
import sys

from redrafter_mlx.core.serving.service import QueueFull
from redrafter_mlx.server import anthropic, openai, responses
from redrafter_mlx.server import app as server_app
from redrafter_mlx.server import protocol as api

MODEL = "wire-test"


class NoService:
    """The service's face to the handlers: alive, idle, and every request refused as a full
    queue (no model to answer it)."""

    alive, busy, waiting = True, False, 0

    def submit(self, request, client_gone=None):
        raise QueueFull("no model behind this test server")

    def end_answers(self) -> None:  # what a signal asks of the service: nothing runs here
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--header-timeout", type=float)  # default: serve's
    parser.add_argument("--idle-timeout", type=float)
    parser.add_argument("--files", type=int, default=None)
    args = parser.parse_args()
    if args.files is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.files, args.files))
    limits = api.Limits(model_ids=(MODEL,), max_context=4096)
    app = server_app.App(
        NoService(),
        limits,
        {False: "default", True: "default"},
        apis={
            "openai": openai.OpenAI(MODEL, None),
            "anthropic": anthropic.Anthropic(MODEL),
            "responses": responses.Responses(MODEL),
        },
        count=lambda prompt: 1,
    )
    sock = server_app.listen("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    print(f"serving the OpenAI API at http://{host}:{port}/v1", file=sys.stderr, flush=True)
    try:
        timeouts = {"header_timeout": args.header_timeout, "idle_timeout": args.idle_timeout}
        server_app.serve(app, sock, **{k: v for k, v in timeouts.items() if v is not None})
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
