"""Where an answer ends: at its first EOS token, or where a stop string begins in its text.

Generation (:mod:`redrafter_mlx.core.decode.stream`) drops the EOS token from what it returns; the
evaluators (:mod:`redrafter_mlx.training.evaluate`) keep it in the ids they compare. Both find
the end here. Stop strings are looked for in the text as it grows; its end that may begin one
is held back until the next tokens complete or break it.
"""

from __future__ import annotations

import functools
from collections.abc import Container, Sequence


def first_stop(tokens: Sequence[int], eos: Container[int]) -> int | None:
    """Index of the first EOS token of ``tokens (n,)``; None when there is none."""
    return next((i for i, token in enumerate(tokens) if token in eos), None)


def through_stop(tokens: list[int], eos: Container[int]) -> list[int]:
    """``tokens`` up to and with the first EOS token (all of them when there is none)."""
    stop = first_stop(tokens, eos)
    return tokens if stop is None else tokens[: stop + 1]


def find_stop_string(text: str, stop_strings: tuple[str, ...], since: int) -> int | None:
    """Start of the first stop string in ``text`` that ends after position ``since``."""
    hits = [text.find(s, max(since - len(s) + 1, 0)) for s in stop_strings]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else None


def stop_at(text: str, stop_strings: tuple[str, ...], cut: int) -> str:
    """The stop string found at ``cut`` (the first listed, when several begin there)."""
    return next(s for s in stop_strings if text.startswith(s, cut))


def held_back(text: str, stop_strings: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins a stop string (held back: the next
    tokens may complete it). Host work per call is linear in the stops' lengths."""
    return max((_overlap(text, s) for s in stop_strings), default=0)


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``stop``: a KMP walk
    over ``text``'s last ``len(stop) - 1`` characters, O(len(stop)). (Trying each beginning
    ``stop[:k]`` in turn copies and compares O(len(stop)**2) characters: seconds per step for
    a stop string of 10**5 characters.)"""
    if not text or text[-1] not in stop:  # the common case, at C speed
        return 0
    failure = _failure_table(stop)
    matched = 0  # characters of stop matched by the end of the text read so far
    for char in text[max(len(text) - len(stop) + 1, 0) :]:
        while matched and stop[matched] != char:
            matched = failure[matched - 1]
        matched += stop[matched] == char
    return matched  # < len(stop): at most len(stop) - 1 characters were read


@functools.lru_cache(maxsize=64)
def _failure_table(stop: str) -> tuple[int, ...]:
    """KMP's prefix function: entry i is the length of the longest proper beginning of
    ``stop[: i + 1]`` that is also its end. Built once per stop string (stops repeat)."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        k += stop[i] == stop[k]
        table[i] = k
    return tuple(table)
