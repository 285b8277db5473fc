"""The HTTP layer of `redrafter-mlx serve`: a Starlette app on uvicorn, over this server's own
connection protocol (:mod:`~redrafter_mlx.server.wire`: half-closed clients answered,
ambiguous framing refused in JSON, clients that left told to the worker). Each POST route
parses its API's request (:mod:`~redrafter_mlx.server.openai`,
:mod:`~redrafter_mlx.server.anthropic`, :mod:`~redrafter_mlx.server.responses`) into a
:class:`~redrafter_mlx.server.protocol.Call`, submits it to the generation service and answers
whole or streamed; every error is the JSON error object of the API the path belongs to.

The event loop only moves bytes: parsing, waiting on the worker and building each answer run
on threads (a prompt's template and tokenizer take milliseconds; the worker's queue blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import signal
import socket
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from redrafter_mlx.core.decode.stream import StepResponse
from redrafter_mlx.core.errors import ContextFull, ReDrafterError
from redrafter_mlx.core.serving.service import (
    Engine,
    GenerationService,
    Job,
    QueueFull,
    Sampling,
    Started,
    Stopping,
)
from redrafter_mlx.server import anthropic as anthropic_api
from redrafter_mlx.server import openai
from redrafter_mlx.server import protocol as api
from redrafter_mlx.server import responses as responses_api
from redrafter_mlx.server.wire import HEADER_SECONDS, Waiting, Wire, most_waiting

MAX_BODY_BYTES = 4 << 20  # a 128k-token conversation is about 0.5 MB of text
DRAIN_BYTES = 64 << 20  # an oversized body up to this is read and dropped, so the 413 arrives
RETRY_AFTER_SECONDS = 1
BACKLOG = 64  # connections waiting to be accepted, and accepted at once by the event loop
IDLE_SECONDS = 300  # how long a kept-alive connection may wait for its next request
SHUTDOWN_SECONDS = 5  # on SIGINT / SIGTERM, answers still running get this long
LAST_EVENT_SECONDS = 10  # then this long for their last step and event (uvicorn then cancels)
SSE_HEADERS = {  # no length: the stream ends with the connection (see wire.Framing.send)
    "content-type": "text/event-stream",
    "cache-control": "no-cache",
    "connection": "close",
}
COUNT_TOKENS = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
POST_ROUTES = {
    "/v1/chat/completions": openai.parse_chat,
    "/v1/completions": openai.parse_completion,
    RESPONSES: responses_api.parse_responses,
    "/v1/messages": anthropic_api.parse_messages,
    COUNT_TOKENS: anthropic_api.parse_count,
}

log = logging.getLogger("redrafter_mlx.server")


@dataclass
class App:
    """What every request handler shares: the service, the limits requests are checked
    against, the three APIs' formats, and ``count`` (a prompt -> its tokens, for
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
    left_out: set[str] = field(default_factory=set)  # hosted tool kinds said in the log
    drafter_type: str | None = None  # the drafter's ``Source.kind`` (None: none loaded)

    def shape_source(self, started: Started, sampling: Sampling) -> str | None:
        return None if started.shape is None else self.shape_sources[Engine.samples(sampling)]

    def api(self, path: str | None) -> api.Api:
        """The API a path belongs to, whose error shape its refusals take."""
        path = path or ""
        name = "openai"
        if path.startswith("/v1/messages"):
            name = "anthropic"
        elif path.rstrip("/") == RESPONSES:
            name = "responses"
        return self.apis[name] if self.apis else api.Api()

    def error_bytes(self, path: str | None, status: int, message: str, code: str) -> bytes:
        """A refusal of the wire's (:class:`~redrafter_mlx.server.wire.Wire`) as JSON."""
        log.warning("%d %s", status, message)
        return json.dumps(
            self.api(path).error_body(api.ApiError(status, message, code=code))
        ).encode()


# ---------------------------------------------------------------- running it


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (IPv6 hosts too), bound before the model loads: a taken port fails
    at once, and clients that connect during the loading wait in the backlog."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)  # many clients may connect at once
    except OSError:
        sock.close()
        raise
    return sock


def serve(
    app: App,
    sock: socket.socket,
    *,
    header_timeout: float = HEADER_SECONDS,
    idle_timeout: float = IDLE_SECONDS,
    waiting: int | None = None,
) -> int | None:
    """Answer on ``sock`` until SIGINT or SIGTERM (:class:`Server`); the signal that stopped
    it, once every answer has ended. A request's head must be complete
    ``header_timeout`` s after its first byte (its body may not stall longer either), a
    connection may idle ``idle_timeout`` s between requests, and at most ``waiting``
    connections (default: about half the free file descriptors) wait for a request at once."""
    host, port = sock.getsockname()[:2]
    wire = partial(
        Wire,
        error_body=app.error_bytes,
        header_timeout=header_timeout,
        waiting=Waiting(waiting or most_waiting(BACKLOG)),
    )
    config = uvicorn.Config(
        asgi(app),
        host=host,
        port=port,
        http=wire,
        lifespan="off",
        timeout_keep_alive=idle_timeout,
        # uvicorn's 2048 is also how many asyncio accepts at once, before Waiting counts them
        backlog=BACKLOG,
        timeout_graceful_shutdown=SHUTDOWN_SECONDS + LAST_EVENT_SECONDS,
        server_header=False,
        headers=[("server", "redrafter-mlx")],
        log_config=log_config(),
    )
    server = Server(config, app.service)
    server.run(sockets=[sock])
    return server.stopped_by


