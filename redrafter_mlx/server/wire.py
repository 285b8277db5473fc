"""The wire under `redrafter-mlx serve`: uvicorn's h11 protocol, with what this server does
differently from stock uvicorn (docs/server.md, "The HTTP stack").

- A client may half-close after its request (``shutdown(SHUT_WR)``) and still wait for its
  answer: uvicorn closes on the end of stream, this protocol answers, then closes.
- A body whose length is not certain is refused and the connection closed (RFC 9112 section
  6.3; its rest could be read as a next request: smuggling): h11 refuses conflicting lengths
  and codings other than chunked, and accepts the same length twice and chunked bodies, which
  this server refuses too (only ``Content-Length`` is served).
- Every refusal is a JSON error in the shape of the API its path belongs to, not text.
- A streamed answer (no length, ``Connection: close``) is delimited by the close, as HTTP/1.1
  allows, not chunked: its events are on the wire as the API documents them.
- A connection is closed when its client is too slow: idle between requests past
  ``timeout_keep_alive``, a request head not complete ``header_timeout`` seconds after its
  first byte, or a body with no byte for ``header_timeout`` seconds (those two get a 408).
  At most :class:`Waiting`'s ``most`` connections may wait for a request at once; past it
  the one that has waited longest is closed, so that slow or silent clients cannot take every
  file descriptor and leave a good request unaccepted.
- :meth:`Wire.client_gone` tells the generation service's worker, from its thread, whether the
  client has gone, so that its generation stops before the next step.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from urllib.parse import unquote

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

# (path or None, status, message, code) -> the response's JSON body, in the path's API's shape
ErrorBody = Callable[[str | None, int, str, str], bytes]
HEADER_SECONDS = 30.0  # a request's head must be complete this long after its first byte
# A request line's target (a space, "?" or the line's end after it): the path of a head that
# h11 refused or that never ended, whose refusal takes that path's API's error shape.
REQUEST_LINE = re.compile(rb"[\r\n]*[!-~]+ +(/[^ ?\r\n]*)[ ?\r\n]")


class Framing(h11.Connection):
    """h11's HTTP/1.1 parser, refusing the framings h11 lets through (see the module)."""

    def __init__(self, max_incomplete_event_size: int | None):
        if max_incomplete_event_size is None:  # uvicorn's default: h11's
            super().__init__(h11.SERVER)
        else:
            super().__init__(h11.SERVER, max_incomplete_event_size)
        self.path: str | None = None  # the current request's, for its error's shape
        self.refusal: tuple[int, str, str] | None = None  # (status, message, code)

    def next_event(self):
        if self.their_state is h11.MUST_CLOSE:  # after "Connection: close": nothing more is read
            return h11.NEED_DATA
        # the bytes a request head is parsed from: h11 merges a repeated Content-Length
        buffered = b""
        if self.their_state is h11.IDLE:
            buffered, self.path = self.trailing_data[0], None
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.refusal = refusal_of(e)
            self.path = self.path or path_of(buffered)
            raise
        if type(event) is h11.Request:
            self.path = unquote(event.target.decode("ascii", "replace").partition("?")[0])
            head = buffered[: len(buffered) - len(self.trailing_data[0])]
            self.refusal = framing_refusal(event, head)
            if self.refusal is not None:
                raise h11.RemoteProtocolError(self.refusal[1])
        elif type(event) is h11.ConnectionClosed:
            return h11.NEED_DATA  # uvicorn's loop has no case for it: Wire closes when idle
        return event

    def request_path(self) -> str | None:
        """The path of the request being read: its head's, or its request line's while the
        head is still coming."""
        if self.path is None and self.their_state is h11.IDLE:
            return path_of(self.trailing_data[0])
        return self.path

    def send(self, event):
        """A response without a length that says ``Connection: close`` is sent close-delimited
        (h11 would chunk it for an HTTP/1.1 client): h11 frames it so for HTTP/1.0 peers."""
        if type(event) is not h11.Response or not close_delimited(event):
            return super().send(event)
        version, self.their_http_version = self.their_http_version, b"1.0"
        try:
            return super().send(event)
        finally:
            self.their_http_version = version


def path_of(head: bytes) -> str | None:
    """The (decoded) path of the request line that ``head`` begins with; None if it has none."""
    found = REQUEST_LINE.match(head)
    return None if found is None else unquote(found[1].decode("ascii", "replace"))


