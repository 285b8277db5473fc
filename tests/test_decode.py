"""The ReDrafter loop: lossless greedy output, oracle acceptance, one sync, exact sampling."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.sample_utils import apply_top_p, make_sampler
from support import decoder_for, decoding_of, run_steps, tiny_llama
from support.decoding import (
    PADDED,
    VOCAB,
    answers_to_the_context_end,
    assert_drawn_from,
    autoregressive,
    first_three_token_probs,
    remembered_answers,
    take,
)

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN
from redrafter_mlx.core.decode import speculative as tree_step
from redrafter_mlx.core.decode.accept import choose, greedy
from redrafter_mlx.core.decode.accept import make_sampler as our_sampler
from redrafter_mlx.core.decode.plan import Plan
from redrafter_mlx.core.decode.shape import BeamShape, verified_sizes
from redrafter_mlx.core.decode.source import SearchSource
from redrafter_mlx.core.decode.tree import verified_size
from redrafter_mlx.core.drafters.beam_search import BeamDrafter, beam_search, select_paths
from redrafter_mlx.core.drafters.redrafter import random_drafter
from redrafter_mlx.core.serving.session import Session
from redrafter_mlx.tuning.measure import time_steps

GREEDY = greedy  # the fast path: argmax of raw logits
PROMPT = [5, 17, 33, 2, 41]


def speculative(
    model,
    drafter,
    prompt,
    n,
    width,
    length,
    sampler=GREEDY,
    plan=GENERIC_PLAN,
    min_prob=0.0,
    search_width=0,
):
    shape = BeamShape(width, length, min_prob, search_width)
    return take(run_steps(model, prompt, drafter, shape, sampler, plan=plan), n)


@pytest.fixture(scope="module")
def beam_drafter(target, drafter):
    return BeamDrafter(drafter, target.model.embed_tokens)


@pytest.fixture(scope="module")
def target_answer(target):
    """``target``'s greedy autoregressive answers, each decoded once (hypothesis draws 4
    prompts for its 30 examples; the oracle's 8 cases share one answer)."""
    return remembered_answers(target)


@settings(max_examples=30, deadline=None)
@given(
    width=st.integers(1, 16),
    length=st.integers(2, 6),
    seed=st.integers(0, 3),
    plan=st.sampled_from([GENERIC_PLAN, Plan(tree_sizes=PADDED), CPU_PLAN]),
    min_prob=st.sampled_from([0.0, 0.0, 1e-4, 0.01, 0.3]),
    search_width=st.sampled_from([0, 0, 8, 24]),
)
def test_greedy_equals_autoregressive(
    target, target_answer, beam_drafter, width, length, seed, plan, min_prob, search_width
):
    """On the generic plan (what Metal and CUDA run), with padded trees and on the CPU plan."""
    prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 64, size=6)]
    expected = list(target_answer(tuple(prompt), 48))
    got = speculative(
        target,
        beam_drafter,
        prompt,
        48,
        width,
        length,
        plan=plan,
        min_prob=min_prob,
        search_width=search_width,
    )[0]
    assert got == expected


@pytest.mark.parametrize("length", [700, 2100])
@pytest.mark.parametrize("plan", [GENERIC_PLAN, CPU_PLAN])
def test_greedy_equals_autoregressive_after_a_long_prompt(
    target, target_answer, beam_drafter, plan, length
):
    """After 700 and 2,100 prompt tokens (two and five prefill chunks on the CPU plan; every
    tree attends to the whole cached prefix unmasked there, and to itself under its mask;
    2,100 is past the CPU plan's ``plain_from``, where a profile's or a flag's shape still
    speculates) greedy output with drafted and lookup beams is the autoregressive output,
    and so is the plan's own plain decoding."""
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, 64, size=length)]
    expected = list(target_answer(tuple(prompt), 32))
    steps = run_steps(target, prompt, beam_drafter, BeamShape(2, 3, lookup=1), plan=plan)
    assert take(steps, 32)[0] == expected
    assert take(run_steps(target, prompt, plan=plan), 32)[0] == expected


