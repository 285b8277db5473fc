"""Batched decode steps (core/serving/batch.py, core/decode/joint.py) and the batching service
(core/serving/scheduler.py): every sequence's answer is the one it gets alone."""

from __future__ import annotations

import threading

import pytest
from support import decoder_for, decoding_of
from support.batching import alone, batched
from support.families import HYBRIDS, build
from support.serving import run, tiny_service

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.errors import ContextFull
from redrafter_mlx.core.serving import batch
from redrafter_mlx.core.serving.service import Request, Sampling

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [3, 3, 3]]
LONG = [[10, 11, 11], [14, 39, 3]]  # the tiny target's greedy answers: 300 tokens, no EOS


def mixed_decodings(beams):
    """A drafted tree, an autoregressive chain, drafted + lookup beams, lookup alone."""
    return [
        decoding_of(beams, BeamShape(2, 3)),
        decoding_of(None, BeamShape(1, 2), autoregressive=True),
        decoding_of(beams, BeamShape(1, 2, lookup=1)),
        decoding_of(None, BeamShape(1, 3, lookup=2)),
    ]


def same_shape_decodings(beams):
    """Three drafted trees of one shape (their searches run as one) and a chain."""
    drafted = decoding_of(beams, BeamShape(2, 3))
    return [drafted, drafted, decoding_of(None, BeamShape(1, 2), autoregressive=True), drafted]


@pytest.mark.parametrize("plan", [CPU_PLAN, GENERIC_PLAN], ids=["cpu", "generic"])
@pytest.mark.parametrize("make", [mixed_decodings, same_shape_decodings], ids=["mixed", "same"])
def test_a_batch_of_mixed_modes_answers_each_as_alone_with_one_read_per_step(
    target, drafter, plan, make, monkeypatch
):
    beams = BeamDrafter(drafter, target.model.embed_tokens)
    decoder = decoder_for(target, beams, plan)
    decodings = make(beams)
    expected = [alone(decoder, d, p, 24) for d, p in zip(decodings, PROMPTS, strict=True)]
    reads = []
    real = batch.host_read
    monkeypatch.setattr(batch, "host_read", lambda *a, **k: reads.append(1) or real(*a, **k))
    answers, results = batched(decoder, decodings, PROMPTS, 24)
    assert answers == expected
    assert len(reads) == len(results)  # one host read per batch step, whatever B
    assert all(step.syncs == 1 for steps in results for step in steps)


@pytest.mark.parametrize(
    ("shape", "rows", "fit"),
    [
        (BeamShape(1, 2, lookup=1), 8, BeamShape(1, 2, lookup=1)),  # fits: unchanged
        (BeamShape(1, 2, lookup=1), 2, BeamShape(1, 2)),  # lookup beams go first
        (BeamShape(2, 3, lookup=1), 5, BeamShape(2, 3)),
        (BeamShape(2, 3, lookup=1), 4, BeamShape(1, 3)),  # then drafted beams
        (BeamShape(2, 4, lookup=1), 3, BeamShape(1, 3)),  # then their length
        (BeamShape(1, 3, lookup=2), 5, BeamShape(1, 3, lookup=1)),
    ],
)
def test_a_tree_is_fitted_to_its_rows_by_lookup_width_then_length(
    target, drafter, shape, rows, fit
):
    beams = BeamDrafter(drafter, target.model.embed_tokens)
    decoding = decoding_of(beams, shape)
    assert batch.fitted(decoding, rows) == decoding_of(beams, fit)


def test_a_tree_with_no_room_but_its_root_steps_plainly(target, drafter):
    beams = BeamDrafter(drafter, target.model.embed_tokens)
    for decoding in (
        decoding_of(beams, BeamShape(1, 2)),
        decoding_of(None, BeamShape(1, 3, lookup=2)),
    ):
        assert batch.fitted(decoding, 1) is None  # its root alone: no tree decoding at all
    chain = decoding_of(None, BeamShape(1, 2), autoregressive=True)
    assert batch.fitted(chain, 1) is chain