class Server(uvicorn.Server):
    """uvicorn's server, stopped alike by SIGINT and SIGTERM: no new connection, the answers
    still running get SHUTDOWN_SECONDS, then each ends at its next step with its API's last
    event (the service's :meth:`~GenerationService.end_answers`; requests not started get
    503). The signal is not raised again once it has stopped (uvicorn's own does: a
    KeyboardInterrupt, or a death by SIGTERM): the command ends the process itself."""

    def __init__(self, config: uvicorn.Config, service: GenerationService):
        super().__init__(config)
        self.service = service
        self.stopped_by: int | None = None

    def handle_exit(self, sig: int, frame) -> None:
        self.stopped_by = self.stopped_by or sig
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        stops = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(SHUTDOWN_SECONDS, self.service.end_answers)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def log_config() -> dict:
    """uvicorn's, with the access log on stderr too (stdout is for answers elsewhere) and this
    module's lines (generations, refusals, clients that left) in the same format."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    config["loggers"][log.name] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def asgi(app: App) -> Starlette:
    handlers = Handlers(app)
    routes = [
        Route("/health", handlers.health, methods=["GET"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/v1/models/{name:path}", handlers.model, methods=["GET"]),
    ]
    for path, parse in POST_ROUTES.items():
        routes.append(Route(path, partial(handlers.post, parse=parse), methods=["POST"]))
    return Starlette(routes=routes, exception_handlers={HTTPException: handlers.refused})


_DONE = object()


async def in_thread(produce: Callable[[], Iterator]) -> AsyncIterator:
    """The items of ``produce()``, made on a thread of its own (it may wait on the worker for
    minutes, which would hold a place of the shared thread pool), each handed to the event
    loop as it comes; what it raises is raised here."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()

    def hand(item, error=None) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, (item, error))
        except RuntimeError:  # the loop has closed (shutdown): nobody waits for it
            pass

    def pump() -> None:
        try:
            for item in produce():
                hand(item)
        except BaseException as e:
            hand(_DONE, e)
        else:
            hand(_DONE)

    threading.Thread(target=pump, name="redrafter-answer", daemon=True).start()
    while True:
        item, error = await items.get()
        if error is not None:
            raise error
        if item is _DONE:
            return
        yield item


async def on_thread(function: Callable, *args):
    """``function(*args)`` on a thread of its own (see :func:`in_thread`)."""
    async for result in in_thread(lambda: iter((function(*args),))):
        return result


def nobody() -> Response:
    """The response of a request whose client has gone: never written."""
    return Response(status_code=204, headers={"connection": "close"})


def json_response(status: int, body: dict, headers: dict | None = None) -> Response:
    # json.dumps as before: ASCII, and -inf log-probs as -Infinity (Starlette's refuses them)
    return Response(json.dumps(body), status, headers, media_type="application/json")


