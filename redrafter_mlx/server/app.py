"""The HTTP layer of `redrafter-mlx serve`: Python's own ``http.server``
(``ThreadingHTTPServer``: one thread per connection), the one mlx-lm's server is built on; its
request handler is tied to mlx-lm's generator, so this module has its own. Each POST route
parses its API's request (:mod:`~redrafter_mlx.server.openai`,
:mod:`~redrafter_mlx.server.anthropic`, :mod:`~redrafter_mlx.server.responses`) into a
:class:`~redrafter_mlx.server.protocol.Call`, submits it to the generation service and answers
whole or streamed; every error is the JSON error object of the API the path belongs to.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

from redrafter_mlx.core.errors import ContextFull, ReDrafterError
from redrafter_mlx.core.service import Engine, GenerationService, Job, QueueFull, Sampling, Started
from redrafter_mlx.core.stream import StepResponse
from redrafter_mlx.server import anthropic as anthropic_api
from redrafter_mlx.server import openai
from redrafter_mlx.server import protocol as api
from redrafter_mlx.server import responses as responses_api

MAX_BODY_BYTES = 4 << 20  # a 128k-token conversation is about 0.5 MB of text
DRAIN_BYTES = 64 << 20  # an oversized body up to this is read and dropped, so the 413 arrives
RETRY_AFTER_SECONDS = 1


@dataclass
class App:
    """What every request handler shares: the service, the limits requests are checked
    against, the two APIs' formats, and ``count`` (a prompt -> its tokens, for
    count_tokens)."""

    service: GenerationService
    limits: api.Limits
    shape_sources: dict[bool, str]  # where the greedy (False) and sampling (True) shapes came from
    max_body_bytes: int = MAX_BODY_BYTES
    created: int = 0  # when the server started (the model's ``created``)
    apis: dict[str, api.Api] | None = None  # "openai", "responses", "anthropic"
    count: Callable[[object], int] | None = None
    tail: Callable[[object], str] | None = None  # a prompt -> its last tokens' text
    decode: Callable[[list[int]], str] | None = None  # token ids -> text

    def shape_source(self, started: Started, sampling: Sampling) -> str | None:
        return None if started.shape is None else self.shape_sources[Engine.samples(sampling)]


class Server(ThreadingHTTPServer):
    daemon_threads = True  # a connection thread never keeps the process alive
    request_queue_size = 64  # the listen backlog: many clients may connect at once

    def __init__(self, host: str, port: int):
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.address_family = family  # IPv6 hosts too
        super().__init__(address, Handler)
        self.app: App | None = None  # set once the model is ready
        self.left_out: set[str] = set()  # hosted tool kinds said in the log

    def handle_error(self, request, client_address) -> None:
        """A client that hung up is no error to report: a health check that gave up during
        start-up (its connection waited in the backlog) was a BrokenPipeError traceback."""
        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            return
        super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    """One connection's requests. Every error is the JSON error object of the API the path
    belongs to (Anthropic's under ``/v1/messages``, OpenAI's elsewhere)."""

    protocol_version = "HTTP/1.1"  # keep-alive for whole answers; a stream closes its connection
    server_version = "redrafter-mlx"
    default_request_version = "HTTP/1.1"  # so that a refused request line gets a status line
    timeout = 300  # seconds a connection may idle, or a write block on a client not reading
    server: Server

    def setup(self) -> None:
        super().setup()
        self.wire = threading.Lock()  # the worker's probe (client_gone) against our writes
        self.responding = False  # the current request's answer has begun
        self.probed = False  # the current request's client was probed (client_gone)
        self.api_name = "openai"  # whose error shape the current request gets
        self.in_thought = False  # the current request's answer starts inside its reasoning

    def parse_request(self) -> bool:
        """http.server's, less HTTP/0.9: a two-word request line (as the rest of a body sent
        past its Content-Length may be) would be answered with a bare body, no status line."""
        if len(self.raw_requestline.split()) == 2:
            self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
            self.request_version, self.command = "HTTP/1.1", None
            self.send_error(400, "HTTP/0.9 requests are not served: send HTTP/1.1")
            return False
        return super().parse_request()

    def send_response(self, code: int, message: str | None = None) -> None:
        with self.wire:  # from here on client_gone sends no probe
            self.responding = True
        super().send_response(code, message)

    # -- routes

    def route(self) -> str:
        """The request's path, and whose API it belongs to (for its errors)."""
        path = urlsplit(self.path).path.rstrip("/")
        self.api_name = "openai"
        if path.startswith("/v1/messages"):
            self.api_name = "anthropic"
        elif path == RESPONSES:
            self.api_name = "responses"
        return path

    def do_GET(self) -> None:
        path = self.route()
        app = self.server.app
        if self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0") != "0":
            self.close_connection = True  # a body GET never reads: not to be the next request
        if path == "/health":
            service = app.service
            status = "ok" if service.alive else "unavailable"
            body = {"status": status, "busy": service.busy, "waiting": service.waiting}
            self.send_json(200 if service.alive else 503, body)
        elif path == "/v1/models":
            self.send_json(200, openai.models(app.limits, app.created))
        elif path.startswith("/v1/models/"):
            self.send_model(unquote(path.removeprefix("/v1/models/")))
        elif path in POST_ROUTES:
            self.send_api_error(api.ApiError(405, f"{path} takes POST", code="method_not_allowed"))
        else:
            self.send_api_error(api.ApiError(404, f"no endpoint {path}", code="not_found"))

    def do_POST(self) -> None:
        self.responding = self.probed = False  # a new request on a kept-alive connection
        path = self.route()
        parse = POST_ROUTES.get(path)
        app = self.server.app
        try:
            raw = self.read_body()  # first: unread, it would be taken for the next request
            if parse is None:
                raise api.ApiError(404, f"no endpoint {path}", code="not_found")
            if path == COUNT_TOKENS:
                self.send_json(
                    200, {"input_tokens": self.count(parse(api.parse_json(raw), app.limits))}
                )
                return
            call = parse(api.parse_json(raw), app.limits)
            self.note_left_out(call.options.get("left_out", ()))
            self.in_thought = self.opens_thinking(call)
            job = app.service.submit(call.request, client_gone=self.client_gone)
        except api.ApiError as e:
            self.send_api_error(e)
            return
        except QueueFull as e:
            error = api.ApiError(
                503, f"the server is busy: {e}; retry later", None, "queue_full", "server_error"
            )
            self.send_api_error(error, {"Retry-After": str(RETRY_AFTER_SECONDS)})
            return
        self.answer(call, job)

    def send_model(self, name: str) -> None:
        """``GET /v1/models/{model}``."""
        app = self.server.app
        if name not in app.limits.model_ids:
            self.send_api_error(api.model_not_found(name, app.limits))
            return
        self.send_json(200, openai.models(app.limits, app.created)["data"][0])

    # -- a request's answer

    def answer(self, call: api.Call, job: Job) -> None:
        """Wait for the worker to take ``job`` up, then answer whole or streamed."""
        try:
            started = job.start()
        except ReDrafterError as e:  # the prompt's fault: too long, or refused by the template
            code = "context_length_exceeded" if isinstance(e, ContextFull) else "invalid_value"
            param = {"text": "prompt", "responses": "input"}.get(call.kind, "messages")
            self.send_api_error(api.ApiError(400, str(e), param, code))
            return
        except Exception as e:
            self.send_api_error(self.internal_error(e))
            return
        if started is None:  # the client left while the request waited
            self.close_connection = True
            return
        try:
            (self.stream if call.stream else self.whole)(call, job, started)
        except (ConnectionError, TimeoutError):  # a write failed: the client left
            job.cancel()
            self.left(call, None)

    def whole(self, call: api.Call, job: Job, started: Started) -> None:
        """The answer in one JSON response (sent once generation ends)."""
        answer = self.new_answer(call)
        last: StepResponse | None = None
        try:
            for last in job.steps():
                answer.add(last)
        except Exception as e:
            self.send_api_error(self.internal_error(e))
            return
        if last is None or last.finish_reason is None:  # cancelled: nobody to answer
            self.left(call, last)
            return
        outcome = self.outcome(call, started, last)
        self.send_json(200, self.protocol.response(call, answer, outcome))
        self.log_generation(call, outcome, answer.finish_reason)

    def stream(self, call: api.Call, job: Job, started: Started) -> None:
        """Server-sent events as the API streams them: its first events, those of each decode
        step with new text or tool calls, its last ones. The connection closes after it (no
        length known)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        answer, events = self.new_answer(call), self.protocol.stream(call, started)
        self.send_events(events.begin())
        last: StepResponse | None = None
        try:
            for last in job.steps():
                self.send_events(events.piece(answer.add(last)))
        except (ConnectionError, TimeoutError):  # a write failed: the client left
            job.cancel()
            self.left(call, last)
            return
        except Exception as e:  # the stream has begun: the error goes in it
            self.send_events([self.protocol.stream_error(self.internal_error(e))])
            return
        if last is None or last.finish_reason is None:  # cancelled
            self.left(call, last)
            return
        outcome = self.outcome(call, started, last)
        self.send_events(events.end(answer, outcome))
        self.log_generation(call, outcome, answer.finish_reason)

    @property
    def protocol(self) -> api.Api:
        return self.server.app.apis[self.api_name]

    def new_answer(self, call: api.Call) -> api.Answer:
        app = self.server.app
        return api.Answer(
            app.limits.tools,
            call.tools,
            call.forced_call,
            app.decode,
            reasoning=app.limits.reasoning if call.kind != "text" else None,
            thinking=self.in_thought,
        )

    def note_left_out(self, kinds) -> None:
        """Say once per kind which hosted tools (or their items) were left out of prompts."""
        new = [kind for kind in kinds if kind not in self.server.left_out]
        if new:
            self.server.left_out.update(new)
            self.log_message("left out of the prompt (hosted tools): %s", ", ".join(new))

    def opens_thinking(self, call: api.Call) -> bool:
        """Whether the answer starts inside the model's reasoning: its template's generation
        prompt ends with the opening tag (Qwen3.5's, thinking on). Encoded here as for
        count_tokens; a prompt that fails to encode is the worker's to refuse."""
        tags, app = self.server.app.limits.reasoning, self.server.app
        if tags is None or call.kind == "text" or app.tail is None:
            return False
        try:
            tail = app.tail(call.request.prompt)
        except Exception:
            return False
        return tail.rfind(tags[0]) > tail.rfind(tags[1])

    def count(self, prompt) -> int:
        """count_tokens: the prompt's tokens, encoded here (the tokenizer alone, no MLX)."""
        try:
            return self.server.app.count(prompt)
        except ReDrafterError as e:
            raise api.ApiError(400, str(e), "messages", "invalid_value") from None
        except Exception as e:  # as the worker says it (a chat template that refuses a role)
            message = f"the prompt cannot be encoded: {e}"
            raise api.ApiError(400, message, "messages", "invalid_value") from None

    def left(self, call: api.Call, last: StepResponse | None) -> None:
        """The client went away mid-answer: its generation stopped (or stops at the next step)."""
        self.close_connection = True
        tokens = "" if last is None else f" after {last.stats.generation_tokens} tokens"
        self.log_message("%s: the client left%s; generation stopped", call.kind, tokens)

    def outcome(self, call: api.Call, started: Started, last: StepResponse) -> api.Outcome:
        source = self.server.app.shape_source(started, call.request.sampling)
        return api.Outcome(started, last.stats, source)

    # -- the wire

    def read_body(self) -> bytes:
        """The request body; ApiError when it has no length or is longer than the limit."""
        self.check_framing()
        length = self.body_length()
        limit = self.server.app.max_body_bytes
        if length > limit:
            self.drop_body(length)
            raise api.ApiError(
                413,
                f"the request body is {length} bytes; this server reads at most {limit}",
                code="request_too_large",
            )
        return self.rfile.read(length)

    def check_framing(self) -> None:
        """RFC 9112 section 6.3: a body this server cannot delimit with certainty is refused
        and the connection closed, or its rest would be read as the next request (request
        smuggling behind a proxy that framed it otherwise). Only Content-Length is served."""
        codings = ", ".join(self.headers.get_all("Transfer-Encoding") or ())
        lengths = self.headers.get_all("Content-Length") or ()
        if codings:
            self.close_connection = True
            if "chunked" in codings.lower():
                message = "send the body with a Content-Length, not chunked"
                raise api.ApiError(411, message, code="length_required")
            raise api.ApiError(
                400, f"unsupported Transfer-Encoding {codings!r}", code="bad_framing"
            )
        values = [v.strip() for line in lengths for v in line.split(",")]
        if len(values) > 1:
            self.close_connection = True
            message = f"Content-Length given {len(values)} times: send it once"
            raise api.ApiError(400, message, code="bad_framing")

    def body_length(self) -> int:
        text = self.headers.get("Content-Length")
        if text is None:
            self.close_connection = True
            raise api.ApiError(411, "a Content-Length header is required", code="length_required")
        digits = text.strip()
        if not (digits.isascii() and digits.isdigit()):  # int() takes "+5", "1_0", "٥"
            self.close_connection = True
            shown = text if len(text) <= 40 else text[:37] + "..."
            raise api.ApiError(400, f"invalid Content-Length {shown!r}", code="invalid_header")
        return int(digits) if len(digits) < 19 else 1 << 62  # past any limit, never parsed

    def drop_body(self, length: int) -> None:
        """Read an oversized body into nothing: a server that closes a connection with unread
        bytes resets it, and the client may then never see the 413. Past DRAIN_BYTES: close."""
        self.close_connection = True
        if length > DRAIN_BYTES:
            return
        while length > 0:
            read = len(self.rfile.read(min(length, 1 << 16)))
            if not read:
                return
            length -= read

    def handle_expect_100(self) -> bool:
        """Refuse an oversized body before the client sends it (curl asks first)."""
        app = self.server.app
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = 0
        if app is not None and length > app.max_body_bytes:
            self.close_connection = True
            self.send_api_error(
                api.ApiError(413, f"the request body may be at most {app.max_body_bytes} bytes")
            )
            return False
        return super().handle_expect_100()

    def client_gone(self) -> bool:
        """True once the client has gone (the worker asks before each step). A client only
        waits after its request, so anything readable is the end of its stream, or a next
        request sent ahead on the same connection. An end of stream may be a half-close
        (``shutdown(SHUT_WR)`` after the request): see :meth:`closed_for_good`."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable or self.connection.recv(1, socket.MSG_PEEK) != b"":
                return False
        except (OSError, ValueError):  # reset, or already closed here
            return True
        return self.closed_for_good()

    def closed_for_good(self) -> bool:
        """After the client's end of stream: probe once with an interim "100 Continue"
        response (RFC 9110 section 15.2: a client must skip 1xx responses it did not ask for).
        A client that closed answers it with a reset, which the next check reads as the
        socket's error (a read still says end of stream); one that only half-closed reads it
        and gets its answer. No probe once the answer has begun, nor to an HTTP/1.0 client
        (no 1xx for them): writing the answer fails if the client is gone."""
        with self.wire:
            if self.probed:
                return self.connection.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
            if self.responding or self.request_version == "HTTP/1.0":
                return False
            self.probed = True
            try:
                self.connection.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            except OSError:
                return True
        return False

    def send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:  # said, so that a client does not send the next request
            self.send_header("Connection", "close")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def send_events(self, events: list[tuple]) -> None:
        """Server-sent events, each ``(name or None, JSON object or text)``."""
        if not events:
            return
        lines = []
        for name, body in events:
            data = body if isinstance(body, str) else json.dumps(body)
            lines.append(f"event: {name}\ndata: {data}\n\n" if name else f"data: {data}\n\n")
        self.wfile.write("".join(lines).encode())
        self.wfile.flush()

    def send_api_error(self, error: api.ApiError, headers: dict | None = None) -> None:
        self.log_error("%d %s", error.status, error.message)
        app = self.server.app
        body = error.body() if app is None or app.apis is None else self.protocol.error_body(error)
        try:
            self.send_json(error.status, body, headers)
        except (ConnectionError, TimeoutError):
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None):
        """http.server's own refusals (a malformed request line, an unknown method) as JSON."""
        short, _ = self.responses.get(code, ("error", ""))
        self.close_connection = True
        self.send_api_error(api.ApiError(code, message or short, code="bad_request"))

    def internal_error(self, error: Exception) -> api.ApiError:
        """A bug: its traceback to the server's stderr, one line to the client."""
        traceback.print_exception(error, file=sys.stderr)
        message = f"internal error: {type(error).__name__}: {error}"
        return api.ApiError(500, message, code="internal_error", type="server_error")

    def log_generation(self, call: api.Call, outcome: api.Outcome, reason: str | None) -> None:
        self.log_message(
            "%s: %d prompt tokens (%d cached), %d tokens, %.1f tok/s, %.2f tokens/step, %s",
            call.kind,
            outcome.prompt_tokens,
            outcome.cached_tokens,
            outcome.completion_tokens,
            outcome.stats.generation_tps,
            outcome.stats.tokens_per_step,
            reason,
        )


COUNT_TOKENS = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
POST_ROUTES = {
    "/v1/chat/completions": openai.parse_chat,
    "/v1/completions": openai.parse_completion,
    RESPONSES: responses_api.parse_responses,
    "/v1/messages": anthropic_api.parse_messages,
    COUNT_TOKENS: anthropic_api.parse_count,
}