@pytest.mark.parametrize(
    "shape", [BeamShape(2, 4, lookup=2), BeamShape(1, 3, lookup=1), BeamShape(1, 3, lookup=2)]
)
@pytest.mark.parametrize("drafted", [True, False], ids=["drafted", "lookup"])
def test_every_fit_is_a_decoding_the_decoder_runs(target, drafter, shape, drafted):
    """A fit is a decision the decoder accepts (lookup alone fitted to no lookup beam used to
    be a decoding ``Decoder.check`` refuses): a tree it checks, or None, the root alone."""
    beams = BeamDrafter(drafter, target.model.embed_tokens) if drafted else None
    decoder = decoder_for(target, beams, GENERIC_PLAN)
    decoding = decoding_of(beams, shape)
    fits = [batch.fitted(decoding, rows) for rows in range(1, 16)]
    assert None in fits and decoding in fits
    for fit in fits:
        if fit is not None:
            decoder.check(fit)


def test_a_bounded_batch_shares_its_rows_and_a_member_alone_gets_its_tree_back(target, drafter):
    """On a plan bounding a batch to 4 rows: two members verify at most 2 nodes each (their
    answers still the ones they get alone), a seeded one keeps its tree, and the member left
    alone verifies its own shape's trees again."""
    import dataclasses

    import numpy as np

    beams = BeamDrafter(drafter, target.model.embed_tokens)
    plan = dataclasses.replace(GENERIC_PLAN, batch_rows=4)
    decoder = decoder_for(target, beams, plan)
    decoding = decoding_of(beams, BeamShape(1, 3, lookup=1))  # up to 5 nodes
    expected = [alone(decoder, decoding, p, 20) for p in PROMPTS[:2]]
    answers, results = batched(decoder, [decoding] * 2, PROMPTS[:2], 20)
    assert answers == expected
    assert max(s.tree_size for steps in results for s in steps) <= 2
    members = [
        batch.Member(decoder.prefill(decoder.new_sequence(), p, decoding)[0]) for p in PROMPTS[2:]
    ]
    members[1].key = batch.key_value(np.array(batch.current_key()))
    sizes = [[], []]
    for _ in range(8):
        for size, step in zip(sizes, batch.batch_step(decoder, members), strict=True):
            size.append(step.tree_size)
    assert max(sizes[0]) <= 2 < max(sizes[1])  # the seeded member's trees are its own
    alone_sizes = [batch.batch_step(decoder, members[:1])[0].tree_size for _ in range(8)]
    assert max(alone_sizes) > 2
    assert members[0].state.decoding == decoding


@pytest.mark.parametrize("plan", [CPU_PLAN, GENERIC_PLAN], ids=["cpu", "generic"])
def test_members_fitted_to_their_root_alone_step_as_one_token_then_draft_again(
    target, drafter, plan, monkeypatch
):
    """Three tree members on 2 rows are fitted to their roots alone: each is fed as one
    unmasked token (no tree is packed, nothing drafted), its answer still the one it gets
    alone, and a member left alone verifies and drafts its own trees again."""
    import dataclasses

    from redrafter_mlx.core.decode import speculative

    beams = BeamDrafter(drafter, target.model.embed_tokens)
    decoder = decoder_for(target, beams, dataclasses.replace(plan, batch_rows=2))
    decoding = decoding_of(beams, BeamShape(1, 3, lookup=1))
    expected = [alone(decoder, decoding, p, 40) for p in PROMPTS[:3]]
    trees, drafts = [], []
    for name, calls in (("plan_tree", trees), ("draft", drafts)):
        real = getattr(speculative, name)
        monkeypatch.setattr(speculative, name, lambda *a, f=real, c=calls: c.append(1) or f(*a))
    members, answers = [], []
    for prompt in PROMPTS[:3]:
        state, first = decoder.prefill(decoder.new_sequence(), prompt, decoding)
        members.append(batch.Member(state))
        answers.append(list(first.tokens))
    searched = len(drafts)
    for _ in range(10):
        for answer, step in zip(answers, batch.batch_step(decoder, members), strict=True):
            assert step.tree_size == 1
            answer += step.tokens
        for member in members:  # the fit is recorded on the member, its state still runs
            assert member.root_alone and member.decoding == decoding
            decoder.check(member.state.decoding)
    assert not trees and len(drafts) == searched
    for _ in range(6):
        (step,) = batch.batch_step(decoder, members[:1])
        answers[0] += step.tokens
    assert trees and len(drafts) > searched  # alone: its own trees again
    assert not members[0].root_alone and members[0].state.decoding == decoding
    for answer, full in zip(answers, expected, strict=True):
        assert answer == full[: len(answer)]


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text"])
def test_hybrid_and_windowed_members_fitted_to_their_root_alone_answer_as_alone(family):
    """A root fed as one token stages a recurrent layer's state as a chain's token does, and
    sees a sliding window's keys as a one-token step does."""
    import dataclasses

    model = build(family)
    decoder = decoder_for(model, None, dataclasses.replace(GENERIC_PLAN, batch_rows=2))
    decoding = decoding_of(None, BeamShape(1, 3, lookup=2))
    prompts = [[3, 14, 15, 9, 26, 5, 35, 3, 14, 15], [1, 2, 3], [4, 5, 6, 4, 5, 6, 4]]
    expected = [alone(decoder, decoding, p, 12) for p in prompts]
    answers, results = batched(decoder, [decoding] * 3, prompts, 12)
    assert answers == expected
    assert all(s.tree_size == 1 for steps in results for s in steps)


