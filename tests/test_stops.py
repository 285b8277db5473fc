"""core/decode/stops.py: an answer ends at its first EOS token or where a stop string begins; text
that may begin a stop string is held back until later tokens complete or break it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from redrafter_mlx.core.decode.stops import (
    find_stop_string,
    first_stop,
    held_back,
    stop_at,
    through_stop,
)

STOPS = st.lists(st.text("abc", min_size=1, max_size=8), min_size=1, max_size=3).map(tuple)


def test_the_first_eos_ends_the_tokens():
    eos = {2, 7}
    assert first_stop([5, 7, 9, 2], eos) == 1
    assert first_stop([5, 9], eos) is None
    assert through_stop([5, 7, 9, 2], eos) == [5, 7]  # the EOS kept, what follows it dropped
    assert through_stop([5, 9], eos) == [5, 9]


def held_back_by_brute_force(text: str, stops: tuple[str, ...]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(st.text("ab", max_size=12), STOPS)
def test_the_text_held_back_is_the_longest_end_that_begins_a_stop_string(text, stops):
    assert held_back(text, stops) == held_back_by_brute_force(text, stops)


@settings(max_examples=200, deadline=None)
@given(st.text("abc", max_size=16), STOPS)
def test_text_once_shown_is_never_held_back_again(text, stops):
    """Each character added shows at least as much as before (a step never takes text back)."""
    shown = [len(text[:n]) - held_back(text[:n], stops) for n in range(len(text) + 1)]
    assert shown == sorted(shown)


def first_cut_piece_by_piece(pieces: list[str], stops: tuple[str, ...]):
    """``(before, text, cut)`` when the text, grown piece by piece as tokens grow it, first
    holds a stop string: the text's length before the last piece, the text, and where
    :func:`find_stop_string` says the stop string begins (None if it never does)."""
    text, before = "", 0
    for piece in pieces:
        before, text = len(text), text + piece
        cut = find_stop_string(text, stops, before)
        if cut is not None:
            return before, text, cut
    return before, text, None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("abc", min_size=1, max_size=3), max_size=8), STOPS)
def test_a_stop_string_across_pieces_is_found_with_the_piece_that_completes_it(pieces, stops):
    """Only the new end is searched each time, yet a stop string split over several pieces
    is found as soon as its last piece arrives, at its first place in the text so far."""
    before, text, cut = first_cut_piece_by_piece(pieces, stops)
    in_text = [text.find(s) for s in stops if s in text]
    assert cut == (min(in_text) if in_text else None)
    if cut is not None:  # not found a piece late: the text before held none
        assert not any(s in text[:before] for s in stops)


def test_the_stop_string_named_is_the_first_listed_of_those_at_the_cut():
    text = "one two; three"
    assert find_stop_string(text, (" three", ";", "; t"), 0) == 7
    assert stop_at(text, ("; t", ";"), 7) == "; t"
    assert stop_at(text, (";", "; t"), 7) == ";"


class CountedStop(str):
    """A stop string that counts the characters read from it (slices count their length)."""

    read = 0

    def __getitem__(self, index):
        got = str.__getitem__(self, index)
        CountedStop.read += len(got)
        return got


def test_a_long_stop_string_costs_host_work_linear_in_its_length():
    """Four stops of 20k characters: trying each beginning ``stop[:k]`` in turn reads ~2e8
    characters a step (seconds for 1M-character stops); the KMP walk builds one table per stop
    on the first step, then reads about two characters per character of the text's end."""
    length = 20_000
    stops = tuple(CountedStop(("ab" * length)[: length - 1] + c) for c in "wxyz")
    text = "answer: " + "ab" * 1000 + "a"
    CountedStop.read = 0
    assert held_back(text, stops) == 2001
    assert CountedStop.read <= 8 * 4 * length  # the tables: linear in the stops' lengths
    CountedStop.read = 0
    assert held_back(text + "b", stops) == 2002
    assert CountedStop.read <= 4 * 2 * len(text + "b")  # the tables are not built again