def test_greedy_exact_with_a_drafter_that_often_agrees():
    """A target with small vocab makes random drafts often right: exercises long accepts."""
    model = tiny_llama(seed=3, vocab=8)
    bd = BeamDrafter(random_drafter(64, 8, seed=4), model.model.embed_tokens)
    expected = autoregressive(model, [1, 2, 3], 64)
    for width, length in [(1, 6), (4, 4), (8, 6)]:
        got, steps = speculative(model, bd, [1, 2, 3], 64, width, length)
        assert got == expected
        assert steps < 63  # some drafts were accepted


def test_pruned_trees_are_smaller_and_still_exact():
    """A probability floor verifies fewer nodes per step, and long accepts still happen."""
    model = tiny_llama(seed=3, vocab=8)
    bd = BeamDrafter(random_drafter(64, 8, seed=4), model.model.embed_tokens)
    expected = autoregressive(model, [1, 2, 3], 64)
    sizes = {}
    for min_prob in (0.0, 0.05, 0.2):
        out, trees = [], []
        for k, step in enumerate(run_steps(model, [1, 2, 3], bd, BeamShape(4, 5, min_prob))):
            out += step.tokens
            trees += [step.tree_size] if k else []
            if len(out) >= 64:
                break
        assert out[:64] == expected
        sizes[min_prob] = np.mean(trees)
    assert sizes[0.0] > sizes[0.05] > sizes[0.2] >= 1


class OracleDrafter(SearchSource):
    """Proposes the target's own continuation in one beam (at a varying row), junk elsewhere."""

    kind = "oracle"

    def __init__(self, continuation, vocab):
        self.continuation, self.vocab, self.calls = continuation, vocab, 0

    def search(self, context, pending, *, width, length, min_prob=0.0, search_width=0):
        start = self.calls * length
        beams = np.random.default_rng(self.calls).integers(0, self.vocab, (width, length))
        beams[:, 0] = self.continuation[start]
        beams[self.calls % width] = self.continuation[start : start + length]
        self.calls += 1
        return mx.array(beams), None, 0


@pytest.mark.parametrize("width,length", [(1, 2), (3, 4), (5, 6), (16, 5)])
@pytest.mark.parametrize("plan", [GENERIC_PLAN, Plan(tree_sizes=PADDED)])
def test_oracle_drafter_gets_full_beams(target, target_answer, width, length, plan):
    expected = list(target_answer(tuple(PROMPT), 200))
    oracle = OracleDrafter(expected, target.args.vocab_size)
    n = 1 + 10 * length
    got, steps = speculative(target, oracle, PROMPT, n, width, length, plan=plan)
    assert got == expected[:n]
    assert steps == 10  # every step emitted L tokens


def test_one_host_read_per_step(target, beam_drafter, monkeypatch):
    reads = []
    real = tree_step.host_read
    monkeypatch.setattr(tree_step, "host_read", lambda *x, **k: reads.append(1) or real(*x, **k))
    _, steps = speculative(target, beam_drafter, PROMPT, 40, 4, 4)
    assert len(reads) == steps + 1  # one per step, plus the one after prefill


@pytest.mark.parametrize("shape", [BeamShape(1, 4), BeamShape(2, 4), BeamShape(3, 5, 0.05)])
def test_near_the_context_end_redrafter_stops_where_plain_decoding_does(
    target, beam_drafter, shape
):
    """The last steps verify shorter beams, so the answer runs exactly as far as the
    autoregressive one before ContextFull (whole trees used to stop it up to W * L early)."""
    limit = len(PROMPT) + 30
    plain, speculative = answers_to_the_context_end(target, beam_drafter, shape, PROMPT, limit)
    assert plain == speculative and plain[1] == limit


def test_early_stopped_drafts_count_their_reads(target, beam_drafter):
    """With a floor and the CPU plan's early stop the drafter reads its best score after each
    depth but the last and stops once it is below the floor: a step reads 1 + (drafted depths,
    at most L - 2) times. The generic plan drafts every depth: one read per step, and the same
    tokens and trees."""
    for min_prob, most in ((1e-9, 3), (0.5, 3)):
        shape = BeamShape(4, 4, min_prob)
        runs = {}
        for plan in (CPU_PLAN, GENERIC_PLAN):
            steps = run_steps(target, PROMPT, beam_drafter, shape, plan=plan)
            steps = list(itertools.islice(steps, 1, 30))
            runs[plan] = steps
        syncs = [step.syncs for step in runs[CPU_PLAN]]
        assert all(1 < s <= most for s in syncs)
        if min_prob == 1e-9:
            assert set(syncs) == {3}  # never stops early
        else:
            assert min(syncs) == 2  # a random drafter is rarely 50% sure: stops at depth 1
        assert {step.syncs for step in runs[GENERIC_PLAN]} == {1}
        assert [(s.tokens, s.tree_size) for s in runs[GENERIC_PLAN]] == [
            (s.tokens, s.tree_size) for s in runs[CPU_PLAN]
        ]


