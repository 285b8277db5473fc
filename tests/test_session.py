"""core/serving/session.py: a conversation over one decoder. Each turn reuses the longest cached
prefix and answers as a fresh cache would; a decoding change is checked, then warmed up; an answer
stopped early (closed, or cancelled during its prompt) leaves the conversation usable."""

from __future__ import annotations

import pytest
from support import decoder_for, decoding_of, toy_tokenizer

from redrafter_mlx.core.decode.accept import make_sampler
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.plan import Plan
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.serving.session import Session

FIRST = [5, 6, 7, 8, 9]


def new_session(target, drafter=None, shape=None, **kwargs) -> Session:
    """A session over the tiny target, autoregressive without a drafter."""
    decoder = decoder_for(target, drafter, kwargs.pop("plan", None))
    return Session(decoder, toy_tokenizer(), decoding_of(drafter, shape), warm=False, **kwargs)


def answer(session: Session, ids: list[int], max_tokens: int = 8, **kwargs) -> list[int]:
    return [t for r in session.generate(ids, max_tokens=max_tokens, **kwargs) for t in r.tokens]


def fresh(target, ids: list[int], max_tokens: int = 8) -> list[int]:
    """The autoregressive answer from an empty cache."""
    return answer(new_session(target), ids, max_tokens)


@pytest.fixture(scope="module")
def beams(target, drafter):
    return BeamDrafter(drafter, target.model.embed_tokens)


def test_a_next_turn_feeds_only_its_new_tokens_and_answers_as_from_scratch(target):
    session = new_session(target)
    first = answer(session, FIRST)
    assert session.reused == 0 and len(first) == 8
    turn = FIRST + first + [10, 11]
    responses = list(session.generate(turn, max_tokens=8))
    # the whole first turn: autoregressive steps are pipelined, so the answer's last token
    # was fed while the token after it was computed (and never emitted)
    assert session.reused == len(FIRST) + len(first)
    assert responses[0].stats.prompt_tokens == len(turn) - session.reused
    assert [t for r in responses for t in r.tokens] == fresh(target, turn)


def test_a_prompt_that_leaves_the_conversation_rewinds_to_what_it_shares(target):
    session = new_session(target)
    answer(session, FIRST + [12, 13, 14])
    other = FIRST[:3] + [40, 41, 42]
    assert answer(session, other) == fresh(target, other)
    assert session.reused == 3
    session.reset()
    assert answer(session, other) == fresh(target, other) and session.reused == 0


def test_a_shape_change_is_checked_then_answers_stay_exact(target, beams):
    session = new_session(target, beams, BeamShape(2, 3))
    want = fresh(target, FIRST, 12)
    assert answer(session, FIRST, 12) == want
    session.change(shape=BeamShape(3, 4))
    assert session.decoding.shape == BeamShape(3, 4)
    session.reset()
    assert answer(session, FIRST, 12) == want
    plain = new_session(target)
    with pytest.raises(ValueError, match="needs a drafter"):
        plain.change(mode=Mode.REDRAFTER, shape=BeamShape(2, 3))
    assert plain.decoding.mode is Mode.AUTOREGRESSIVE  # refused: nothing changed


def test_seeded_sessions_draw_the_same_answer_after_a_sampler_change(target):
    answers = []
    for _ in range(2):
        session = new_session(target, seed=3)
        session.change(sampler=make_sampler(1.0))  # warms up, then re-seeds
        answers.append(answer(session, FIRST, 12))
    assert answers[0] == answers[1]
    assert answers[0] != fresh(target, FIRST, 12)  # drawn, not the greedy answer


def test_an_answer_closed_early_leaves_a_conversation_that_goes_on(target, beams):
    session = new_session(target, beams, BeamShape(2, 3))
    steps = session.generate(FIRST, max_tokens=40)
    kept = [t for _, r in zip(range(3), steps, strict=False) for t in r.tokens]
    steps.close()  # the caller stops reading: a client gone, Ctrl-C
    turn = FIRST + kept + [10]
    assert answer(session, turn, 12) == fresh(target, turn, 12)
    assert session.reused >= len(FIRST)


def test_a_prompt_cancelled_between_chunks_answers_nothing_and_keeps_the_chunks_fed(target):
    session = new_session(target, plan=Plan(prefill_chunk=8))
    prompt = [5 + i % 50 for i in range(40)]  # five chunks
    asked = []

    def cancelled() -> bool:  # asked between chunks: yes the second time, after two chunks
        asked.append(1)
        return len(asked) == 2

    assert list(session.generate(prompt, cancelled=cancelled)) == []
    assert answer(session, prompt) == fresh(target, prompt)
    assert session.reused == 16  # the two chunks fed before it was cancelled
