"""What every decode step shares, whatever its mode: the decoding it runs (:class:`Decoding`),
what it emitted (:class:`Step`), the log-probs it reports, its phase timer and its one host
read.

Legend: n emitted tokens, k top log-probs, V vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from redrafter_mlx.core.decode.accept import Sampler, greedy, log_softmax
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape

PHASES = ("draft", "pack", "verify", "accept", "compact")


class SpentState(RuntimeError):
    """A decode state stepped after its sequence moved on (it was stepped already, or the
    sequence was rewound or fed since): each state is stepped once."""


@dataclass(frozen=True)
class Decoding:
    """What one generation runs: its mode, beam shape and sampler."""

    mode: Mode
    shape: BeamShape
    sampler: Sampler = greedy
    # Steps also return the target's log-probs of each emitted token (evaluated with the
    # step's one read: no extra host read, a log-softmax per emitted token more).
    logprobs: bool = False
    # Steps also return each emitted token's log-prob and the k most likely tokens' (k this,
    # 0 for none; None: off), picked on the device and read with the step's one read.
    top_logprobs: int | None = None

    @property
    def any_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs is not None


@dataclass
class Step:
    """What one decode step emitted, with its counters."""

    tokens: list[int]  # emitted tokens (accepted drafts + the target's own next token)
    tree_size: int = 1  # nodes verified (1 for an autoregressive step)
    syncs: int = 1  # host reads this step made (excluding timing evals)
    # Where the accepted drafts came from: "drafter", "lookup", "both" (a beam of each source
    # held them) or None (none accepted).
    accepted_from: str | None = None
    # (len(tokens), V): row i the target's log-probs the i-th token was chosen from (with
    # ``Decoding.logprobs``, else None)
    logprobs: mx.array | None = None
    top_logprobs: TopLogprobs | None = None  # with ``Decoding.top_logprobs``, else None


@dataclass(frozen=True)
class TopLogprobs:
    """What a server reports of ``n`` emitted tokens, read to the host: each token's log-prob
    ``logprob (n,)`` and the ``k`` most likely tokens' ids ``ids (n, k)`` and log-probs
    ``logprobs (n, k)``, most likely first."""

    logprob: np.ndarray
    ids: np.ndarray
    logprobs: np.ndarray

    @classmethod
    def read(cls, arrays: tuple[mx.array, ...] | None, n: int | None = None):
        """The host copy of :func:`top_logprobs`' arrays, already evaluated (by the step's
        read: no new evaluation), their first ``n`` rows; None for None."""
        if arrays is None:
            return None
        return cls(*(np.array(a)[:n] for a in arrays))

    def __getitem__(self, rows: slice) -> TopLogprobs:
        return TopLogprobs(self.logprob[rows], self.ids[rows], self.logprobs[rows])


class PhaseTimer:
    """Per-phase wall time. When enabled it *evaluates* at phase boundaries (extra syncs) so
    that each phase's work is attributed to it; when disabled it costs nothing."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._t = 0.0

    def start(self) -> None:
        if self.enabled:
            self._t = time.perf_counter()

    def mark(self, phase: str, *arrays) -> None:
        if self.enabled:
            mx.eval(*arrays)
            now = time.perf_counter()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._t
            self._t = now


@dataclass(frozen=True)
class Emitted:
    """The log-probs a step reports of its tokens, lazily (each None when not asked for):
    ``rows (n, V)`` the target's log-probs each token was chosen from, ``top`` the arrays of
    :func:`top_logprobs`."""

    rows: mx.array | None = None
    top: tuple[mx.array, ...] | None = None

    def arrays(self) -> tuple[mx.array, ...]:
        """What to evaluate with the step's read."""
        return tuple(a for a in (self.rows, *(self.top or ())) if a is not None)

    def read(self, tokens: list[int], n: int | None = None, **counters) -> Step:
        """The step emitting ``tokens``, with the first ``n`` rows of these log-probs (already
        evaluated by the step's read)."""
        rows = None if self.rows is None else self.rows[:n]
        return Step(tokens, logprobs=rows, top_logprobs=TopLogprobs.read(self.top, n), **counters)


def emitted_logprobs(decoding: Decoding, logits: mx.array, tokens: mx.array | None) -> Emitted:
    """What ``decoding`` asks for of the tokens ``tokens (n,)`` chosen from ``logits (n, V)``,
    lazily."""
    if not decoding.any_logprobs:
        return Emitted()
    rows = log_softmax(logits)
    k = decoding.top_logprobs
    return Emitted(
        rows if decoding.logprobs else None, None if k is None else top_logprobs(rows, tokens, k)
    )


def top_logprobs(logprobs: mx.array, tokens: mx.array, k: int) -> tuple[mx.array, ...]:
    """``logprobs (n, V)`` and the tokens chosen from them ``tokens (n,)`` -> their log-probs
    ``(n,)``, the ``k`` most likely ids ``(n, k)`` and their log-probs ``(n, k)``, most likely
    first, lazily (a partition over V on the device: only ``n * (2k + 1)`` numbers to read)."""
    chosen = mx.take_along_axis(logprobs, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
    if not k:
        return chosen, mx.zeros((len(tokens), 0), mx.int32), mx.zeros((len(tokens), 0))
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return chosen, mx.take_along_axis(ids, order, -1), mx.take_along_axis(values, order, -1)


def host_read(*values: mx.array, evaluated=()) -> np.ndarray | tuple[np.ndarray, ...]:
    """The one place a decode step reads device values back to the host (one evaluation, of
    ``evaluated``'s arrays too, which stay on the device)."""
    mx.eval(*values, *evaluated)
    arrays = tuple(np.array(v) for v in values)
    return arrays[0] if len(arrays) == 1 else arrays