def test_a_tree_step_reaches_the_device_before_its_read(target, beam_drafter, monkeypatch):
    """A tree step's graph waits for the last step's read, so it cannot be pipelined whole: the
    generic plan hands the verify forward's logits ``(T, V)`` to the device (``async_eval``)
    before Python builds the acceptance and the next draft, and those before the step's read,
    so the read only waits. Answers stay those of plain decoding."""
    steps = run_steps(target, PROMPT, beam_drafter, BeamShape(2, 4))
    next(steps)  # the prefill's token
    events = []
    vocab = target.args.vocab_size

    def dispatching(*arrays):
        verified = any(a.ndim == 2 and a.shape[1] == vocab for a in arrays)
        events.append("logits" if verified else "dispatch")
        return real_async_eval(*arrays)

    def accepting(*args, **kwargs):
        events.append("accept")
        return real_accept(*args, **kwargs)

    def reading(*args, **kwargs):
        events.append("read")
        return real_read(*args, **kwargs)

    real_async_eval, real_accept, real_read = mx.async_eval, tree_step.accept, tree_step.host_read
    monkeypatch.setattr(mx, "async_eval", dispatching)
    monkeypatch.setattr(tree_step, "accept", accepting)
    monkeypatch.setattr(tree_step, "host_read", reading)
    for _ in range(3):
        events.clear()
        next(steps)
        accepted, read = events.index("accept"), events.index("read")
        assert "logits" in events[:accepted]
        assert "dispatch" in events[accepted:read]
    monkeypatch.undo()
    expected = autoregressive(target, PROMPT, 24)
    assert speculative(target, beam_drafter, PROMPT, 24, 2, 4)[0] == expected


def test_compiled_and_eager_beam_search_agree(target, drafter):
    context = mx.random.normal((target.args.hidden_size,))
    pending = mx.array(7)
    for width, length, search in [(1, 3, 0), (4, 5, 0), (3, 2, 0), (2, 4, 9)]:
        eager = beam_search(
            drafter,
            target.model.embed_tokens,
            context,
            pending,
            width=width,
            length=length,
            search_width=search,
        )
        compiled = BeamDrafter(drafter, target.model.embed_tokens)(
            context, pending, width=width, length=length, search_width=search
        )
        assert (eager[0] == compiled[0]).all()
        np.testing.assert_allclose(eager[1], compiled[1], atol=1e-5)
        assert eager[0].shape == (width, length) and (eager[0][:, 0] == 7).all()


def test_early_stopping_search_is_the_full_search_cut_short(target, drafter):
    bd = BeamDrafter(drafter, target.model.embed_tokens)
    context = mx.random.normal((target.args.hidden_size,), key=mx.random.key(1))
    pending = mx.array(7)
    for width, length in [(1, 5), (3, 4)]:  # a floor nothing falls below: the full search
        beams, logprobs = bd(context, pending, width=width, length=length)
        same = bd.search(context, pending, width=width, length=length, min_prob=1e-12)
        assert (same[0] == beams).all() and same[2] == length - 2
        np.testing.assert_allclose(same[1], logprobs, atol=1e-5)
    beams, logprobs = (np.array(a) for a in bd(context, pending, width=1, length=6))
    floor = float(np.exp(logprobs[0, 0])) * 0.999  # depth 1 reaches it, depth 2 does not
    cut, cut_logprobs, syncs = bd.search(context, pending, width=1, length=6, min_prob=floor)
    cut, cut_logprobs = np.array(cut), np.array(cut_logprobs)
    assert syncs == 2  # read after depths 1 and 2, stopped
    assert (cut[:, :3] == beams[:, :3]).all() and (cut[:, 3:] == -1).all()
    assert np.isneginf(cut_logprobs[:, 2:]).all()