def test_warm_up_traces_the_shapes_a_bounded_batch_fits_trees_to(target, drafter, monkeypatch):
    """A W2 L3 tree (up to 5 nodes) in a batch of 2 with 4 rows is fitted to W1 L2: the
    service's warm-up traces that search before an answer needs it (MLX would compile it
    mid-answer: seconds of g++ on a CPU)."""
    import dataclasses

    import mlx.core as mx

    from redrafter_mlx.core.serving.scheduler import warm_up

    beams = BeamDrafter(drafter, target.model.embed_tokens)
    plan = dataclasses.replace(GENERIC_PLAN, batch_rows=4)
    decoder = decoder_for(target, beams, plan)
    decoding = decoding_of(beams, BeamShape(2, 3))
    assert batch.fitted(decoding, 2) == decoding_of(beams, BeamShape(1, 2))
    decoder.warm_up(decoding)
    warm_up(decoder, [decoding], max_batch=2)
    members = [
        batch.Member(decoder.prefill(decoder.new_sequence(), p, decoding)[0]) for p in PROMPTS[:2]
    ]
    compiled = []
    real = mx.compile
    monkeypatch.setattr(mx, "compile", lambda *a, **k: compiled.append(a) or real(*a, **k))
    for _ in range(3):
        assert max(s.tree_size for s in batch.batch_step(decoder, members)) <= 2
    assert not compiled


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_hybrid_members_run_their_recurrent_layers_as_one_batch_exactly(family, monkeypatch):
    """Each recurrent layer runs the members' trees (and a chain's token) depth by depth as
    one batch: every answer is the one it gets alone, and no member's layer runs alone."""
    from redrafter_mlx.core.decode import joint

    model = build(family)
    decoder = decoder_for(model)
    decodings = [
        decoding_of(None, BeamShape(1, 3, lookup=2)),
        decoding_of(None, BeamShape(1, 2), autoregressive=True),
        decoding_of(None, BeamShape(1, 4, lookup=2)),
    ]
    prompts = [[3, 14, 15, 9, 26, 5, 35, 3, 14, 15], [1, 2, 3], [4, 5, 6, 4, 5, 6, 4]]
    expected = [alone(decoder, d, p, 12) for d, p in zip(decodings, prompts, strict=True)]
    runs = {"_alone": [], "_by_depth": []}
    for name, calls in runs.items():
        real = getattr(joint.JointStateSlot, name)
        monkeypatch.setattr(
            joint.JointStateSlot, name, lambda *a, f=real, c=calls: c.append(1) or f(*a)
        )
    assert batched(decoder, decodings, prompts, 12)[0] == expected
    assert runs["_by_depth"] and not runs["_alone"]


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5"])
def test_sliding_window_and_hybrid_targets_batch_exactly(family):
    model = build(family)
    decoder = decoder_for(model)
    decodings = [
        decoding_of(None, BeamShape(1, 3, lookup=2)),
        decoding_of(None, BeamShape(1, 2), autoregressive=True),
    ] * 2
    prompts = [[3, 14, 15, 9, 26, 5, 35], [1, 2, 3], [4, 5, 6, 7], [9, 9]]
    expected = [alone(decoder, d, p, 16) for d, p in zip(decodings, prompts, strict=True)]
    assert batched(decoder, decodings, prompts, 16)[0] == expected


