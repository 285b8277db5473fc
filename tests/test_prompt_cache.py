"""core/serving/prompt_cache.py: several conversations' sessions for one server. A request gets the
session whose last prompt it extends (the one sharing most), else a new one while there is
room, else the least recently used one; byte bounds drop the least recently used first."""

from __future__ import annotations

import pytest
from support import decoder_for, decoding_of, toy_tokenizer

from redrafter_mlx.core.serving.prompt_cache import TAIL, PromptCache, session_bytes
from redrafter_mlx.core.serving.session import Session

A = [5, 6, 7, 8, 9, 12, 13]
B = [40, 41, 42, 43, 44, 45]


@pytest.fixture
def new_session(target):
    def new() -> Session:
        return Session(decoder_for(target), toy_tokenizer(), decoding_of(), warm=False)

    return new


def turn(cache: PromptCache, ids: list[int], max_tokens: int = 6) -> Session:
    """One request: the session taken, the answer generated on it, then the byte bound."""
    session = cache.take(ids)
    for _ in session.generate(ids, max_tokens=max_tokens):
        pass
    cache.trim()
    return session


def test_a_request_extending_a_conversation_gets_its_session_back(new_session):
    cache = PromptCache(new_session, max_sessions=4)
    a, b = turn(cache, A), turn(cache, B)
    assert a is not b and cache.sessions == [a, b]  # most recent last
    assert cache.take([*a.sequence.ids, 10, 11]) is a
    assert cache.sessions == [b, a]


def test_a_resent_history_may_end_differently_but_only_in_its_last_tokens(new_session):
    """A client resends the answer as text, which need not tokenize back into the tokens
    generated, and a template may end the prompt differently: a request extends a session
    when it begins with that session's last prompt but for at most TAIL tokens (and at most
    half of it), and a new turn follows."""
    cache = PromptCache(new_session, max_sessions=4)
    prompt = [5 + i % 40 for i in range(3 * TAIL)]
    a = turn(cache, prompt)
    turn_ = [60 + i for i in range(2 * TAIL)]  # the tail anew, the answer and a new message
    other = cache.take([*prompt[: -TAIL - 1], *turn_])  # one token more differs: not ``a``
    assert other is not a and len(cache.sessions) == 2
    assert cache.take([*prompt[:-TAIL], *turn_]) is a


def test_a_prompt_differing_only_in_its_last_words_is_another_conversation(new_session):
    """A request like "Tell me about cats." after "Tell me about dogs.": the same length, all
    but the tail shared, yet no answer and new turn follow: a session of its own, and ``a``'s
    left intact."""
    cache = PromptCache(new_session, max_sessions=4)
    prompt = [5 + i % 40 for i in range(3 * TAIL)]
    a = turn(cache, prompt)
    sibling = turn(cache, [*prompt[:-3], 60, 61, 62])
    assert sibling is not a and a.sequence.shared_prefix(prompt) == len(prompt)
    assert cache.take([*prompt[:-2], *range(70, 70 + 2 * TAIL)]) is a  # its follow-up


def test_a_prompt_whose_last_message_grew_continues_its_conversation(new_session):
    """Claude Code's ``--continue`` appends its text to the last user message: the request
    is the last prompt with a few tokens put in before the template's tail (its first token
    may merge with them), shorter than a new turn, and still that conversation's."""
    message, tail = [5 + i % 40 for i in range(3 * TAIL)], [50, 51, 52, 53]
    grown = [*message, 70, 71, *tail]  # two tokens more: under TAIL
    merged = [*message, 72, 73, *tail[1:]]  # the tail's first token merged with the new text
    assert len(grown) < len(message) + len(tail) + TAIL
    for request in (grown, merged):
        cache = PromptCache(new_session, max_sessions=4)
        a, b = turn(cache, [*message, *tail]), turn(cache, B)
        assert cache.take(request) is a and cache.sessions == [b, a]
    replaced = [*message[:-2], 70, 71, *tail]  # its last words changed: no growth
    cache = PromptCache(new_session, max_sessions=4)
    a = turn(cache, [*message, *tail])
    assert cache.take(replaced) is not a


