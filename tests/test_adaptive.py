"""Adaptive speculation past a context length (core/decode/adaptive.py): the policy's choice from
measured speeds, and answers that switch between speculative and plain steps mid-answer,
which stay the target's own tokens (greedy: token for token; log-probs alike)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from support import decoder_for, decoding_of, tiny_llama, toy_tokenizer
from support.decoding import autoregressive, take
from support.families import build, mlx_lm_greedy

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN
from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.adaptive import Adaptive
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.stream import decode_steps
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import random_drafter
from redrafter_mlx.core.serving.session import Session
from redrafter_mlx.tuning import profiles

SHAPE = BeamShape(2, 3, lookup=1)
PROMPT = [5, 1, 3, 2, 4, 1, 3, 2]


class Scripted(Adaptive):
    """A policy that speculates by a fixed pattern of steps, whatever the timings."""

    def __init__(self, speculative, plain, pattern):
        super().__init__(speculative, plain, start=0)
        self.pattern, self.asked = pattern, 0

    def speculate(self, context: int) -> bool:
        self.asked += 1
        return self.pattern[(self.asked - 1) % len(self.pattern)]


def switching(model, drafter, pattern, *, plan=GENERIC_PLAN, start_plain=False, **fields):
    decoder = decoder_for(model, drafter, plan)
    spec = replace(decoding_of(drafter, SHAPE), **fields)
    plain = replace(spec, mode=Mode.AUTOREGRESSIVE)
    policy = Scripted(spec, plain, pattern)
    first = plain if start_plain else spec
    return decode_steps(decoder, decoder.new_sequence(), PROMPT, first, adaptive=policy)


@pytest.fixture(scope="module")
def pair():
    model = tiny_llama(seed=3, vocab=8)
    return model, BeamDrafter(random_drafter(64, 8, seed=4), model.model.embed_tokens)


@pytest.mark.parametrize("plan", [GENERIC_PLAN, CPU_PLAN], ids=["generic", "cpu"])
@pytest.mark.parametrize(
    "pattern,start_plain",
    [((True, False), False), ((False, True), True), ((True, True, True, False, False), True)],
)
def test_switching_modes_mid_answer_keeps_the_greedy_answer(pair, plan, pattern, start_plain):
    """Steps alternating between the tree and plain decoding, from either first state, emit
    exactly the autoregressive tokens; both kinds of step ran, and drafts were accepted."""
    model, drafter = pair
    want = autoregressive(model, PROMPT, 48)
    steps, tokens = [], []
    for step in switching(model, drafter, pattern, plan=plan, start_plain=start_plain):
        steps.append(step)
        tokens += step.tokens
        if len(tokens) >= 48:
            break
    assert tokens[:48] == want
    sizes = {step.tree_size for step in steps[1:]}
    assert 1 in sizes and max(sizes) > 1
    assert any(len(step.tokens) > 1 for step in steps)


def test_switching_keeps_each_tokens_log_probs(pair):
    """Log-probs of the emitted tokens, step by step, are those plain decoding reports."""
    model, drafter = pair
    decoder = decoder_for(model)
    plain = replace(decoding_of(None, None, autoregressive=True), logprobs=True)
    want = []
    for step in decode_steps(decoder, decoder.new_sequence(), PROMPT, plain):
        want += list(np.array(step.logprobs))
        if len(want) >= 30:
            break
    got = []
    for step in switching(model, drafter, (True, False, False), logprobs=True):
        got += list(np.array(step.logprobs))
        if len(got) >= 30:
            break
    np.testing.assert_allclose(np.stack(got[:30]), np.stack(want[:30]), atol=1e-4)


def test_a_hybrid_switches_modes_and_keeps_its_answer():
    """Gated DeltaNet layers keep the state of what each mode committed: mlx-lm's tokens."""
    model = build("qwen3_5")
    hidden, vocab = llm.target_dims(model)
    drafter = BeamDrafter(random_drafter(hidden, vocab, seed=1), llm.embedding(model))
    want = mlx_lm_greedy(model, PROMPT, 24)
    got = take(switching(model, drafter, (True, False, True, True, False)), 24)[0]
    assert got == want


def test_a_drafter_with_a_part_per_sequence_is_refused(pair):
    model, _ = pair
    decoder = decoder_for(model)

    class Parted:  # what drafting.new_part asks of such a drafter
        def new_part(self):
            return object()

    state, _ = decoder.prefill(decoder.new_sequence(), PROMPT, decoding_of(None, SHAPE))
    with pytest.raises(ValueError, match="part per sequence"):
        replace(decoder, drafter=Parted()).switch(state, decoding_of(None, autoregressive=True))


def policy(**options) -> Adaptive:
    spec = decoding_of(None, SHAPE)
    return Adaptive(spec, replace(spec, mode=Mode.AUTOREGRESSIVE), start=1000, **options)


