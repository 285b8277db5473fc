"""Prompt-lookup beams: the n-gram index, and decoding with lookup beams (with and without a
drafter) that stays exactly the target's own output."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.sample_utils import make_sampler
from support import decoder_for, decoding_of, run_steps, tiny_llama
from support.decoding import (
    PADDED,
    VOCAB,
    answers_to_the_context_end,
    assert_drawn_from,
    autoregressive,
    first_three_token_probs,
    take,
    target_probs,
)

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN
from redrafter_mlx.core.decode import speculative as tree_step
from redrafter_mlx.core.decode.accept import greedy
from redrafter_mlx.core.decode.lookup import NgramIndex
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.plan import Plan
from redrafter_mlx.core.decode.shape import BeamShape, verified_sizes
from redrafter_mlx.core.decode.speculative import accepted_source as _source
from redrafter_mlx.core.decode.step import Decoding
from redrafter_mlx.core.decode.tree import verified_size
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import random_drafter
from redrafter_mlx.core.serving.session import Session
from redrafter_mlx.tuning.measure import time_steps


def scanned(history, pending: int, count: int, length: int, min_ngram: int, max_ngram: int):
    """What :meth:`NgramIndex.propose` must return, by scanning the whole history."""
    full = history + [pending]
    found = []
    for n in range(min(max_ngram, len(full)), min_ngram - 1, -1):
        for end in range(len(history) - 1, n - 2, -1):
            if full[end - n + 1 : end + 1] == full[-n:]:
                span = full[end + 1 :]
                row = [pending] + [span[i % len(span)] for i in range(length - 1)]
                if row not in found:
                    found.append(row)
    return found[:count]


def test_propose_takes_the_most_recent_longest_matches_first():
    index = NgramIndex([5, 1, 2, 3, 9, 1, 2, 4, 7, 2, 6, 8], min_ngram=1)
    # only the 1-gram "2" matches (it ended at 9, 6 and 2): newest first
    assert index.propose(2, 4, 3).tolist() == [[2, 6, 8], [2, 4, 7], [2, 3, 9]]
    assert index.propose(2, 1, 3).tolist() == [[2, 6, 8]]
    assert index.propose(42, 4, 3).shape == (0, 3)  # never seen: nothing to copy
    assert index.propose(2, 0, 3).shape == (0, 3)
    assert NgramIndex(index.tokens).propose(2, 4, 3).shape == (0, 3)  # from 2-grams on
    index = NgramIndex([1, 2, 3, 9, 1, 2, 4, 1], min_ngram=1)
    # "1 2" ended at 5 then 1; the 1-gram "2" ends at the same places: nothing more
    assert index.propose(2, 4, 3).tolist() == [[2, 4, 1], [2, 3, 9]]


def test_a_match_near_the_end_repeats_its_span():
    index = NgramIndex([3, 4, 3])
    assert index.propose(4, 2, 6).tolist() == [[4, 3, 4, 3, 4, 3]]
    assert NgramIndex([7], min_ngram=1).propose(7, 2, 4).tolist() == [[7, 7, 7, 7]]


@settings(max_examples=200, deadline=None)
@given(
    history=st.lists(st.integers(0, 5), max_size=40),
    pending=st.integers(0, 5),
    count=st.integers(1, 6),
    length=st.integers(2, 6),
    ngrams=st.tuples(st.integers(1, 4), st.integers(1, 4)).map(sorted),
    cut=st.integers(0, 40),
)
def test_index_proposes_what_a_scan_finds_and_rewinds_to_a_fresh_index(
    history, pending, count, length, ngrams, cut
):
    low, high = ngrams
    index = NgramIndex(history[:3], max_ngram=high, min_ngram=low)
    index.extend(history[3:])  # grown in pieces as a decode grows it
    want = scanned(history, pending, count, length, low, high)
    assert index.propose(pending, count, length).tolist() == want
    index.rewind(cut)
    kept = history[:cut]
    assert index.tokens == kept
    for token in range(6):  # no n-gram of the dropped tokens is left behind
        proposed = index.propose(token, 6, length).tolist()
        assert proposed == scanned(kept, token, 6, length, low, high)
    index.extend(history[cut:])  # and it grows again as a fresh one would
    assert index.propose(pending, count, length).tolist() == want


def test_accepted_tokens_are_attributed_to_the_beams_that_held_them():
    beams = np.array([[1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 4, 6]])
    assert _source(beams, 2, 0, 2) == "both"  # drafter row 0 and lookup row 2
    assert _source(beams, 2, 1, 2) == "drafter"
    assert _source(beams, 2, 3, 1) == "both"  # "4" starts drafter row 1 and lookup row 3
    assert _source(beams, 2, 3, 2) == "lookup"
    assert _source(beams, 2, 0, 0) is None
    assert _source(beams[2:], 0, 1, 2) == "lookup"  # no drafter


def repetitive_target():
    """A small vocabulary: greedy continuations fall into loops that lookup can copy."""
    return tiny_llama(seed=3, vocab=8)


def decode_with(model, drafter, prompt, n, shape, sampler=greedy, plan=GENERIC_PLAN):
    out, sources, count = [], [], -1
    for step in run_steps(model, prompt, drafter, shape, sampler, plan=plan):
        out += step.tokens
        sources.append(step.accepted_from)
        count += 1
        if len(out) >= n:
            return out[:n], count, sources[1:]


@pytest.fixture(scope="module")
def small():
    model = repetitive_target()
    return model, BeamDrafter(random_drafter(64, 8, seed=4), model.model.embed_tokens)


@settings(max_examples=30, deadline=None)
@given(
    width=st.integers(1, 4),
    length=st.integers(2, 6),
    lookup=st.integers(1, 6),
    with_drafter=st.booleans(),
    seed=st.integers(0, 3),
    plan=st.sampled_from([GENERIC_PLAN, Plan(tree_sizes=PADDED), CPU_PLAN]),
    min_prob=st.sampled_from([0.0, 0.0, 0.05]),
)
def test_greedy_with_lookup_beams_equals_autoregressive(
    small, width, length, lookup, with_drafter, seed, plan, min_prob
):
    model, drafter = small
    prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 8, size=6)]
    shape = BeamShape(width, length, min_prob, lookup=lookup)
    got, _, _ = decode_with(model, drafter if with_drafter else None, prompt, 48, shape, plan=plan)
    assert got == autoregressive(model, prompt, 48)


def test_lookup_alone_accepts_copied_loops_and_says_so(small):
    model, _ = small
    prompt = [1, 2, 3]
    expected = autoregressive(model, prompt, 64)
    got, steps, sources = decode_with(model, None, prompt, 64, BeamShape(length=5, lookup=4))
    assert got == expected
    assert steps <= 52  # copies of the loop were accepted, several tokens a step
    assert set(sources) == {None, "lookup"}


def test_drafter_and_lookup_beams_share_the_tree(small):
    model, drafter = small
    prompt = [1, 2, 3]
    runs = {}
    for lookup in (0, 4):
        runs[lookup] = decode_with(model, drafter, prompt, 64, BeamShape(2, 5, lookup=lookup))
    assert runs[0][0] == runs[4][0] == autoregressive(model, prompt, 64)
    assert runs[4][1] < runs[0][1]  # fewer steps with the copied loops
    assert set(runs[0][2]) <= {None, "drafter"}
    assert {"lookup", "both"} <= set(runs[4][2])


@pytest.mark.parametrize("with_drafter", [True, False])
def test_one_host_read_per_step_with_lookup_beams(small, with_drafter, monkeypatch):
    model, drafter = small
    reads = []
    real = tree_step.host_read
    monkeypatch.setattr(tree_step, "host_read", lambda *x, **k: reads.append(1) or real(*x, **k))
    shape = BeamShape(2, 4, lookup=3)
    _, steps, _ = decode_with(model, drafter if with_drafter else None, [1, 2, 3], 40, shape)
    assert len(reads) == steps + 1  # one per step, plus the one after prefill


@pytest.mark.parametrize("with_drafter", [True, False])
def test_lookup_beams_stop_at_the_context_end_where_plain_decoding_does(small, with_drafter):
    model, drafter = small
    prompt, limit = [1, 2, 3], 3 + 30
    shape = BeamShape(2, 5, lookup=3)
    beams = drafter if with_drafter else None
    plain, speculative = answers_to_the_context_end(model, beams, shape, prompt, limit)
    assert plain == speculative and plain[1] == limit


@pytest.mark.parametrize("with_drafter", [True, False])
def test_warm_up_traces_every_tree_size_lookup_beams_make(traces, with_drafter):
    model = repetitive_target()  # a fresh model: nothing traced for it yet
    drafter = BeamDrafter(random_drafter(64, 8, seed=4), model.model.embed_tokens)
    shape = BeamShape(2, 3, lookup=3)
    drafter = drafter if with_drafter else None
    decoder_for(model, drafter, CPU_PLAN).warm_up(decoding_of(drafter, shape))
    warmed, sizes = len(traces), set()
    for seed in range(4):
        prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 8, size=5)]
        steps = run_steps(model, prompt, drafter, shape, plan=CPU_PLAN)
        for step in itertools.islice(steps, 1, 40):
            sizes.add(verified_size(step.tree_size, CPU_PLAN.tree_sizes))
    assert len(sizes) >= 2
    assert sizes <= set(verified_sizes(shape, CPU_PLAN.tree_sizes, drafted=with_drafter))
    assert warmed > 0 and len(traces) == warmed


def test_verified_sizes_count_lookup_beams():
    assert verified_sizes(BeamShape(2, 3, lookup=2)) == [3, 4, 5, 6, 7, 8, 9]
    assert verified_sizes(BeamShape(2, 3, lookup=2), drafted=False) == [1, 2, 3, 4, 5]


def test_timing_a_lookup_step_leaves_the_index_and_cache_as_they_were(small):
    model, drafter = small
    for beams in (drafter, None):
        decoding = decoding_of(beams, BeamShape(2, 4, lookup=3))
        session = Session(decoder_for(model, beams), None, decoding, warm=False)
        cache, steps = session.sequence, session.steps([1, 2, 3])
        first, _ = take(steps, 12)
        before = (cache.offset, cache.ids)
        assert min(time_steps(session, reps=2)) > 0
        assert (cache.offset, cache.ids) == before
        assert first + take(steps, 24)[0] == autoregressive(model, [1, 2, 3], 36)


def test_without_drafter_or_lookup_there_is_nothing_to_speculate_with(small):
    model, _ = small
    decoder = decoder_for(model)
    with pytest.raises(ValueError, match="drafter or lookup"):
        decoder.prefill(decoder.new_sequence(), [1, 2], Decoding(Mode.LOOKUP, BeamShape(2, 4)))
    with pytest.raises(ValueError, match="no drafter"):
        Mode.choose(drafter=False, shape=BeamShape(2, 4))


@pytest.mark.parametrize("temp,top_p,with_drafter", [(1.0, 0.0, True), (0.7, 0.8, False)])
@pytest.mark.distribution
def test_sampling_with_lookup_beams_matches_target_distribution(temp, top_p, with_drafter):
    """The chi-square test of test_decode, with lookup beams in the tree: the prompt holds
    "2 x y" for every token x (y: the target's likeliest token after "2 x"), so whatever
    follows its last "2", a lookup beam copies a likely continuation."""
    from mlx_lm.sample_utils import apply_top_p

    model = tiny_llama(seed=6, vocab=VOCAB, scale=1.5)
    drafter = BeamDrafter(random_drafter(64, VOCAB, seed=7), model.model.embed_tokens)
    sampler = make_sampler(temp, top_p=top_p)
    filt = (lambda x: apply_top_p(x, top_p)) if top_p else (lambda x: x)
    likeliest = [int(np.argmax(target_probs(model, filt, temp, [2, x]))) for x in range(VOCAB)]
    prompt = [t for x in range(VOCAB) for t in (2, x, likeliest[x])] + [2]
    probs = first_three_token_probs(model, filt, temp, prompt)
    shape = BeamShape(2, 3, lookup=3)
    mx.random.seed(11)
    runs, counts, lookups = 1500, np.zeros((3, VOCAB)), 0
    for _ in range(runs):
        tokens, _, sources = decode_with(
            model, drafter if with_drafter else None, prompt, 3, shape, sampler
        )
        counts[np.arange(3), tokens] += 1
        lookups += bool({"lookup", "both"} & set(sources))
    assert lookups > 30  # lookup beams were accepted in many runs
    assert_drawn_from(counts, probs, runs)