class Handlers:
    """The routes' endpoints. Every error is the JSON error object of the API the path
    belongs to (Anthropic's under ``/v1/messages``, Responses' under ``/v1/responses``,
    OpenAI's elsewhere)."""

    def __init__(self, app: App):
        self.app = app

    # -- routes

    async def health(self, request: Request) -> Response:
        service = self.app.service
        status = "ok" if service.alive else "unavailable"
        body = {"status": status, "busy": service.busy, "waiting": service.waiting}
        return json_response(200 if service.alive else 503, body)

    async def models(self, request: Request) -> Response:
        return json_response(200, openai.models(self.app.limits, self.app.created))

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}``."""
        name, app = request.path_params["name"], self.app
        if name not in app.limits.model_ids:
            return self.error(request.url.path, api.model_not_found(name, app.limits))
        return json_response(200, openai.models(app.limits, app.created)["data"][0])

    async def refused(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's 404 and 405 in the API's shape; a method other than GET, HEAD and POST
        is not implemented anywhere (501, as before on http.server). A HEAD's refusal is not
        warned of: clients probe with it (Claude Code's ``HEAD /api/hello`` on every run)."""
        path, method = request.url.path, request.method
        if method not in ("GET", "HEAD", "POST"):
            error = api.ApiError(501, f"method {method} is not served", code="not_implemented")
        elif exc.status_code == 405:
            takes = "POST" if path in POST_ROUTES else "GET"
            error = api.ApiError(405, f"{path} takes {takes}", code="method_not_allowed")
        else:
            error = api.ApiError(404, f"no endpoint {path}", code="not_found")
        return self.error(path, error, quiet=method == "HEAD")

    async def post(self, request: Request, parse) -> Response:
        path = request.url.path
        try:
            raw = await self.read_body(request)
        except api.ApiError as e:
            return self.error(path, e)
        except ClientDisconnect:
            return nobody()
        gone = request.state.connection.client_gone
        taken = await on_thread(self.submit, path, parse, raw, gone)
        if isinstance(taken, Response):
            return taken
        return await self.answer(path, *taken)

    def submit(self, path: str, parse, raw: bytes, client_gone) -> Response | tuple:
        """Parse and queue the request (on a thread: the template and tokenizer run here):
        ``(call, job, in_thought)``, or the response that refuses it (count_tokens' too)."""
        app = self.app
        try:
            body = api.parse_json(raw)
            if path == COUNT_TOKENS:
                return json_response(200, {"input_tokens": self.count(parse(body, app.limits))})
            call = parse(body, app.limits)
            self.note_left_out(call.options.get("left_out", ()))
            in_thought = self.opens_thinking(call)
            return call, app.service.submit(call.request, client_gone=client_gone), in_thought
        except api.ApiError as e:
            return self.error(path, e)
        except (QueueFull, Stopping) as e:
            return self.unavailable(path, e)
        except Exception as e:
            return self.error(path, self.internal_error(e))

    # -- a request's answer

    async def answer(self, path: str, call: api.Call, job: Job, in_thought: bool) -> Response:
        """Wait for the worker to take ``job`` up, then answer whole or streamed."""
        try:
            started = await on_thread(job.start)
        except Stopping as e:  # the server stopped before the request began
            return self.unavailable(path, e)
        except ReDrafterError as e:  # the prompt's fault: too long, or refused by the template
            code = "context_length_exceeded" if isinstance(e, ContextFull) else "invalid_value"
            param = {"text": "prompt", "responses": "input"}.get(call.kind, "messages")
            return self.error(path, api.ApiError(400, str(e), param, code))
        except Exception as e:
            return self.error(path, self.internal_error(e))
        if started is None:  # the client left while the request waited
            return nobody()
        if call.stream:
            events = self.stream(path, call, job, started, in_thought)
            return StreamingResponse(events, headers=SSE_HEADERS)
        return await on_thread(self.whole, path, call, job, started, in_thought)

    def whole(
        self, path: str, call: api.Call, job: Job, started: Started, in_thought: bool
    ) -> Response:
        """The answer in one JSON response (made once generation ends)."""
        answer = self.new_answer(call, in_thought)
        last: StepResponse | None = None
        try:
            for last in job.steps():
                answer.add(last)
        except Exception as e:
            return self.error(path, self.internal_error(e))
        if last is None or last.finish_reason is None:  # cancelled: nobody to answer
            self.left(call, last)
            return nobody()
        outcome = self.outcome(call, started, last)
        self.log_generation(call, outcome, answer.finish_reason)
        return json_response(200, self.app.api(path).response(call, answer, outcome))

    async def stream(
        self, path: str, call: api.Call, job: Job, started: Started, in_thought: bool
    ) -> AsyncIterator[bytes]:
        """Server-sent events, made on a thread as the worker's steps come."""
        try:
            async for data in in_thread(lambda: self.events(path, call, job, started, in_thought)):
                yield data
        finally:  # ended, or the client left (Starlette stops the stream): stop generating
            job.cancel()

    def events(
        self, path: str, call: api.Call, job: Job, started: Started, in_thought: bool
    ) -> Iterator[bytes]:
        """The API's stream: its first events, those of each decode step with new text or
        tool calls, its last ones."""
        protocol = self.app.api(path)
        answer, events = self.new_answer(call, in_thought), protocol.stream(call, started)
        yield sse(events.begin())
        last: StepResponse | None = None
        try:
            for last in job.steps():
                if data := sse(events.piece(answer.add(last))):
                    yield data
        except Exception as e:  # the stream has begun: the error goes in it
            yield sse([protocol.stream_error(self.internal_error(e))])
            return
        if last is None or last.finish_reason is None:  # cancelled: the client left
            self.left(call, last)
            return
        outcome = self.outcome(call, started, last)
        yield sse(events.end(answer, outcome))
        self.log_generation(call, outcome, answer.finish_reason)

    def new_answer(self, call: api.Call, in_thought: bool) -> api.Answer:
        app = self.app
        return api.Answer(
            app.limits.tools,
            call.tools,
            call.forced_call,
            app.decode,
            reasoning=app.limits.reasoning if call.kind != "text" else None,
            thinking=in_thought,
        )

    def note_left_out(self, kinds) -> None:
        """Say once per kind which hosted tools (or their items) were left out of prompts."""
        new = [kind for kind in kinds if kind not in self.app.left_out]
        if new:
            self.app.left_out.update(new)
            log.info("left out of the prompt (hosted tools): %s", ", ".join(new))

    def opens_thinking(self, call: api.Call) -> bool:
        """Whether the answer starts inside the model's reasoning: its template's generation
        prompt ends with the opening tag (Qwen3.5's, thinking on). Encoded here as for
        count_tokens; a prompt that fails to encode is the worker's to refuse."""
        tags, app = self.app.limits.reasoning, self.app
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
            return self.app.count(prompt)
        except ReDrafterError as e:
            raise api.ApiError(400, str(e), "messages", "invalid_value") from None
        except Exception as e:  # as the worker says it (a chat template that refuses a role)
            message = f"the prompt cannot be encoded: {e}"
            raise api.ApiError(400, message, "messages", "invalid_value") from None

    def left(self, call: api.Call, last: StepResponse | None) -> None:
        """The client went away mid-answer: its generation stopped (or stops at the next step)."""
        tokens = "" if last is None else f" after {last.stats.generation_tokens} tokens"
        log.info("%s: the client left%s; generation stopped", call.kind, tokens)

    def outcome(self, call: api.Call, started: Started, last: StepResponse) -> api.Outcome:
        source = self.app.shape_source(started, call.request.sampling)
        return api.Outcome(started, last.stats, source, self.app.drafter_type)

    # -- the body and errors

    async def read_body(self, request: Request) -> bytes:
        """The request body; ApiError when it has no length or is longer than the limit (a
        chunked one never gets here: the wire refuses it)."""
        length = request.headers.get("content-length")
        if length is None:
            raise api.ApiError(411, "a Content-Length header is required", code="length_required")
        limit = self.app.max_body_bytes
        if int(length) > limit:  # h11 let only digits through
            await drop_body(request, int(length))
            raise api.ApiError(
                413,
                f"the request body is {length} bytes; this server reads at most {limit}",
                code="request_too_large",
            )
        return await request.body()

    def error(
        self, path: str, error: api.ApiError, headers: dict | None = None, *, quiet: bool = False
    ) -> Response:
        """The API's error response; warned of in the log unless ``quiet`` (the access log
        still has its line)."""
        if not quiet:
            log.warning("%d %s", error.status, error.message)
        if error.status == 413:  # its body was dropped, or never sent (Expect: 100-continue)
            headers = {**(headers or {}), "connection": "close"}
        return json_response(error.status, self.app.api(path).error_body(error), headers)

    def unavailable(self, path: str, error: QueueFull | Stopping) -> Response:
        """503 with ``Retry-After``: the queue is full, or the server is stopping."""
        if isinstance(error, QueueFull):
            message, code = f"the server is busy: {error}; retry later", "queue_full"
        else:
            message, code = f"{error}; retry later", "server_stopping"
        refusal = api.ApiError(503, message, None, code, "server_error")
        return self.error(path, refusal, {"Retry-After": str(RETRY_AFTER_SECONDS)})

    def internal_error(self, error: Exception) -> api.ApiError:
        """A bug: its traceback to the server's stderr, one line to the client."""
        traceback.print_exception(error, file=sys.stderr)
        message = f"internal error: {type(error).__name__}: {error}"
        return api.ApiError(500, message, code="internal_error", type="server_error")

    def log_generation(self, call: api.Call, outcome: api.Outcome, reason: str | None) -> None:
        log.info(
            "%s: %d prompt tokens (%d cached), %d tokens, %.1f tok/s, %.2f tokens/step, %s",
            call.kind,
            outcome.prompt_tokens,
            outcome.cached_tokens,
            outcome.completion_tokens,
            outcome.stats.generation_tps,
            outcome.stats.tokens_per_step,
            reason,
        )


async def drop_body(request: Request, length: int) -> None:
    """Read an oversized body into nothing: a server that closes a connection with unread
    bytes resets it, and the client may then never see the 413. Not past DRAIN_BYTES, nor a
    body the client waits to send (``Expect: 100-continue``: it is refused before)."""
    if length > DRAIN_BYTES or "100-continue" in request.headers.get("expect", "").lower():
        return
    try:
        async for _ in request.stream():
            pass
    except ClientDisconnect:
        pass


def sse(events: list[tuple]) -> bytes:
    """Server-sent events, each ``(name or None, JSON object or text)``."""
    lines = []
    for name, body in events:
        data = body if isinstance(body, str) else json.dumps(body)
        lines.append(f"event: {name}\ndata: {data}\n\n" if name else f"data: {data}\n\n")
    return "".join(lines).encode()
