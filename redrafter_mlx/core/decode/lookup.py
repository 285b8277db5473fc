"""Prompt-lookup beams: continuations copied from earlier in the token history.

Legend: K lookup beams, L beam length (column 0 is the pending token), N history tokens.

Text that repeats what is already in the context (a summary of a pasted document, edited code,
a follow-up quoting the last answer) is predicted best by the context itself: where the last
``n`` tokens occurred before, the tokens that followed them then are a likely continuation now.
Each step proposes up to K such continuations, the most recent matches of the longest n-grams
first, down to single tokens, deduplicated. They are beams like the drafter's: the same tree
packs both sources (shared prefixes merge) and the same verify and acceptance rule checks them,
so output stays the target's own.

The index is incremental: every n-gram (n = 1..max_n) of the history maps to the positions
where it ended, appended as the history grows, so a step costs ``max_n`` dictionary reads and K
slices, not a scan of the history. It lives on the host, where the step's one read has just put
the accepted tokens; proposing makes no device work and no host read.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from redrafter_mlx.core.decode.source import Reading, Source

# The n-grams matched, longest first. Not single tokens: a 1-gram match proposes a beam on the
# strength of one token, and verifying those cost more than they gained on the tuning split
# (benchmarks/HISTORY.md, "Prompt-lookup beams").
MAX_NGRAM = 3
MIN_NGRAM = 2


class Lookup(Source):
    """Prompt lookup as a source: it reads nothing of the target and keeps nothing of its own
    (the n-gram index is the sequence's, committed and rewound with it). Its beams are made on
    the host from the pending token, so the speculative step adds them after its one read
    (:meth:`propose`, ``core/decode/speculative.py: with_lookup``) rather than drafting them before
    it."""

    kind = "lookup"

    def propose(self, sequence, pending: int, count: int, length: int) -> np.ndarray:
        """Up to ``count`` beams ``(k, length)`` int32 from ``pending`` (:meth:`NgramIndex.
        propose` over the sequence's committed tokens)."""
        return sequence.index.propose(pending, count, length)

    def draft(self, sequence, reading: Reading, *, width: int, length: int, **_) -> tuple:
        """Up to ``width`` beams ``(k, L)`` and their log-probs ``(k, L - 1)`` (0: a floor
        never prunes them), after one host read of the pending token."""
        pending = int(reading.pending.item())  # host read: the index lives on the host
        beams = self.propose(sequence, pending, width, length)
        return mx.array(beams), mx.zeros((len(beams), length - 1)), 1


class NgramIndex:
    """Where each n-gram of a growing token history ended, oldest first."""

    def __init__(
        self, tokens: list[int] = (), max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
    ):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-grams {min_ngram}..{max_ngram}: need 1 <= min <= max")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self._ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_ngram)]
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the history and index the n-grams that end in them."""
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                self._ends[n - 1].setdefault(tuple(self.tokens[end - n :]), []).append(end - 1)

    def rewind(self, length: int) -> None:
        """Drop the history after its first ``length`` tokens (and their n-grams)."""
        for end in range(len(self.tokens) - 1, length - 1, -1):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                key = tuple(self.tokens[end - n + 1 : end + 1])
                ends = self._ends[n - 1][key]
                ends.pop()  # positions were appended in order: ``end`` is the last
                if not ends:
                    del self._ends[n - 1][key]
        del self.tokens[length:]

    def propose(self, pending: int, count: int, length: int) -> np.ndarray:
        """Up to ``count`` distinct beams ``(k, length)`` int32 for the history followed by
        ``pending``: column 0 is ``pending``, the rest the tokens that followed the most recent
        earlier occurrences of the history's last n tokens (``pending`` included), for n from
        ``max_ngram`` down to ``min_ngram``. A match close to the end of the history continues
        with its own copy (a repeating span keeps repeating). ``(0, length)`` when nothing
        matches."""
        beams: dict[tuple[int, ...], None] = {}
        if count < 1 or length < 2:
            return np.zeros((0, max(length, 1)), np.int32)
        history = self.tokens + [int(pending)]
        for n in range(min(self.max_ngram, len(history)), self.min_ngram - 1, -1):
            ends = self._ends[n - 1].get(tuple(history[-n:]), ())
            for end in reversed(ends):  # most recent first
                beams.setdefault(_continuation(history, end, length - 1), None)
                if len(beams) == count:
                    return _as_beams(pending, beams, length)
        return _as_beams(pending, beams, length)


def _continuation(history: list[int], end: int, size: int) -> tuple[int, ...]:
    """``size`` tokens after position ``end`` of ``history``; past its end the span repeats
    (``history[end + 1:]`` is a period of the continuation)."""
    span = history[end + 1 :]
    return tuple(span[i % len(span)] for i in range(size))


def _as_beams(pending: int, continuations: dict, length: int) -> np.ndarray:
    """``(k, length)`` int32: ``pending`` then each continuation."""
    beams = np.empty((len(continuations), length), np.int32)
    beams[:, 0] = pending
    if continuations:
        beams[:, 1:] = list(continuations)
    return beams