def run_blocks(adaptive, context, blocks, tokens_per_second):
    """Feed ``blocks`` blocks at ``context``, each step emitting 1 s of its mode's speed ->
    the mode of each block."""
    modes = []
    for _block in range(blocks):
        for _step in range(adaptive.block):
            speculated = adaptive.speculate(context)
            adaptive.record(context, speculated, tokens_per_second[speculated], 1.0)
        modes.append(speculated)
    return modes


def test_the_policy_tries_both_then_keeps_the_faster_and_explores():
    """A new band runs a plain block, then a tree block, then the faster one, and the other
    at the ``explore``-th block (its first two counted); below ``start`` every step
    speculates."""
    adaptive = policy(block=4, explore=4)
    assert all(adaptive.speculate(999) for _ in range(20))
    modes = run_blocks(adaptive, 1500, 12, {True: 1.5, False: 1.0})
    assert modes == [False, True, True, False] + [True] * 7 + [False]
    assert adaptive.decoding(1500) is adaptive.speculative
    slower = policy(block=4, explore=4)
    modes = run_blocks(slower, 3000, 6, {True: 0.8, False: 1.0})
    assert modes == [False, True, False, True, False, False]
    assert slower.decoding(3000) is slower.plain
    assert slower.decoding(5000) is slower.plain  # a band not seen yet starts plainly
    assert slower.decoding(10) is slower.speculative


def test_the_policy_follows_a_change_in_speed():
    """Measured speeds decay: when the tree turns faster, the next exploring block finds it,
    and from there the tree runs (plain decoding explored in its turn)."""
    adaptive = policy(block=4, explore=4)
    run_blocks(adaptive, 1500, 8, {True: 0.8, False: 1.0})
    modes = run_blocks(adaptive, 1500, 8, {True: 2.0, False: 1.0})
    assert modes == [False, False, False, True, True, True, True, False]


def test_the_slower_mode_runs_less_often_while_it_stays_slower():
    """Each exploring block that finds the other mode still slower doubles the wait before
    the next, up to ``explore_max`` blocks; a band keeps its own waits."""
    adaptive = policy(block=2, explore=4, explore_max=16)
    modes = run_blocks(adaptive, 1500, 60, {True: 0.8, False: 1.0})
    assert [i for i, speculated in enumerate(modes) if speculated] == [1, 3, 11, 27, 43, 59]
    modes = run_blocks(adaptive, 2500, 12, {True: 0.8, False: 1.0})
    assert [i for i, speculated in enumerate(modes) if speculated] == [1, 3, 11]


def test_the_tree_must_be_faster_by_the_margin():
    """Past ``start`` the tree replaces plain decoding only where it measured more than
    ``margin`` faster: at 1.05x plain decoding keeps running, at 1.15x the tree takes over."""
    close = policy(block=2, explore=4, margin=0.1)
    modes = run_blocks(close, 1500, 12, {True: 1.05, False: 1.0})
    assert modes == [False, True, False, True] + [False] * 7 + [True]
    assert close.decoding(1500) is close.plain
    ahead = policy(block=2, explore=4, margin=0.1)
    assert run_blocks(ahead, 1500, 3, {True: 1.15, False: 1.0})[2]
    assert ahead.decoding(1500) is ahead.speculative


def test_a_session_with_the_default_shape_adapts_past_plain_from(pair):
    """follow_context with the plan's default bands gives the session a policy from
    ``plain_from`` on: a long answer there runs plain and tree steps and gives the plain
    answer's tokens; an explicit decoding, or a shape from flags, never adapts."""
    model, drafter = pair
    decoder = decoder_for(model, drafter)
    spec = decoding_of(drafter, SHAPE)
    plain = replace(spec, mode=Mode.AUTOREGRESSIVE)
    with_cut = SimpleNamespace(plan=replace(GENERIC_PLAN, plain_from=300), decoder=decoder)
    session = Session(decoder, toy_tokenizer(), spec, warm=False)
    profiles.follow_context(session, with_cut, "default")
    assert session.adaptive is not None and session.adaptive.start == 300
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 8, size=350)]
    want = take(decode_steps(decoder, decoder.new_sequence(), prompt, plain), 60)[0]
    responses = list(session.generate(prompt, max_tokens=60))
    assert [t for r in responses for t in r.tokens] == want
    sizes = responses[-1].stats.tree_sizes
    assert 1 in sizes and max(sizes) > 1
    explicit = list(session.generate(prompt, max_tokens=20, decoding=plain))
    assert set(explicit[-1].stats.tree_sizes) == {1}
    flags = Session(decoder, toy_tokenizer(), spec, warm=False)
    profiles.follow_context(flags, with_cut, "flags")
    assert flags.adaptive is None
