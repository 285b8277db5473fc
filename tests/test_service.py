"""core/serving/service.py as the server uses it: one worker thread, requests in arrival order,
each at the shape its temperature picks; closing cancels what still waits; a request's own error or
a failure mid-answer reaches its caller alone and the next request is served from a clean cache;
a burst is admitted up to ``max_batch + queue_size``; ending the answers (a server stopping)
gives each running one its last step and refuses the rest.
(Arrival order, a full queue, clients that leave and the prompt cache through the service are
in test_serve.py.)"""

from __future__ import annotations

import threading

import pytest
from support import decoder_for, toy_tokenizer
from support.serving import reference_tokens, run, tiny_service

from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.errors import ConfigError
from redrafter_mlx.core.serving.service import (
    Engine,
    GenerationService,
    QueueFull,
    Request,
    Sampling,
    Stopping,
)
from redrafter_mlx.core.serving.session import Session

PROMPT = [5, 6, 7, 8, 9]


def test_close_cancels_the_waiting_requests_and_lets_the_running_one_finish(target):
    taken, release = threading.Event(), threading.Event()

    def held() -> bool:  # asked before the job starts: holds the worker until released
        taken.set()
        release.wait(30)
        return False

    service = tiny_service(target, queue_size=4)
    running = service.submit(Request(PROMPT, max_tokens=6), held)
    assert taken.wait(30)  # the worker has the job: close() must not find it queued
    waiting = [service.submit(Request([40 + i, 41], max_tokens=6)) for i in range(2)]
    closing = threading.Thread(target=service.close)
    closing.start()
    assert [job.start(timeout=30) for job in waiting] == [None, None]  # cancelled, never run
    release.set()
    closing.join(30)
    assert not closing.is_alive() and not service.alive
    assert run(running) == (reference_tokens(target, PROMPT, 6), "length")
    assert running.outcome == "finished"


def test_a_prompt_that_cannot_be_encoded_fails_alone(target):
    def encode(prompt):
        if isinstance(prompt, str):
            raise KeyError("no chat template")
        return list(prompt)

    def setup() -> Engine:
        shape = BeamShape(2, 3)
        return Engine(
            decoder_for(target), toy_tokenizer(), encode, Mode.AUTOREGRESSIVE, shape, shape
        )

    service = GenerationService(setup)
    service.start()
    for prompt, message in (("hello", "cannot be encoded: 'no chat template'"), ([], "no tokens")):
        job = service.submit(Request(prompt, max_tokens=4))
        with pytest.raises(ConfigError, match=message):
            job.start(timeout=30)
        assert job.outcome == "failed"
    assert run(service.submit(Request(PROMPT, max_tokens=4)))[0] == reference_tokens(
        target, PROMPT, 4
    )
    service.close()


def test_a_failure_mid_answer_reaches_its_caller_and_the_next_starts_from_a_clean_cache(target):
    """An error that is not the request's own (here a stop string that is no string) is raised
    to the caller; the cache it may have left half-written is not reused."""
    service = tiny_service(target)
    run(service.submit(Request(PROMPT, max_tokens=4)))
    broken = service.submit(Request(PROMPT + [10], max_tokens=4, stop_strings=(5,)))
    with pytest.raises(TypeError):  # at its first step (its prompt is in: it has started)
        run(broken, timeout=30)
    assert broken.outcome == "failed"
    job = service.submit(Request(PROMPT + [10], max_tokens=4))
    assert job.start(timeout=30).cached_tokens == 0
    assert [t for s in job.steps() for t in s.tokens] == reference_tokens(target, PROMPT + [10], 4)
    service.close()