def test_early_stopping_wide_search_selects_from_the_cut_search(target, drafter):
    """A floored search with S > W stops like the S-beam search and verifies the W it picks."""
    bd = BeamDrafter(drafter, target.model.embed_tokens)
    context = mx.random.normal((target.args.hidden_size,), key=mx.random.key(2))
    pending = mx.array(7)
    wide, wide_logprobs = bd(context, pending, width=8, length=5, min_prob=0.05)
    drafted = int((np.array(wide)[0] >= 0).sum())  # pending + the depths searched
    picked, picked_logprobs = bd(context, pending, width=3, length=5, min_prob=0.05, search_width=8)
    expected = select_paths(wide, wide_logprobs, 3)
    assert (np.array(picked) == np.array(expected[0])).all()
    assert picked.shape == (3, 5) and (np.array(picked)[:, drafted:] == -1).all()


def test_selected_paths_hedge_the_first_drafted_token():
    """Top beams by score share their first drafted token; the picks spend a beam on the
    runner-up first token, which adds more expected accepted tokens than a different tail."""
    beams = mx.array([[9, 1, 2, 3], [9, 1, 2, 4], [9, 1, 5, 3], [9, 6, 7, 8]])
    probs = np.array([[0.6, 0.9, 0.6], [0.6, 0.9, 0.3], [0.6, 0.1, 0.9], [0.4, 0.9, 0.4]])
    picked, picked_logprobs = select_paths(beams, mx.array(np.log(probs)), 2)
    assert np.array(picked).tolist() == [[9, 1, 2, 3], [9, 6, 7, 8]]
    np.testing.assert_allclose(np.exp(np.array(picked_logprobs)), probs[[0, 3]], rtol=1e-6)
    # by joint probability beam 1 is second (0.162 vs beam 3's 0.144), but it adds one node
    # (0.6 * 0.9 * 0.3 = 0.16 expected tokens) to the first beam's tree; beam 3 adds 0.90


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    beams_count=st.integers(1, 10),
    length=st.integers(2, 5),
)
def test_selected_paths_are_the_greedy_best_cover(data, beams_count, length):
    """select_paths (vectorized, batched) equals a plain greedy over sets of prefixes."""
    width = data.draw(st.integers(1, beams_count))
    seed = data.draw(st.integers(0, 10**6))
    rng = np.random.default_rng(seed)
    beams = rng.integers(0, 3, (beams_count, length))  # small vocab: many shared prefixes
    beams[:, 0] = 5
    node_logprobs: dict[tuple, float] = {}  # beams sharing a node share its log-prob
    logprobs = np.array(
        [
            [
                node_logprobs.setdefault(tuple(b[1 : d + 2]), np.log(rng.uniform(0.05, 1.0)))
                for d in range(length - 1)
            ]
            for b in beams
        ],
        np.float32,
    ).reshape(beams_count, length - 1)
    probs = np.exp(np.cumsum(logprobs.astype(np.float64), axis=1))
    chosen, tree = [], set()
    for _ in range(width):
        gains = [
            sum(probs[b, d] for d in range(length - 1) if tuple(beams[b, 1 : d + 2]) not in tree)
            for b in range(beams_count)
        ]
        best = int(np.argmax(gains))
        chosen.append(best)
        tree |= {tuple(beams[best, 1 : d + 2]) for d in range(length - 1)}
    batch = (
        mx.array(np.stack([beams, beams[::-1]])),
        mx.array(np.stack([logprobs, logprobs[::-1]])),
    )
    picked, _ = select_paths(*batch, width)
    assert np.array(picked)[0].tolist() == beams[chosen].tolist()
    reversed_picks = {tuple(b) for b in np.array(picked)[1].tolist()}
    assert reversed_picks == {tuple(b) for b in beams[chosen].tolist()}  # same tree


def test_beam_search_keeps_best_scores_first(target, drafter):
    beams, logprobs = beam_search(
        drafter, target.model.embed_tokens, mx.random.normal((64,)), mx.array(3), width=6, length=4
    )
    scores = np.array(logprobs.sum(axis=1))
    assert (np.diff(scores) <= 1e-6).all()
    assert len({tuple(b) for b in np.array(beams).tolist()}) == 6  # no duplicate beams