def test_a_full_context_ends_its_member_and_the_others_step_on(target, drafter):
    beams = BeamDrafter(drafter, target.model.embed_tokens)
    decoder = decoder_for(target, beams, CPU_PLAN, max_context=24)
    decodings = mixed_decodings(beams)[:2]
    long, short = list(range(1, 20)), [5, 6]
    members = [
        batch.Member(decoder.prefill(decoder.new_sequence(), p, d)[0])
        for d, p in zip(decodings, [long, short], strict=True)
    ]
    ended = None
    for _ in range(30):
        steps = batch.batch_step(decoder, members if ended is None else members[1:])
        if ended is None and isinstance(steps[0], ContextFull):
            ended = steps[0]
        if ended is not None and any(isinstance(s, ContextFull) for s in steps):
            break
    assert isinstance(ended, ContextFull)
    assert members[1].state.sequence.offset > members[0].state.sequence.offset - len(long)


def test_seeded_members_draw_what_they_draw_alone(target, drafter):
    import mlx.core as mx

    from redrafter_mlx.core.decode.accept import make_sampler

    beams = BeamDrafter(drafter, target.model.embed_tokens)
    decoder = decoder_for(target, beams, CPU_PLAN)
    sampler = make_sampler(0.9)
    decodings = [
        decoding_of(beams, BeamShape(2, 3), sampler),
        decoding_of(None, BeamShape(1, 2), sampler, autoregressive=True),
    ]
    expected = []
    for seed, d, p in zip((5, 6), decodings, PROMPTS[:2], strict=True):
        mx.random.seed(seed)
        expected.append(alone(decoder, d, p, 20))
    mx.random.seed(123)  # another request's draws: a member's key is its own
    mx.random.uniform(shape=(7,))
    assert _keyed_answers(decoder, decodings, PROMPTS[:2], (5, 6), 20) == expected


def _keyed_answers(decoder, decodings, prompts, seeds, n):
    """Each member prefilled from its own seed, then stepped together with its own key."""
    import mlx.core as mx
    import numpy as np

    members, tokens = [], []
    for seed, decoding, prompt in zip(seeds, decodings, prompts, strict=True):
        mx.random.seed(seed)
        state, first = decoder.prefill(decoder.new_sequence(), prompt, decoding)
        members.append(batch.Member(state, batch.key_value(np.array(batch.current_key()))))
        tokens.append([] if first is None else list(first.tokens))
    while min(len(t) for t in tokens) < n:
        for answer, step in zip(tokens, batch.batch_step(decoder, members), strict=True):
            answer += step.tokens
    return [t[:n] for t in tokens]


