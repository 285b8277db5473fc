"""Generation for many callers: a worker thread that owns the model and answers up to
``max_batch`` requests together (:mod:`~redrafter_mlx.core.serving.scheduler`; one alone is a
batch of one, stepped as a single sequence is), a bounded
queue of requests in arrival order, and a :class:`PromptCache` of sessions (one KV cache per
conversation, least recently used dropped first) so that a request extending any of the
conversations held (a client resending its history plus a new message) reuses its cache.

A caller ``submit``s a :class:`Request` and reads its :class:`Job`: :meth:`Job.start` gives the
prompt's token counts (or raises what was wrong with it), :meth:`Job.steps` one
:class:`StepResponse` per decode step, the last with a finish reason. A job whose caller has
gone (its ``client_gone`` says so, or :meth:`Job.cancel` was called) stops before its next step
or prompt chunk.

Everything MLX does runs on the worker thread, loading and warm-up included (``setup``): MLX
streams belong to the thread that made them (mlx >= 0.31.2), so a graph built on one thread
must not be evaluated on another. Library code: nothing printed; errors reach the caller
through its job. Nothing here knows of HTTP.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from redrafter_mlx.core.decode.accept import is_greedy, make_sampler
from redrafter_mlx.core.decode.decoder import Decoder
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.step import Decoding
from redrafter_mlx.core.decode.stream import StepResponse
from redrafter_mlx.core.errors import ConfigError, ContextFull, ReDrafterError
from redrafter_mlx.core.serving.distributed import LeadDecoder, session_for
from redrafter_mlx.core.serving.prompt_cache import PromptCache, check_bounds
from redrafter_mlx.core.serving.scheduler import Scheduler, stopping
from redrafter_mlx.core.serving.scheduler import Stopping as Stopping  # the server catches it
from redrafter_mlx.core.serving.scheduler import warm_up as warm_up_batches
from redrafter_mlx.core.serving.session import Session


@dataclass(frozen=True)
class Chat:
    """A chat prompt with more than its messages: the ``tools`` the chat template shows the
    model (OpenAI's function format; None: none), and ``answer_prefix``, text the answer
    starts with after the template's generation prompt (a tool call's opening tag makes the
    model call a tool), and ``thinking``, the template's reasoning switch (None: its
    default)."""

    messages: list[dict]
    tools: list[dict] | None = None
    answer_prefix: str = ""
    thinking: bool | None = None


Prompt = list[dict] | Chat | str | list[int]  # chat messages, raw text or token ids


@dataclass(frozen=True)
class Sampling:
    """One request's sampler: temperature 0 (or below accept.GREEDY_BELOW) is greedy; top-p 0 or
    1 and top-k 0 are off."""

    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int | None = None  # re-seeds MLX's generator before this request


@dataclass(frozen=True)
class Request:
    prompt: Prompt
    max_tokens: int = 256
    sampling: Sampling = Sampling()
    stop_strings: tuple[str, ...] = ()
    # each token's log-prob and the k most likely tokens' (k this, up to 0; None: off)
    top_logprobs: int | None = None


@dataclass
class Engine:
    """What the worker generates with (built on its thread by the service's ``setup``): the
    decoder, its tokenizer, ``encode`` (a :data:`Prompt` -> token ids), the decoding mode and
    the beam shape for greedy and for sampled requests; ``bands``, where no flag chose a shape,
    the shape per prompt length for greedy (False) and sampled (True) requests (each with
    ``at(tokens) -> BeamShape | None``, None: plain decoding there, and ``starts``)."""

    decoder: Decoder
    tokenizer: object
    encode: Callable[[Prompt], list[int]]
    mode: Mode
    greedy_shape: BeamShape
    sampling_shape: BeamShape
    bands: dict = field(default_factory=dict)

    def shape_for(self, sampling: Sampling, context: int = 0) -> BeamShape | None:
        """The shape a request with a ``context``-token prompt runs at (None: autoregressive)."""
        if not self.mode.speculative:
            return None
        bands = self.bands.get(self.samples(sampling))
        return self._shape(sampling) if bands is None else bands.at(context)

    @staticmethod
    def samples(sampling: Sampling) -> bool:
        """Whether a request at ``sampling`` samples: it then runs the sampling shape."""
        return not is_greedy(sampling.temp)

    def _shape(self, sampling: Sampling) -> BeamShape:
        return self.sampling_shape if self.samples(sampling) else self.greedy_shape

    def decoding_for(
        self, sampling: Sampling, top_logprobs: int | None = None, context: int = 0
    ) -> Decoding:
        """A request's decoding after a ``context``-token prompt: the mode, its shape, its
        sampler, the log-probs it reports."""
        shape = self.shape_for(sampling, context)
        mode = self.mode if shape is not None else Mode.AUTOREGRESSIVE
        sampler = make_sampler(sampling.temp, top_p=sampling.top_p, top_k=sampling.top_k)
        return Decoding(mode, shape or self._shape(sampling), sampler, top_logprobs=top_logprobs)

    def decodings(self) -> list[Decoding]:
        """What requests will run: the greedy decoding and the sampling one (a sampler at
        temperature 1) at each prompt-length band's start."""
        decodings = []
        for sampling in (Sampling(1.0), Sampling()):
            bands = self.bands.get(self.samples(sampling))
            for start in (0,) if bands is None else bands.starts:
                decodings.append(self.decoding_for(sampling, context=start))
        return decodings

    def warm_up(self) -> None:
        """Compile what requests will run (:meth:`decodings`), so that answers do not stop to
        compile (a request at another temperature may still compile its sampler once)."""
        for decoding in self.decodings():
            self.decoder.warm_up(decoding)

    def new_session(self) -> Session:
        """A conversation's session (each request brings its own decoding)."""
        # a sharded target's lead mirrors its sessions on the other ranks
        return session_for(self.decoder, self.tokenizer, self.decoding_for(Sampling()), warm=False)


@dataclass(frozen=True)
class Started:
    """A request the worker took up: its prompt's size and how much of it the cache held."""

    prompt_tokens: int  # tokens of the whole prompt
    cached_tokens: int  # of them, already in the KV cache (not fed again)
    shape: BeamShape | None  # the beam shape it runs at; None: autoregressive
    mode: Mode = Mode.AUTOREGRESSIVE


class QueueFull(RuntimeError):
    """Every place in the queue is taken: the caller should come back later."""


_END = object()  # a job's last event when it stops without a last step (cancelled)


class Job:
    """One submitted request, as its caller sees it. The worker puts events on it; the caller
    reads them with :meth:`start` then :meth:`steps`."""

    def __init__(
        self,
        request: Request,
        client_gone: Callable[[], bool] | None = None,
        on_end: Callable[[], None] | None = None,
    ):
        self.request = request
        self.outcome: str | None = None  # "finished", "cancelled" or "failed", when done
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._client_gone = client_gone or (lambda: False)
        self._on_end = on_end  # called once, when the job ends (its place is free again)

    def cancel(self) -> None:
        """Stop before the next step (or never start, if still queued)."""
        self._cancelled.set()

    def cancelled(self) -> bool:
        if not self._cancelled.is_set() and self._client_gone():
            self._cancelled.set()
        return self._cancelled.is_set()

    def start(self, timeout: float | None = None) -> Started | None:
        """Wait until the worker takes the job up: its :class:`Started`, or None when it was
        cancelled first. Raises what the worker found wrong (ConfigError, ContextFull: the
        request's fault; anything else: a bug), or ``queue.Empty`` after ``timeout`` seconds."""
        event = self._next(timeout)
        return None if event is _END else event

    def steps(self, timeout: float | None = None) -> Iterator[StepResponse]:
        """The decode steps after :meth:`start`, until one with a finish reason (or until a
        cancelled job stops); ``timeout``: the longest wait for each."""
        while (event := self._next(timeout)) is not _END:
            yield event
            if event.finish_reason is not None:
                return

    def _next(self, timeout: float | None):
        event = self._events.get(timeout=timeout)
        if isinstance(event, BaseException):
            raise event
        return event

    def _put(self, event) -> None:
        self._events.put(event)

    # the worker's side

    def put(self, event) -> None:
        """Hand the caller an event (:class:`Started`, a :class:`StepResponse`)."""
        self._put(event)

    def fail(self, error: BaseException) -> None:
        """End the job with ``error`` (raised to its caller)."""
        self._end("failed", error)

    def finish(self, outcome: str) -> None:
        """End the job: "finished" (its last response was put) or "cancelled"."""
        self._end(outcome, _END if outcome == "cancelled" else None)

    def _end(self, outcome: str, event) -> None:
        self.outcome = outcome
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()
        if event is not None:
            self._put(event)


class GenerationService:
    """Serves :class:`Request`\\ s in arrival order on one worker thread, up to ``max_batch``
    at once, stepped together (:mod:`~redrafter_mlx.core.serving.scheduler`: continuous
    batching; ``max_batch`` 1: one at a time, a batch of one), a request joining only
    while the answering ones' KV caches hold less than ``max_batch_bytes`` (None: no bound).

    ``setup`` builds the :class:`Engine` on the worker (load the model there); it takes
    ``max_batch + queue_size`` requests not yet ended (answered or waiting, however many the
    batch has picked up so far), more raise :class:`QueueFull`; the KV caches of at most
    ``prompt_cache_size`` conversations (and ``prompt_cache_bytes``) are kept between requests
    (more while more are answered at once). A sharded target's lead answers one request at a
    time: ``max_batch`` is then 1 once started.
    """

    def __init__(
        self,
        setup: Callable[[], Engine],
        *,
        queue_size: int = 8,
        prompt_cache_size: int = 4,
        prompt_cache_bytes: int | None = None,
        max_batch: int = 1,
        max_batch_bytes: int | None = None,
    ):
        if queue_size < 1:
            raise ValueError(f"queue size {queue_size}: need at least 1")
        if max_batch < 1:
            raise ValueError(f"max batch {max_batch}: need at least 1")
        if max_batch_bytes is not None and max_batch_bytes < 0:
            raise ValueError(f"max batch bytes {max_batch_bytes}: need at least 0")
        self.max_batch, self.max_batch_bytes = max_batch, max_batch_bytes
        self._cache_bounds = {"max_sessions": prompt_cache_size, "max_bytes": prompt_cache_bytes}
        check_bounds(prompt_cache_size, prompt_cache_bytes)  # here, not on the worker
        self._setup = setup
        self.queue_size = queue_size
        self._queue: queue.Queue = queue.Queue()  # bounded by submit's count of jobs not ended
        self._taken = 0  # jobs submitted and not ended
        self._lock = threading.Lock()
        self._ending = threading.Event()
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="redrafter-worker", daemon=True)
        self._running: Job | None = None
        self.engine: Engine | None = None
        self.prompt_cache: PromptCache | None = None  # the worker's conversations
        self.session: Session | None = None  # the last request's (its conversation's cache)

    # -- the caller's side

    def start(self) -> Engine:
        """Start the worker, build and warm up the engine there; return it once ready, or
        raise what ``setup`` raised."""
        self._thread.start()
        self._ready.wait()
        if self._setup_error is not None:
            raise self._setup_error
        return self.engine

    def submit(self, request: Request, client_gone: Callable[[], bool] | None = None) -> Job:
        """Queue ``request``; QueueFull when ``max_batch`` requests are answered and
        ``queue_size`` already wait (counted from here: a burst is not refused because the
        batch has not picked its first requests up yet); Stopping after :meth:`end_answers`."""
        with self._lock:
            if self._ending.is_set():
                raise stopping()
            if self._taken >= self.max_batch + self.queue_size:
                raise QueueFull(
                    f"{self.queue_size} requests are already waiting and {self.max_batch} "
                    "being answered"
                )
            self._taken += 1
        job = Job(request, client_gone, on_end=self._release)
        self._queue.put(job)
        return job

    def _release(self) -> None:
        with self._lock:
            self._taken -= 1

    def end_answers(self) -> None:
        """Stop: no request starts any more (those waiting, and those submitted from now on,
        get :class:`Stopping`), and each answer running ends at its next step with a last
        response (:func:`ended`). The worker goes on until :meth:`close`."""
        self._ending.set()
        for job in self._drain():
            job.fail(stopping())

    def close(self) -> None:
        """Stop the worker once the running request ends; requests still queued are cancelled."""
        for job in self._drain():
            job.cancel()
            job.finish("cancelled")
        self._queue.put(None)
        self._thread.join()

    def _drain(self) -> list[Job]:
        """Take every job still queued (not the worker's stop)."""
        jobs = []
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return jobs
            if job is None:  # close() came first: leave it for the worker
                self._queue.put(None)
                return jobs
            jobs.append(job)

    @property
    def ending(self) -> bool:
        """Whether :meth:`end_answers` was called."""
        return self._ending.is_set()

    @property
    def waiting(self) -> int:
        """Requests queued, not yet taken up by the worker."""
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._ready.is_set() and self._setup_error is None

    # -- the worker's side

    def _run(self) -> None:
        try:
            self.engine = self._setup()
            if isinstance(self.engine.decoder, LeadDecoder):
                # the other ranks mirror one session's answer at a time (a batch of one: the
                # single-sequence step; no batch warm-up, which they would never join)
                self.max_batch = 1
            self.engine.warm_up()
            if self.max_batch > 1:
                warm_up_batches(self.engine.decoder, self.engine.decodings(), self.max_batch)
            self.prompt_cache = PromptCache(self.engine.new_session, **self._cache_bounds)
        except BaseException as e:  # reported by start(), on the caller's thread
            self._setup_error = e
            return
        finally:
            self._ready.set()
        Scheduler(self, self.max_batch, self.max_batch_bytes).run()

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt``; ConfigError when it is empty, cannot be templated, or
        leaves no room in the context for a new token."""
        try:
            ids = list(self.engine.encode(prompt))
        except ReDrafterError:
            raise
        except Exception as e:  # e.g. a chat template that refuses a role
            raise ConfigError(f"the prompt cannot be encoded: {e}") from None
        if not ids:
            raise ConfigError("the prompt encodes to no tokens")
        decoder = self.engine.decoder
        if not decoder.prompt_fits(len(ids)):
            raise ContextFull(
                f"the prompt is {len(ids)} tokens; the model's context is {decoder.max_context} "
                "(with room for at least one new token)"
            )
        return ids

    def started(self, ids: list[int], request: Request, session: Session) -> Started:
        """What a job's caller learns when its prompt is in ``session``'s cache."""
        shape = self.engine.shape_for(request.sampling, len(ids))
        mode = self.engine.mode if shape is not None else Mode.AUTOREGRESSIVE
        return Started(len(ids), session.reused, shape, mode)