def test_each_request_runs_at_the_shape_its_temperature_picks_and_a_seed_repeats_it(
    target, drafter
):
    greedy_shape, sampling_shape = BeamShape(2, 3), BeamShape(1, 4)
    beams = BeamDrafter(drafter, target.model.embed_tokens)

    def setup() -> Engine:
        decoder = decoder_for(target, beams)
        return Engine(decoder, toy_tokenizer(), list, Mode.REDRAFTER, greedy_shape, sampling_shape)

    service = GenerationService(setup)
    service.start()
    job = service.submit(Request(PROMPT, max_tokens=8))
    started = job.start(timeout=30)
    assert (started.shape, started.mode) == (greedy_shape, Mode.REDRAFTER)
    assert [t for s in job.steps() for t in s.tokens] == reference_tokens(target, PROMPT, 8)
    drawn = []
    for _ in range(2):
        job = service.submit(Request(PROMPT, max_tokens=8, sampling=Sampling(1.0, seed=7)))
        assert job.start(timeout=30).shape == sampling_shape
        drawn.append([t for s in job.steps() for t in s.tokens])
    assert drawn[0] == drawn[1] != reference_tokens(target, PROMPT, 8)
    service.close()


@pytest.mark.parametrize(
    "bounds,message",
    [
        ({"queue_size": 0}, "queue size 0"),
        ({"prompt_cache_size": 0}, "prompt cache size 0"),
        ({"prompt_cache_bytes": -1}, "prompt cache bytes -1"),
        ({"max_batch": 0}, "max batch 0"),
        ({"max_batch_bytes": -1}, "max batch bytes -1"),
    ],
)
def test_bad_bounds_are_refused_on_the_callers_thread_before_any_setup(bounds, message):
    built = []
    with pytest.raises(ValueError, match=message):
        GenerationService(lambda: built.append(1), **bounds)
    assert built == []


class Bands:
    """Prompt-length bands as the service reads them: ``shape`` below ``plain_from`` tokens,
    plain decoding from there (what serve builds from a profile or the plan's default)."""

    def __init__(self, shape: BeamShape, plain_from: int):
        self.shape, self.plain_from = shape, plain_from
        self.starts = (0, plain_from)

    def at(self, context: int) -> BeamShape | None:
        return self.shape if context < self.plain_from else None


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_prompt_past_its_band_decodes_plainly_and_says_so(target, drafter, max_batch):
    shape = BeamShape(2, 3)
    beams = BeamDrafter(drafter, target.model.embed_tokens)

    def setup() -> Engine:
        bands = {False: Bands(shape, 8)}
        return Engine(
            decoder_for(target, beams), toy_tokenizer(), list, Mode.REDRAFTER, shape, shape, bands
        )

    service = GenerationService(setup, max_batch=max_batch)
    service.start()
    for prompt, want in (
        (PROMPT, (shape, Mode.REDRAFTER)),
        (PROMPT * 2, (None, Mode.AUTOREGRESSIVE)),
    ):
        job = service.submit(Request(prompt, max_tokens=8))
        started = job.start(timeout=60)
        steps = list(job.steps(timeout=60))
        assert (started.shape, started.mode) == want
        assert [t for s in steps for t in s.tokens] == reference_tokens(target, prompt, 8)
        # plain decoding verifies one token per step, this shape a tree of several
        assert (max(steps[-1].stats.tree_sizes) == 1) == (want[0] is None)
    sampled = service.submit(Request(PROMPT * 2, max_tokens=4, sampling=Sampling(1.0, seed=3)))
    assert sampled.start(timeout=60).shape == shape  # no bands for sampled requests here
    list(sampled.steps(timeout=60))
    service.close()


def holding():
    """A ``client_gone`` that holds the worker once ``hold`` is set, until ``release``."""
    hold, held, release = threading.Event(), threading.Event(), threading.Event()

    def client_gone() -> bool:
        if hold.is_set():
            held.set()
            release.wait(30)
        return False

    return client_gone, hold, held, release


