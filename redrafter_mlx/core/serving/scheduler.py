"""Continuous batching for the service's worker: the requests being answered step together
(one request alone is a batch of one, stepped as a single sequence is).

A request joins between batch steps: its prompt is prefilled one chunk per turn of the loop
(a long prompt does not stall the others), from its conversation's cached prefix (the prompt
cache never hands it a session another request is using), and it becomes a
:class:`~redrafter_mlx.core.serving.batch.Member` of the batch. Each turn steps every member once
(:func:`~redrafter_mlx.core.serving.batch.batch_step`: one forward, one host read) and hands each
job its response; a member leaves when its answer ends, its caller cancels or goes, or its
context is full. At most ``max_batch`` requests are joining or answering, and one joins only
while their KV caches hold less than ``max_bytes``; the rest wait in the service's queue
(whose bound still refuses overload). Once the service is ending, each answer ends at its
next step with a last response, and requests still reading their prompts fail with
:class:`Stopping`.

A seeded request keeps its own random key (it draws what it would draw alone); unseeded ones
share MLX's generator. A session whose answers run whole (``Session.whole_answers``: a sharded
lead's, whose other ranks run each answer to its end) is answered to its end even when its
caller leaves or the service ends the answers: the caller is answered no more, the steps go on.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np
from mlx_lm.generate import wired_limit

from redrafter_mlx.core.decode.llm import chain_mask
from redrafter_mlx.core.decode.step import Step
from redrafter_mlx.core.decode.stream import StepResponse, responses
from redrafter_mlx.core.errors import ReDrafterError
from redrafter_mlx.core.serving.batch import Member, batch_step, current_key, fitted, key_value
from redrafter_mlx.core.serving.prompt_cache import session_bytes
from redrafter_mlx.core.serving.session import AnswerSpec, Session


class Stopping(RuntimeError):
    """The service is ending its answers (``GenerationService.end_answers``): no request
    starts any more."""


def stopping() -> Stopping:
    return Stopping("the server is stopping")


def ended(response: StepResponse) -> StepResponse:
    """``response`` as the last of its answer, ended early: finish reason "length", as if its
    token budget ran out there (each API's own last event for a cut answer)."""
    return replace(response, finish_reason="length")


class Feed:
    """The decode steps of one member, as the batch hands them over: an iterator that gives
    what was pushed (raising what was pushed as an error)."""

    def __init__(self):
        self._items: deque = deque()

    def push(self, item: Step | BaseException) -> None:
        self._items.append(item)

    def __iter__(self) -> Iterator[Step]:
        return self

    def __next__(self) -> Step:
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._items.clear()


@dataclass(frozen=True)
class Detached:
    """The job of a whole answer (``Session.whole_answers``) whose caller was answered for
    the last time: the answer runs on to its end, nobody reads it."""

    request: object

    def cancelled(self) -> bool:
        return False

    def put(self, event) -> None:
        pass

    def fail(self, error: BaseException) -> None:
        pass

    def finish(self, outcome: str) -> None:
        pass


@dataclass
class Entry:
    """A request in the batch: its job, prompt ids, session, prefill (until it joins the
    batch), then its member and its responses."""

    job: object
    ids: list[int]
    session: Session
    prefill: Generator
    key: int | None
    fed: int  # prompt tokens fed (the rest came from the cache)
    began: float = field(default_factory=time.perf_counter)
    asked: int = -1  # the loop's turn its job was last asked whether it is cancelled
    member: Member | None = None
    feed: Feed = field(default_factory=Feed)
    responses: Iterator[StepResponse] | None = None


class Scheduler:
    """The service's worker loop with continuous batching (``service``: a
    :class:`~redrafter_mlx.core.serving.service.GenerationService` whose engine is ready)."""

    def __init__(self, service, max_batch: int, max_bytes: int | None = None):
        self.service = service
        self.max_batch = max_batch
        self.max_bytes = max_bytes  # KV bytes the answering requests may hold when one joins
        self.joining: list[Entry] = []
        self.active: list[Entry] = []
        self.closing = False
        self.turn = 0  # turns of the loop so far

    @property
    def entries(self) -> list[Entry]:
        return self.joining + self.active

    def run(self) -> None:
        """Serve until the service closes and the last answer ends."""
        with wired_limit(self.service.engine.decoder.model):
            while not (self.closing and not self.entries):
                self._admit()
                self._prefill_chunk()
                self._step()
                self.turn += 1
                self.service._running = self.entries[0].job if self.entries else None

    # -- joining

    def _admit(self) -> None:
        """Take queued requests while there is room (waiting for one when idle): fewer than
        ``max_batch`` requests joining or answering, whose KV caches hold less than
        ``max_bytes`` (a request alone is always taken)."""
        while not self.closing and len(self.entries) < self.max_batch and not self._full():
            try:
                job = self.service._queue.get(block=not self.entries)
            except queue.Empty:
                return
            if job is None:
                self.closing = True
                return
            self.service._running = job
            entry = self._join(job)
            if entry is not None:
                self.joining.append(entry)

    def _full(self) -> bool:
        """Whether the byte bound keeps requests waiting: the answering ones' caches hold
        ``max_bytes``, or one is still reading its prompt (its size is known once it is in)."""
        if self.max_bytes is None or not self.entries:
            return False
        if self.joining:
            return True
        return sum(session_bytes(e.session) for e in self.active) >= self.max_bytes

    def _join(self, job) -> Entry | None:
        if job.cancelled():  # its caller left while it waited
            job.finish("cancelled")
            return None
        service, request = self.service, job.request
        if service.ending:
            job.fail(stopping())
            return None
        try:
            ids = service.encode(request.prompt)
            busy = [e.session for e in self.entries]
            session = service.prompt_cache.take(ids, busy)
        except Exception as e:  # the request's fault (ReDrafterError) or a bug: say so
            job.fail(e)
            return None
        service.session = session
        decoding = service.engine.decoding_for(request.sampling, request.top_logprobs, len(ids))
        key = request.sampling.seed
        if session.whole_answers:  # the answer's own generator from here: no key to keep
            if key is not None:
                mx.random.seed(key)
            key = None
        answer = AnswerSpec(request.max_tokens, request.stop_strings, decoding)
        try:
            new = session.begin(ids, answer)
        except Exception as e:  # e.g. another rank gone
            job.fail(e)
            return None
        prefill = session.decoder.prefilling(session.sequence, new, decoding)
        return Entry(job, ids, session, prefill, key, len(new), asked=self.turn)

    def _prefill_chunk(self) -> None:
        """Feed one prompt chunk of the first joining request; once its prompt is in, it
        joins the batch with its first emitted token."""
        if not self.joining:
            return
        entry = self.joining[0]
        if entry.asked != self.turn and entry.job.cancelled():  # (asked as it was taken up)
            self._drop(entry, lambda job: job.finish("cancelled"))
            if entry not in self.joining:
                return
        if entry.key is not None:
            mx.random.seed(entry.key)
        try:
            next(entry.prefill)
            return
        except StopIteration as done:
            state, first = done.value
        except ReDrafterError as e:
            return self._fail(entry, e)
        except Exception as e:  # a bug: say so, keep serving from a clean cache
            entry.session.reset()
            return self._fail(entry, e)
        if entry.key is not None:  # the prompt's draws made: the member's own key from here
            entry.key = key_value(np.array(current_key()))
        self._activate(entry, state, first)

    def _activate(self, entry: Entry, state, first: Step | None) -> None:
        self.joining.remove(entry)
        self.active.append(entry)
        entry.member = Member(state, entry.key)
        request = entry.job.request
        entry.responses = responses(
            entry.feed,
            self.service.engine.tokenizer,
            entry.fed,
            max_tokens=request.max_tokens,
            stop_strings=request.stop_strings,
            began=entry.began,
        )
        entry.job.put(self.service.started(entry.ids, request, entry.session))
        if first is not None:
            self._deliver(entry, first)

    # -- stepping

    def _step(self) -> None:
        """One batch step of every answering request still wanted."""
        if self.service.ending:  # the answering ones end with this step's responses
            for entry in list(self.joining):
                self._drop(entry, lambda job: job.fail(stopping()))
        for entry in list(self.active):
            if entry.job.cancelled():  # checked before each step: the next one is not run
                self._drop(entry, lambda job: job.finish("cancelled"))
        if not self.active:
            return
        active = list(self.active)
        try:
            results = batch_step(self.service.engine.decoder, [e.member for e in active])
        except Exception as e:  # a bug: every member's answer fails, the caches are reset
            for entry in active:
                entry.session.reset()
                self._fail(entry, e)
            return
        for entry, result in zip(active, results, strict=True):
            self._deliver(entry, result)

    def _deliver(self, entry: Entry, result: Step | BaseException) -> None:
        """Hand one step (or the error that ended it) to the entry's responses and its job."""
        entry.feed.push(result)
        try:
            response = next(entry.responses)
        except ReDrafterError as e:
            return self._fail(entry, e)
        except Exception as e:
            entry.session.reset()
            return self._fail(entry, e)
        if response.finish_reason is not None:
            entry.job.put(response)
            self._leave(entry, "finished")
        elif self.service.ending:
            entry.job.put(ended(response))
            self._drop(entry, lambda job: job.finish("finished"))
        else:
            entry.job.put(response)

    # -- leaving

    def _fail(self, entry: Entry, error: BaseException) -> None:
        """The answer ended with ``error`` (its fault, e.g. a full context, or a bug)."""
        self._remove(entry, clean=isinstance(error, ReDrafterError))
        entry.job.fail(error)

    def _leave(self, entry: Entry, outcome: str) -> None:
        self._remove(entry)
        entry.job.finish(outcome)

    def _drop(self, entry: Entry, end: Callable) -> None:
        """The caller is answered no more (it left, or the service is ending): ``end`` its
        job; the answer ends too, unless it runs whole (it then goes on to its end)."""
        if not entry.session.whole_answers:
            self._remove(entry)
            end(entry.job)
        elif not isinstance(entry.job, Detached):
            end(entry.job)
            entry.job = Detached(entry.job.request)

    def _remove(self, entry: Entry, clean: bool = True) -> None:
        for group in (self.joining, self.active):
            if entry in group:
                group.remove(entry)
        if entry.responses is not None:
            entry.responses.close()
        entry.prefill.close()
        entry.session.end(clean)
        self.service.prompt_cache.trim()


def warm_up(decoder, decodings=(), max_batch: int = 2) -> None:
    """Trace what batch steps of ``decodings`` run that single steps do not, so that no batch
    stops mid-answer to compile: the joint forward's row counts (the plan's tree sizes it pads
    to, up to its compiled limit; the generic plan verifies exact sizes eagerly), the shapes
    the decodings are fitted to in batches of up to ``max_batch`` (the plan's
    ``batch_rows``)."""
    plan = decoder.plan
    sequence = decoder.new_sequence()
    for size in plan.tree_sizes:
        if 1 < size <= plan.compiled_max_rows:
            tokens, positions = mx.zeros((size,), mx.int32), mx.arange(size)
            mx.eval(decoder.forward(tokens, positions, chain_mask(0, size), sequence))
    decodings = list(decodings)
    if plan.batch_rows is not None:
        fits = {fitted(d, plan.batch_rows // b) for d in decodings for b in range(2, max_batch + 1)}
        for decoding in fits - {None, *decodings}:  # None: a root alone (a one-token forward)
            decoder.warm_up(decoding)
            decodings.append(decoding)


def answer_together(
    decoder,
    tokenizer,
    prompts: list[list[int]],
    decoding,
    *,
    max_tokens: list[int],
    stop_strings: tuple[str, ...] = (),
) -> list[list[StepResponse]]:
    """Each prompt's answer (its responses, one per step), all answered at once: each prompt
    prefilled in turn, then every unfinished answer stepped together
    (:func:`~redrafter_mlx.core.serving.batch.batch_step`) until all have ended."""
    answers: list[list[StepResponse]] = [[] for _ in prompts]
    running: list[tuple[int, Member, Feed, Iterator[StepResponse]]] = []
    for i, (prompt, budget) in enumerate(zip(prompts, max_tokens, strict=True)):
        began, feed = time.perf_counter(), Feed()
        state, first = decoder.prefill(decoder.new_sequence(), prompt, decoding)
        stream = responses(
            feed,
            tokenizer,
            len(prompt),
            max_tokens=budget,
            stop_strings=stop_strings,
            began=began,
        )
        running.append((i, Member(state), feed, stream))
        if first is not None and _answer(answers[i], feed, stream, first):
            running.pop()
    while running:
        results = batch_step(decoder, [member for _, member, _, _ in running])
        running = [
            entry
            for entry, result in zip(running, results, strict=True)
            if not _answer(answers[entry[0]], entry[2], entry[3], result)
        ]
    return answers


def _answer(answer: list, feed: Feed, stream: Iterator[StepResponse], result) -> bool:
    """Hand one step to an answer's responses -> whether the answer has ended."""
    feed.push(result)
    response = next(stream)
    answer.append(response)
    if response.finish_reason is not None:
        stream.close()
        return True
    return False