def test_greedy_reads_raw_logits_with_the_same_pick():
    logits = mx.random.normal((6, 300), key=mx.random.key(0)) * 5
    ours = choose(logits, greedy)
    theirs = choose(logits, make_sampler(0.0))  # mlx-lm's argmax on log-probs
    assert (ours == theirs).all() and (ours == mx.argmax(logits, axis=-1)).all()
    assert our_sampler(0.0, top_p=0.9) is greedy and our_sampler(0.7) is not greedy


def test_temperature_and_top_k_draw_the_same_from_raw_logits():
    """Without top-p, choose() skips the log-softmax: with the same random stream every draw
    equals mlx-lm's sampler on log-probs (the scores differ by a constant per row)."""
    logits = mx.random.normal((64, 300), key=mx.random.key(1)) * 4
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for sampler in (our_sampler(0.7), our_sampler(1.3, top_k=20)):
        assert sampler.reads_logits
        mx.random.seed(5)
        ours = choose(logits, sampler)
        mx.random.seed(5)
        assert (ours == sampler(logprobs)).all()
    assert not our_sampler(1.0, top_p=0.8).reads_logits


# --- sampling is exact: chi-square against the target's own distribution -------------------


@pytest.mark.parametrize(
    "temp,top_p,width,search",
    [(0.7, 0.0, 3, 0), (1.5, 0.0, 3, 0), (1.0, 0.8, 3, 0), (1.0, 0.8, 1, 0), (1.0, 0.0, 2, 8)],
)
@pytest.mark.distribution
def test_sampling_matches_target_distribution(temp, top_p, width, search):
    model = tiny_llama(seed=6, vocab=VOCAB, scale=1.5)
    bd = BeamDrafter(random_drafter(64, VOCAB, seed=7), model.model.embed_tokens)
    sampler = make_sampler(temp, top_p=top_p)
    filt = (lambda x: apply_top_p(x, top_p)) if top_p else (lambda x: x)
    prompt = [1, 2, 3]
    probs = first_three_token_probs(model, filt, temp, prompt)
    mx.random.seed(11)
    runs = 1500
    counts = np.zeros((3, VOCAB))
    for _ in range(runs):
        tokens, _ = speculative(model, bd, prompt, 3, width, 3, sampler, search_width=search)
        counts[np.arange(3), tokens] += 1
    assert_drawn_from(counts, probs, runs)


@pytest.mark.parametrize("plan", [GENERIC_PLAN, CPU_PLAN])
def test_a_decoder_leaves_the_callers_model_as_it_was(plan):
    """The decoder runs a copy (RoPE wrapped, weights fused on the CPU plan) sharing the
    arrays: the model passed in keeps its modules, its weights and its plain attributes."""
    from mlx.utils import tree_flatten

    from redrafter_mlx.backend.plan import build_decoder

    model = tiny_llama(seed=5)
    before = {k: id(v) for k, v in tree_flatten(model.parameters())}
    modules = [id(m) for _, m in model.named_modules()]
    attributes = dict(vars(model))
    decoder = build_decoder(model, plan=plan)
    take(run_steps(model, [3, 5, 7], plan=plan), 8)
    assert {k: id(v) for k, v in tree_flatten(model.parameters())} == before
    assert [id(m) for _, m in model.named_modules()] == modules
    assert vars(model) == attributes
    assert decoder.model is not model


def test_prompts_run_uncompiled_and_only_decode_steps_compile(traces):
    model = tiny_llama(seed=5)
    decoder = decoder_for(model, plan=CPU_PLAN)
    decoding = decoding_of()
    cache = decoder.new_sequence()
    state, _ = decoder.prefill(cache, [3, 5, 7, 11, 13], decoding)  # any prompt length
    assert not traces  # no kernels built for the prompt
    decoder.step(state)  # a one-token decode step runs the compiled halves
    assert traces