@pytest.mark.parametrize("max_batch", [1, 8])
def test_a_burst_gets_max_batch_plus_queue_size_places_whatever_the_batch_picked_up(
    target, max_batch
):
    """24 requests at once against max batch 8 and queue size 16 are all taken, the 25th is
    refused: the places the batch has not picked up yet are not counted as waiting (the
    worker is held while the burst arrives, as it is mid-step in a real burst)."""
    client_gone, hold, held, release = holding()
    hold.set()
    service = tiny_service(target, max_batch=max_batch, queue_size=16)
    try:
        first = service.submit(Request(PROMPT, max_tokens=3), client_gone)
        assert held.wait(30)
        jobs = [first]
        jobs += [service.submit(Request([20 + i, 21], max_tokens=3)) for i in range(max_batch + 15)]
        with pytest.raises(QueueFull, match="16 requests are already waiting"):
            service.submit(Request(PROMPT, max_tokens=3))
        hold.clear()
        release.set()
        assert all(len(run(job)[0]) == 3 for job in jobs)
        again = [service.submit(Request(PROMPT, max_tokens=3)) for _ in range(max_batch + 16)]
        assert all(len(run(job)[0]) == 3 for job in again)  # every place was given back
    finally:
        release.set()
        service.close()


@pytest.mark.parametrize("max_batch", [1, 2])
def test_ending_answers_gives_each_running_one_its_last_step_and_refuses_the_rest(
    target, max_batch
):
    client_gone, hold, held, release = holding()
    service = tiny_service(target, max_batch=max_batch)
    try:
        running = [
            service.submit(Request(PROMPT, max_tokens=1000), client_gone) for _ in range(max_batch)
        ]
        for job in running:
            job.start(timeout=30)
        waiting = service.submit(Request(PROMPT + [10], max_tokens=4))
        hold.set()
        assert held.wait(30)  # mid-answer
        service.end_answers()
        with pytest.raises(Stopping):
            service.submit(Request(PROMPT, max_tokens=4))
        release.set()
        with pytest.raises(Stopping):
            waiting.start(timeout=30)
        for job in running:
            steps = list(job.steps(timeout=30))
            tokens = [t for s in steps for t in s.tokens]
            assert steps[-1].finish_reason == "length" and 0 < len(tokens) < 1000
            assert tokens == reference_tokens(target, PROMPT, len(tokens))
            assert job.outcome == "finished"
    finally:
        release.set()
        service.close()


class WholeSession(Session):
    """A session whose answers run whole (as a sharded lead's: its other ranks run each answer
    to its end), recording each answer's begin and end."""

    whole_answers = True
    log: list = []

    def begin(self, ids, answer):
        self.log.append(("begin", len(ids)))
        return super().begin(ids, answer)

    def end(self, clean: bool) -> None:
        self.log.append(("end", clean, self.sequence.offset))


def test_an_answer_that_runs_whole_goes_on_to_its_end_after_its_caller_leaves(target):
    """A whole answer (a sharded lead's) whose caller leaves after its first step is answered no
    more, yet runs on to its token budget, as the other ranks run it, before the next request
    (one at a time) begins; every answer begun is ended once."""

    class WholeEngine(Engine):
        def new_session(self) -> Session:
            decoding = self.decoding_for(Sampling())
            return WholeSession(self.decoder, self.tokenizer, decoding, warm=False)

    def setup() -> Engine:
        shape = BeamShape(2, 3)
        tokenizer = toy_tokenizer()
        return WholeEngine(decoder_for(target), tokenizer, list, Mode.AUTOREGRESSIVE, shape, shape)

    WholeSession.log = []
    service = GenerationService(setup)
    service.start()
    try:
        run(service.submit(Request(PROMPT, max_tokens=12)))
        gone = threading.Event()
        job = service.submit(Request(PROMPT, max_tokens=12), client_gone=gone.is_set)
        job.start(timeout=30)
        steps = job.steps(timeout=30)
        next(steps)
        gone.set()
        assert len(list(steps)) < 11 and job.outcome == "cancelled"
        tokens, _ = run(service.submit(Request(PROMPT + [3], max_tokens=4)))
        assert tokens == reference_tokens(target, PROMPT + [3], 4)
    finally:
        service.close()
    whole = WholeSession.log[1]
    assert WholeSession.log[:4] == [("begin", 5), whole, ("begin", 5), whole]
    assert whole == ("end", True, len(PROMPT) + 12) and WholeSession.log[4][0] == "begin"
    assert WholeSession.log[5][:2] == ("end", True)
