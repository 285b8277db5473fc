"""The drafter interface: :class:`Source`, what every drafter type is to the decode step, and
the :class:`Reading` a verify forward (or a prompt) leaves it.

Legend: W beams, L beam length, T forward rows, n path rows, H hidden.

A source proposes beams ``(W, L)`` (column 0 the pending token) and their drafted tokens'
log-probs ``(W, L - 1)`` (what the shape's floor prunes by). What it reads from the target is
its ``taps``: none (ReDrafter's RNN, :class:`~redrafter_mlx.core.drafters.beam_search.BeamDrafter`,
reads only the final hidden state of the last accepted token; prompt lookup reads nothing) or
several layers' outputs along every accepted token (EAGLE-3, DFlash, MTP), which it keeps per
sequence in a :class:`~redrafter_mlx.core.decode.sequence.Part` committed and rewound with the
sequence. The step's order for any source::

    verify (taps filled) -> accept -> observe(sequence, taps, path) -> stage -> draft(reading)
    -> the step's one host read -> sequence.commit(accepted)   # the part commits with it

Whatever a source proposes, acceptance stays exact: a draft is accepted iff it equals the
target's own draw at its parent (``core/decode/accept.py``), which holds for any proposal.

A new drafter type is one module and one factory line: a module with a :class:`Source`
subclass (``kind``, ``draft`` and what it needs of the rest), and a line in
``io/field_drafters.create_drafter`` that recognises its folders. Nothing else asks which type
a drafter is: the step, the batch and the service ask the source itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:  # annotations only: the sequence imports the lookup source, a Source
    from redrafter_mlx.core.decode.sequence import Part, Sequence


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


class Source(ABC):
    """A drafter the speculative step drafts from (module docstring). Subclasses set ``kind``
    and implement :meth:`draft`; the rest defaults to a drafter that reads only the final
    hidden state, keeps nothing per sequence and drafts any shape."""

    kind: str  # its type's name, as ``--json`` and banners say it ("redrafter", "eagle3", ...)
    taps: tuple[int, ...] = ()  # target layers whose outputs it reads (none: the final hidden)
    prunes = False  # its beams end early (token -1 at log-prob -inf): the step reads log-probs
    batch_fits = False  # a batch may draft for it at a smaller shape than asked (batch.fitted)

    def new_part(self) -> Part | None:
        """Its per-sequence state, committed and rewound with the sequence (None: none)."""
        return None

    def observe(self, sequence: Sequence, taps: dict[int, mx.array], rows: mx.array) -> None:
        """Stage what it keeps of a forward's ``rows (n,)`` (in the order they join the
        sequence; the next commit takes as many as it commits), from ``taps`` (T, H)."""
        return None  # it keeps nothing per sequence

    def fit_default(self, shape):
        """The plan's default shape for this type (``Plan.shape_for``), fitted to this drafter
        (a DFlash drafter's block size bounds its tree)."""
        return shape

    def check_shape(self, shape) -> None:
        """ValueError (one line) when it cannot draft beams of ``shape``."""
        return None  # it drafts any shape

    @abstractmethod
    def draft(self, sequence: Sequence, reading: Reading, **options) -> tuple:
        """``(beams (W, L), token_logprobs (W, L - 1) or None, host reads made)`` for
        ``options`` (``width``, ``length``, ``min_prob``, ``search_width``), lazily."""

    def warm_up(self, context: mx.array, pending: mx.array, **options) -> None:
        """Trace what a draft of ``options`` compiles (nothing for an eager drafter)."""
        return None  # it runs eagerly: nothing to trace


class SearchSource(Source):
    """A source that drafts from the reading's final hidden state alone: :meth:`search`."""

    @abstractmethod
    def search(self, context: mx.array, pending: mx.array, **options) -> tuple:
        """``context (..., H)``, ``pending (...)`` -> :meth:`Source.draft`'s triple."""

    def draft(self, sequence: Sequence, reading: Reading, **options) -> tuple:
        return self.search(reading.context, reading.pending, **options)


def taps_of(drafter: Source | None) -> tuple[int, ...]:
    """The target layers ``drafter`` reads (none without a drafter)."""
    return () if drafter is None else tuple(drafter.taps)


def new_part(drafter: Source | None) -> Part | None:
    """``drafter``'s per-sequence state (None without a drafter, or when it keeps none)."""
    return None if drafter is None else drafter.new_part()


def observe(drafter: Source | None, sequence: Sequence, taps: dict, rows: mx.array) -> None:
    """Hand ``drafter`` a forward's tapped states of ``rows`` (nothing without a drafter)."""
    if drafter is not None:
        drafter.observe(sequence, taps, rows)