@pytest.mark.parametrize("shape", [BeamShape(3, 3), BeamShape(2, 4, 0.05)])
def test_warm_up_traces_every_tree_size_before_the_answer(traces, shape):
    """After ``warm_up`` no decode step compiles, whichever tree sizes the answers meet (a
    compile mid-answer runs g++ on the CPU backend, which loses Ctrl-C)."""
    model = tiny_llama(seed=11, vocab=16)  # small vocab: drafts often merge and get accepted
    drafter = BeamDrafter(random_drafter(64, 16, seed=12), model.model.embed_tokens)
    decoder = decoder_for(model, drafter, CPU_PLAN)
    decoder.warm_up(decoding_of(drafter, shape))
    warmed = len(traces)
    sizes = set()
    for seed in range(4):
        prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 16, size=5)]
        steps = run_steps(model, prompt, drafter, shape, plan=CPU_PLAN)
        for step in itertools.islice(steps, 1, 40):  # after the prefill
            sizes.add(verified_size(step.tree_size, CPU_PLAN.tree_sizes))
    assert len(sizes) >= 2  # the answers did meet several sizes
    assert sizes <= set(verified_sizes(shape, CPU_PLAN.tree_sizes))
    assert warmed > 0 and len(traces) == warmed


def test_verified_sizes_span_merged_to_disjoint_trees():
    assert verified_sizes(BeamShape(1, 4)) == [4]
    assert verified_sizes(BeamShape(3, 3)) == [3, 4, 5, 6, 7]
    assert verified_sizes(BeamShape(3, 3, 0.3)) == [1, 2, 3, 4, 5, 6, 7]
    assert verified_sizes(BeamShape(4, 5), CPU_PLAN.tree_sizes) == [5, 6, 7, 8, 16, 32]


def test_warm_up_samples_at_every_row_count_an_answer_samples(monkeypatch):
    """mlx-lm's samplers are compiled at import (invisible to ``traces``) and traced per row
    count: the warm-up must sample at each count an answer does, beyond 32-row trees too."""
    from redrafter_mlx.core.decode import accept as accept_module
    from redrafter_mlx.core.decode import decoder

    seen, real = [], accept_module.choose

    def recording(logits, sampler):
        seen.append(logits.shape[0])
        return real(logits, sampler)

    monkeypatch.setattr(accept_module, "choose", recording)
    monkeypatch.setattr(decoder, "choose", recording)
    model = tiny_llama(seed=11)
    drafter = BeamDrafter(random_drafter(64, 64, seed=12), model.model.embed_tokens)
    shape = BeamShape(16, 4)  # up to 49 nodes: trees beyond the compiled 32 rows
    decoder = decoder_for(model, drafter)
    decoder.warm_up(decoding_of(drafter, shape, our_sampler(0.8)))
    warmed, seen[:] = set(seen), []
    for seed in range(3):
        prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 64, size=5)]
        take(run_steps(model, prompt, drafter, shape, our_sampler(0.8)), 24)
    assert max(seen) > decoder.plan.compiled_max_rows and set(seen) <= warmed


def test_warm_up_keeps_a_seeded_stream_where_the_seed_put_it():
    model = tiny_llama(seed=11)
    drafter = BeamDrafter(random_drafter(64, 64, seed=12), model.model.embed_tokens)

    def answer(warm: bool) -> list[int]:
        decoding = decoding_of(drafter, BeamShape(2, 3), our_sampler(1.0))
        session = Session(decoder_for(model, drafter), None, decoding, seed=7, warm=warm)
        return take(session.steps(PROMPT), 32)[0]

    assert answer(warm=True) == answer(warm=False)


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_timing_steps_mid_answer_changes_nothing(temp):
    """chat's /stats times a one-token and a ReDrafter step between answers: the cache, the
    conversation's next tokens and a seeded sampling stream must come out as without it."""
    model = tiny_llama(seed=11)
    drafter = BeamDrafter(random_drafter(64, 64, seed=12), model.model.embed_tokens)

    def answer(timed: bool) -> tuple[list[int], list[int]]:
        decoding = decoding_of(drafter, BeamShape(3, 4), our_sampler(temp))
        session = Session(decoder_for(model, drafter), None, decoding, seed=7, warm=False)
        cache = session.sequence
        steps = session.steps(PROMPT)
        first, _ = take(steps, 12)
        if timed:
            before = (cache.offset, cache.ids)
            single, step = time_steps(session, reps=2)
            assert 0 < single and 0 < step
            assert (cache.offset, cache.ids) == before
        rest, _ = take(steps, 24)
        return first + rest, cache.ids

    assert answer(timed=True) == answer(timed=False)
