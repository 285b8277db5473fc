"""What the speculative step drafts from: the :class:`Source` protocol and the :class:`Reading`
a verify forward (or a prompt) leaves for it.

Legend: W beams, L beam length, T forward rows, n path rows, H hidden.

A source proposes beams ``(W, L)`` (column 0 the pending token) and their drafted tokens'
log-probs ``(W, L - 1)`` (what the shape's floor prunes by). ReDrafter's RNN
(:class:`~redrafter_mlx.core.draft.BeamDrafter`) reads only the final hidden state of the last
accepted token; EAGLE-3 reads several target layers (``taps``) along every accepted token and
keeps its own K/V per sequence (a :class:`~redrafter_mlx.core.sequence.Part`, committed and
rewound with the sequence). The step's order for any source::

    verify (taps filled) -> accept -> observe(sequence, taps, path) -> stage -> draft(reading)
    -> the step's one host read -> sequence.commit(accepted)   # the part commits with it

Whatever a source proposes, acceptance stays exact: a draft is accepted iff it equals the
target's own draw at its parent (``core/accept.py``), which holds for any proposal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from redrafter_mlx.core.sequence import Part, Sequence


@dataclass(frozen=True)
class Reading:
    """What a forward leaves a drafter, lazily.

    ``context (H,)`` the final hidden state of the last token that joins the sequence (what
    predicted ``pending ()``, the token the beams start from); ``path (n,)`` the forward's
    rows that join the sequence in order (a step's accepted path; none after a prompt, whose
    rows were committed as they were fed), ``tokens (n,)`` their tokens, ``count ()`` how many
    of them join (later rows were not accepted).
    """

    context: mx.array
    pending: mx.array
    path: mx.array
    tokens: mx.array
    count: mx.array

    @classmethod
    def after_prompt(cls, context: mx.array, pending: mx.array) -> Reading:
        empty = mx.zeros((0,), mx.int32)
        return cls(context, pending, empty, empty, mx.array(0, mx.int32))

    def following(self) -> mx.array:
        """The token after each path row ``(n,)``: the next row's token, then ``pending``
        after the last row that joins (rows past it get ``pending`` too: never used)."""
        n = self.path.shape[0]
        shifted = mx.concatenate([self.tokens[1:], self.pending.reshape(1)]).astype(mx.int32)
        return mx.where(mx.arange(n) >= self.count - 1, self.pending.astype(mx.int32), shifted)


class Source(Protocol):
    """A drafter the speculative step drafts from."""

    taps: tuple[int, ...]  # target layers whose outputs it reads (empty: the final hidden only)

    def new_part(self) -> Part | None:
        """Its per-sequence state (None: it keeps none)."""

    def observe(self, sequence: Sequence, taps: dict[int, mx.array], rows: mx.array) -> None:
        """Stage what it keeps of a forward's ``rows (n,)`` (in the order they join the
        sequence; the next commit takes as many as it commits), from ``taps`` (T, H)."""

    def draft(self, sequence: Sequence, reading: Reading, **options) -> tuple:
        """``(beams (W, L), token_logprobs (W, L - 1), host reads made)`` for ``options``
        (``width``, ``length``, ``min_prob``, ``search_width``), lazily."""

    def warm_up(self, context: mx.array, pending: mx.array, **options) -> None: ...


def taps_of(drafter) -> tuple[int, ...]:
    """The target layers ``drafter`` reads (none for a drafter without ``taps``)."""
    return tuple(getattr(drafter, "taps", ()))


def new_part(drafter) -> Part | None:
    make = getattr(drafter, "new_part", None)
    return None if make is None else make()


def prunes(drafter) -> bool:
    """Whether ``drafter``'s beams hold positions to prune (token -1 at log-prob -inf: a
    best-first tree's beams end where their node does), so the step reads their log-probs."""
    return bool(getattr(drafter, "prunes", False))


def check_shape(drafter, shape) -> None:
    """ValueError (one line) when ``drafter`` cannot draft beams of ``shape``."""
    check = getattr(drafter, "check_shape", None)
    if check is not None:
        check(shape)


def observe(drafter, sequence: Sequence, taps: dict, rows: mx.array) -> None:
    """Hand ``drafter`` a forward's tapped states of ``rows`` (nothing for a drafter without
    per-sequence state)."""
    if drafter is not None and getattr(drafter, "observe", None) is not None:
        drafter.observe(sequence, taps, rows)


def draft(drafter, sequence: Sequence, reading: Reading, options: dict) -> tuple:
    """``drafter``'s beams, log-probs and host reads from ``reading``. A drafter that reads
    only the last hidden state may have just ``search(context, pending, **options)``."""
    if getattr(drafter, "draft", None) is not None:
        return drafter.draft(sequence, reading, **options)
    return drafter.search(reading.context, reading.pending, **options)