def test_a_request_sharing_nearly_all_of_a_session_takes_it_whatever_its_length(new_session):
    """A long conversation whose request differs in its last tokens (an edited last message,
    a shorter retry): re-reading the shared tokens costs far more than what the session's
    conversation loses (its tail and answer), so it is reused; a short one keeps apart."""
    cache = PromptCache(new_session, max_sessions=4)
    prompt = [5 + i % 40 for i in range(20 * TAIL)]
    a = turn(cache, prompt, max_tokens=4)
    assert cache.take([*prompt[:-3], 60, 61, 62]) is a  # the same length, last words changed
    assert cache.take([*prompt[:-3], 60]) is a  # shorter
    assert len(cache.sessions) == 1


def test_a_short_prompt_is_not_extended_by_a_shared_first_token(new_session):
    cache = PromptCache(new_session, max_sessions=4)
    a = turn(cache, A)
    assert cache.take([A[0], 60, 61, 62]) is not a  # more than half of A differs


def test_of_the_conversations_a_request_extends_the_one_sharing_most_is_taken(new_session, target):
    """Two conversations whose last prompts a request both begins with: the longer one
    shared is taken, whichever was used last."""
    scratch = new_session()
    for _ in scratch.generate(A, max_tokens=4):
        pass
    short_ids = list(scratch.sequence.ids)  # what a conversation of prompt A caches
    cache = PromptCache(new_session, max_sessions=4)
    long = turn(cache, short_ids + B + B, max_tokens=4)
    short = turn(cache, A, max_tokens=4)  # begins with no session's last prompt: a new one
    assert short is not long and list(short.sequence.ids) == short_ids
    assert cache.take([*long.sequence.ids, 60]) is long  # extends both: shares most with long
    assert cache.take([*short.sequence.ids, 60]) is short  # extends only short
    assert cache.take([*long.sequence.ids, 61]) is long  # not the more recent short


def test_without_room_the_least_recently_used_session_answers_from_what_it_shares(
    new_session, target
):
    cache = PromptCache(new_session, max_sessions=2)
    a, b = turn(cache, A), turn(cache, B)
    turn(cache, [*a.sequence.ids, 10])  # ``a`` used again: ``b`` is the least recent
    c = B[:3] + [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]  # shares B's first 3, extends none
    got = cache.take(c)
    assert got is b and cache.sessions == [a, b]
    answer = [t for r in got.generate(c, max_tokens=6) for t in r.tokens]
    assert got.reused == 3
    fresh = Session(decoder_for(target), toy_tokenizer(), decoding_of(), warm=False)
    assert answer == [t for r in fresh.generate(c, max_tokens=6) for t in r.tokens]


def test_the_byte_bound_drops_the_least_recently_used_and_keeps_the_one_in_use(new_session):
    cache = PromptCache(new_session, max_sessions=4)
    sessions = [turn(cache, ids) for ids in (A, B, [30, 31, 32])]
    sizes = [session_bytes(s) for s in sessions]
    assert all(size > 0 for size in sizes)  # K/V of every layer, allocated for the turn
    assert cache.cached_bytes == sum(sizes)
    cache.max_bytes = sum(sizes) - 1
    cache.trim()
    assert cache.sessions == sessions[1:]
    assert cache.cached_bytes == sum(sizes[1:])
    cache.max_bytes = 0
    cache.trim()
    assert cache.sessions == sessions[2:]  # the one in use stays, whatever its size


def test_a_session_s_bytes_follow_its_cache_as_it_grows(new_session):
    session = new_session()
    assert session_bytes(session) == 0  # nothing allocated before the first prompt
    for _ in session.generate(A, max_tokens=4):
        pass
    small = session_bytes(session)
    for _ in session.generate([5 + i % 50 for i in range(300)], max_tokens=4):
        pass
    assert session_bytes(session) > small  # the capacity grew for the longer prompt


@pytest.mark.parametrize(
    "bounds,message",
    [({"max_sessions": 0}, "prompt cache size 0"), ({"max_bytes": -1}, "prompt cache bytes -1")],
)
def test_bounds_no_cache_can_keep_are_refused(new_session, bounds, message):
    with pytest.raises(ValueError, match=message):
        PromptCache(new_session, **bounds)