@pytest.mark.parametrize("drafted", [True, False], ids=["redrafter", "autoregressive"])
def test_the_batching_service_answers_each_request_as_the_serial_one(target, drafter, drafted):
    requests = [
        Request(p, max_tokens=24, sampling=Sampling(0.8, seed=10 + i) if i % 2 else Sampling())
        for i, p in enumerate(PROMPTS + [[5, 6], [9, 1, 9]])
    ]
    serial = tiny_service(target, drafter if drafted else None)
    try:
        expected = [run(serial.submit(r)) for r in requests]
    finally:
        serial.close()
    service = tiny_service(target, drafter if drafted else None, max_batch=4, queue_size=8)
    try:
        jobs = [service.submit(r) for r in requests]
        answers = [None] * len(jobs)

        def read(i):
            answers[i] = run(jobs[i])

        threads = [threading.Thread(target=read, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        service.close()
    assert answers == expected
    assert all(job.outcome == "finished" for job in jobs)


def test_a_batching_service_over_a_hybrid_target_answers_as_the_serial_one():
    model = build("qwen3_5")
    requests = [Request(p, max_tokens=12) for p in PROMPTS]
    serial = tiny_service(model)
    try:
        expected = [run(serial.submit(r)) for r in requests]
    finally:
        serial.close()
    service = tiny_service(model, max_batch=4)
    try:
        jobs = [service.submit(r) for r in requests]
        answers = [run(job) for job in jobs]
    finally:
        service.close()
    assert answers == expected


@pytest.mark.parametrize(
    ("bound", "most"), [(None, 2), (1 << 30, 2), (1, 1)], ids=["unbounded", "1 GB", "1 byte"]
)
def test_a_request_joins_only_while_the_batch_holds_less_than_its_byte_bound(
    target, drafter, monkeypatch, bound, most
):
    """Two requests at once batch together, unless the first one's KV cache already holds
    ``max_batch_bytes``: the second then waits until the first has ended."""
    from redrafter_mlx.core.serving import scheduler

    sizes = []
    real = scheduler.batch_step
    monkeypatch.setattr(
        scheduler, "batch_step", lambda v, members: sizes.append(len(members)) or real(v, members)
    )
    service = tiny_service(target, drafter, max_batch=4, max_batch_bytes=bound)
    try:
        jobs = [service.submit(Request(p, max_tokens=40)) for p in PROMPTS[:2]]
        answers = [run(job) for job in jobs]
    finally:
        service.close()
    assert max(sizes) == most
    assert all(tokens for tokens, _ in answers)
    assert all(job.outcome == "finished" for job in jobs)


def test_a_cancelled_member_leaves_and_the_batch_goes_on(target, drafter):
    service = tiny_service(target, drafter, max_batch=4)
    try:
        gone = threading.Event()
        leaving = service.submit(Request(PROMPTS[0], max_tokens=200), gone.is_set)
        staying = service.submit(Request(PROMPTS[1], max_tokens=30))
        leaving.start(timeout=60)
        next(leaving.steps(timeout=60))
        gone.set()
        list(leaving.steps(timeout=60))
        tokens, reason = run(staying)
    finally:
        service.close()
    assert leaving.outcome == "cancelled"
    assert reason == "length" and len(tokens) == 30


def test_past_max_batch_requests_wait_in_the_queue_and_past_it_are_refused(target, drafter):
    from redrafter_mlx.core.serving.service import QueueFull

    service = tiny_service(target, drafter, max_batch=2, queue_size=1)
    try:
        running = []
        for prompt in LONG:  # one place in the queue: each taken up before the next
            running.append(service.submit(Request(prompt, max_tokens=300)))
            running[-1].start(timeout=60)
        waiting = service.submit(Request(PROMPTS[2], max_tokens=4))
        assert service.waiting == 1
        with pytest.raises(QueueFull):
            service.submit(Request(PROMPTS[3], max_tokens=4))
        for job in running:
            job.cancel()
        tokens, reason = run(waiting)
    finally:
        service.close()
    assert reason == "length" and len(tokens) == 4
    assert [job.outcome for job in running] == ["cancelled", "cancelled"]


def test_a_request_joining_the_batch_starts_from_its_conversation_s_cache(target, drafter):
    service = tiny_service(target, drafter, max_batch=4)
    try:
        first_tokens, _ = run(service.submit(Request(LONG[0], max_tokens=8)))
        other = service.submit(Request(LONG[1], max_tokens=200))  # answering meanwhile
        other.start(timeout=60)
        follow_up = LONG[0] + first_tokens + [5, 6, 7, 8, 9, 10, 11, 12, 13]
        job = service.submit(Request(follow_up, max_tokens=8))
        started = job.start(timeout=60)
        tokens = [t for step in job.steps(timeout=60) for t in step.tokens]
        other.cancel()
        list(other.steps(timeout=60))
    finally:
        service.close()
    assert started.cached_tokens >= len(LONG[0]) + len(first_tokens) - 1
    assert tokens == alone(decoder_for(target), decoding_of(), follow_up, 8)


def test_a_prompt_past_the_context_fails_alone_and_the_batch_goes_on(target):
    service = tiny_service(target, max_batch=4, max_context=16)
    try:
        running = service.submit(Request(LONG[0], max_tokens=10))
        too_long = service.submit(Request(list(range(1, 21)), max_tokens=4))
        with pytest.raises(ContextFull):
            too_long.start(timeout=60)
        tokens, reason = run(running)
    finally:
        service.close()
    assert too_long.outcome == "failed"
    assert reason == "length" and len(tokens) == 10