def refusal_of(error: h11.RemoteProtocolError) -> tuple[int, str, str]:
    """h11's refusal as this server's: a coding other than chunked is a framing of uncertain
    length (400, as RFC 9112 section 6.3 says), not h11's 501."""
    status = error.error_status_hint
    if status == 501:
        return 400, f"{error}: send the body with a Content-Length", "bad_framing"
    code = "request_header_too_large" if status == 431 else "bad_request"
    return status, str(error) or "malformed request", code


def framing_refusal(request: h11.Request, head: bytes) -> tuple[int, str, str] | None:
    if any(name == b"transfer-encoding" for name, _ in request.headers):  # h11 kept chunked only
        return 411, "send the body with a Content-Length, not chunked", "length_required"
    lengths = 0
    for line in head.split(b"\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            lengths += len(value.split(b","))
    if lengths > 1:
        return 400, f"Content-Length given {lengths} times: send it once", "bad_framing"
    return None


def close_delimited(response: h11.Response) -> bool:
    names = {name for name, _ in response.headers}
    closes = (b"connection", b"close") in response.headers
    return closes and b"content-length" not in names and b"transfer-encoding" not in names


class Waiting:
    """The connections that wait for a request (idle, or its head still coming), oldest first.
    Past ``most`` of them the oldest is closed: a flood of slow or silent clients would
    otherwise take every file descriptor, and a good request could not be accepted."""

    def __init__(self, most: int):
        self.most = most
        self.wires: dict[Wire, None] = {}  # insertion order: since when each waits

    def add(self, wire: Wire) -> None:
        if wire in self.wires:
            return
        self.wires[wire] = None
        while len(self.wires) > self.most:
            oldest = next(iter(self.wires))
            self.discard(oldest)
            oldest.timed_out()

    def discard(self, wire: Wire) -> None:
        self.wires.pop(wire, None)


def most_waiting(accept_batch: int) -> int:
    """How many connections may wait for a request at once: half the file descriptors still
    free, less two of the event loop's ``accept_batch`` (the connections it accepts at once
    before any is counted here, and as many closed for them whose descriptors are freed on the
    loop's next turn); the other half is for the answers being made."""
    try:
        import resource  # not on Windows
    except ImportError:
        return 512
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    soft = 1 << 16 if soft == resource.RLIM_INFINITY else soft
    for folder in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(folder):
            soft -= len(os.listdir(folder))
            break
    return max(16, soft // 2 - 2 * accept_batch)


class Wire(H11Protocol):
    """uvicorn's h11 protocol for one connection, with this server's framing (the module
    docstring). ``error_body`` renders a refusal in its path's API's shape; the ASGI app finds
    this connection as ``request.state.connection``. ``waiting`` is shared by the server's
    connections (None: no bound on them)."""

    def __init__(
        self,
        config,
        server_state,
        app_state,
        _loop=None,
        *,
        error_body: ErrorBody,
        header_timeout: float = HEADER_SECONDS,
        waiting: Waiting | None = None,
    ):
        super().__init__(config, server_state, {**app_state, "connection": self}, _loop)
        self.conn = Framing(config.h11_max_incomplete_event_size)
        self.error_body = error_body
        self.header_timeout = header_timeout
        self.waiting = waiting
        self.waits_for: str | None = None  # "idle", "head", "body" or None (being answered)
        self.timer = None  # closes the connection when what it waits for is late
        self.eof = False  # the client ended its side (maybe only half: it may still read)
        self.probed = None  # the request (its cycle) whose client was probed (client_gone)
        self.gone = False  # the client closed for good: seen by client_gone

    def connection_made(self, transport) -> None:
        """uvicorn arms its idle timer after a first answer only: a client that connects and
        sends nothing would hold its connection for ever. Here it waits as idle at once."""
        super().connection_made(transport)
        self.watch()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self.unwatch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.watch(progress=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.watch()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is h11.CLOSED and self.idle():
            self.transport.close()  # the client's end of stream, all its requests answered

    def idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    # -- slow clients

    def waiting_for(self) -> str | None:
        """What the connection waits for from its client: "idle" (a next request), "head"
        (the rest of one), "body" (the rest of a request's body), or None (for its answer)."""
        if self.conn.their_state is h11.SEND_BODY:  # after "Expect: 100-continue" too: the
            return "body"  # handler reads at once, which sends the "100 Continue"
        if not self.idle() or self.conn.their_state is not h11.IDLE:
            return None
        return "head" if self.conn.trailing_data[0] else "idle"

    def watch(self, *, progress: bool = False) -> None:
        """Arm the timer for what the connection waits for now (replacing uvicorn's idle
        one): a head's deadline runs from its first byte, a body's from its last byte."""
        self._unset_keepalive_if_required()
        if self.transport.is_closing():
            self.unwatch()
            return
        waits = self.waiting_for()
        if waits == self.waits_for and not (progress and waits == "body"):
            return
        self.stop_timer()
        self.waits_for = waits
        if waits in (None, "body"):
            if self.waiting is not None:
                self.waiting.discard(self)
            if waits is None:
                return
        elif self.waiting is not None:
            self.waiting.add(self)  # an idle one whose head begins keeps its place
        delay = self.timeout_keep_alive if waits == "idle" else self.header_timeout
        self.timer = self.loop.call_later(delay, self.timed_out)

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def unwatch(self) -> None:
        self.stop_timer()
        self.waits_for = None
        if self.waiting is not None:
            self.waiting.discard(self)

    def timed_out(self) -> None:
        """Close the connection whose client is late (or the one that waited longest, past
        :class:`Waiting`'s bound): a 408 when a request had begun, quietly when idle."""
        waits = self.waits_for
        self.unwatch()
        if self.transport.is_closing():
            return
        if waits in ("head", "body"):
            what = "its head was not complete" if waits == "head" else "its body stalled"
            message = f"request timed out: {what} within {self.header_timeout:g} s"
            self.refuse(408, message, "request_timeout")
            return
        self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    # -- refusals

    def eof_received(self) -> bool:
        """Keep the connection open for the answer: a client that only half-closed waits for
        it (uvicorn's closes at once). A request cut short is refused; the connection closes
        once every request before the end of stream has its answer."""
        self.eof = True
        self.conn.receive_data(b"")
        self.handle_events()
        self.watch()
        return True

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what h11 (or :class:`Framing`) refused: JSON, then close."""
        self.refuse(*(self.conn.refusal or (400, msg, "bad_request")))

    def refuse(self, status: int, message: str, code: str) -> None:
        """A JSON error in the shape of the request's path's API, then close (a request still
        being read is dropped: its handler sees a client that left)."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # an answer was begun
            self.transport.close()
            return
        body = self.error_body(self.conn.request_path(), status, message, code)
        headers = [
            (b"Content-Type", b"application/json"),
            (b"Content-Length", str(len(body)).encode()),
            (b"Connection", b"close"),
        ]
        response = h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status])
        for event in (response, h11.Data(data=body)):
            self.transport.write(self.conn.send(event))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()

    # -- the worker's question

    def client_gone(self) -> bool:
        """True once the client has gone (the worker asks before each step, on its thread).
        A reset or a write that failed is seen by the event loop; an end of stream may be a
        half-close after the request: see :meth:`probe`."""
        cycle = self.cycle
        if self.gone or cycle is None or cycle.disconnected:
            return True
        if not self.eof or cycle.response_started:  # a write fails once the client has gone
            return False
        if self.probed is not cycle:
            self.probed = cycle
            self.loop.call_soon_threadsafe(self.probe)
            return False
        sock = self.transport.get_extra_info("socket")
        try:
            self.gone = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
        except OSError:  # closed here already
            self.gone = True
        if self.gone:
            self.loop.call_soon_threadsafe(self.transport.close)  # its answer goes nowhere
        return self.gone

    def probe(self) -> None:
        """After the client's end of stream: an interim "100 Continue" (RFC 9110 section 15.2:
        a client must skip 1xx responses it did not ask for). A client that closed answers it
        with a reset, which :meth:`client_gone` reads as the socket's error; one that only
        half-closed reads it and gets its answer. Not once the answer has begun, nor to an
        HTTP/1.0 client (no 1xx for them)."""
        if self.cycle is None or self.cycle.response_started or self.transport.is_closing():
            return
        if self.conn.our_state is not h11.SEND_RESPONSE or self.conn.their_http_version != b"1.1":
            return
        self.transport.write(
            self.conn.send(
                h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
            )
        )
