"""One sequence's decoding state, owned by one object: :class:`Sequence`.

Legend: S committed tokens, T tokens one forward writes, L beam length.

A sequence holds everything a decode step changes: the K/V of every attention layer
(:class:`~redrafter_mlx.core.decode.cache.KVStore`), the recurrent layers' states and their
snapshots (:class:`~redrafter_mlx.core.decode.recurrent.StateStore`), the committed token ids, the
n-gram index of those ids (built when lookup beams first ask for it) and any part a drafter keeps
per sequence (:class:`Part`). Its operations keep them in step, in the order a step needs::

    view = seq.begin(positions, mask, tree)   # room for T tokens; each layer writes through it
    ...forward(tokens, view)...               # K/V and recurrent states after ``offset``
    seq.stage(path, node)                     # lazy: the accepted path's K/V, its node's state
    seq.commit(ids)                           # ids, index, recurrent states, parts: together
    reused, reread = seq.reuse_prefix(ids)    # the one way back to a prefix

No other module writes their fields. ``version`` is new after every change, so a decode
state made at one version can tell when the sequence has moved on without it (a spent
state).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from redrafter_mlx.core.decode.cache import KVStore, common_prefix
from redrafter_mlx.core.decode.lookup import NgramIndex
from redrafter_mlx.core.decode.recurrent import Levels, States, StateStore

_VERSIONS = itertools.count()  # every change of any sequence gets a number of its own


class Part(Protocol):
    """What a drafter keeps per sequence (its own K/V, say): committed and rewound with it;
    ``owner`` is the drafter that made it."""

    owner: object

    def commit(self, ids: list[int]) -> None: ...

    def rewind(self, length: int) -> None: ...

    def arrays(self) -> list[mx.array]: ...


class Sequence:
    """A conversation's decoding state over one model (attention layers ``num_layers``,
    recurrent layers ``recurrent``, K/V kept in ``dtype``)."""

    def __init__(self, num_layers: int, dtype: mx.Dtype, recurrent: int = 0):
        self.kv = KVStore(num_layers, dtype)
        self.states = StateStore(recurrent) if recurrent else None
        self._ids: list[int] = []
        self._index: NgramIndex | None = None
        self.parts: list[Part] = []
        self.version = next(_VERSIONS)

    # -- reading

    @property
    def ids(self) -> tuple[int, ...]:
        """The committed token ids (a copy: only :meth:`commit` and rewinding change them)."""
        return tuple(self._ids)

    @property
    def offset(self) -> int:
        """Committed tokens: where the next forward writes."""
        return len(self._ids)

    @property
    def last_id(self) -> int | None:
        return self._ids[-1] if self._ids else None

    def shared_prefix(self, ids: list[int]) -> int:
        """How many leading tokens ``ids`` shares with the committed ones."""
        return common_prefix(self._ids, ids)

    @property
    def index(self) -> NgramIndex:
        """The n-gram index of the committed ids, built on first use and kept in step."""
        if self._index is None:
            self._index = NgramIndex(self._ids)
        return self._index

    def part_of(self, owner) -> Part:
        """The part ``owner`` (a drafter) keeps in this sequence."""
        for part in self.parts:
            if part.owner is owner:
                return part
        raise ValueError("this sequence was not made by a decoder of this drafter")

    def arrays(self) -> list[mx.array]:
        """Arrays to evaluate to materialise the sequence (what it holds in memory)."""
        parts = [a for part in self.parts for a in part.arrays()]
        recurrent = self.states.arrays() if self.states is not None else []
        return self.kv.arrays() + recurrent + parts

    # -- a forward, then a step's changes

    def begin(self, positions: mx.array, mask, tree=None, taps=()) -> View:
        """Room for the ``T`` tokens at ``positions (T,)`` after ``offset``, and the view each
        layer of their forward writes through (``tree``: the packed tree they are, which
        recurrent layers follow; None: a chain; ``taps``: the layers whose output the forward
        keeps)."""
        count = positions.shape[0]
        self.kv.reserve(self.offset, count)
        levels = None
        if tree is not None and self.states is not None:
            levels = Levels.of(tree.parents, tree.depths)
        return View(self, positions, mask, levels, frozenset(taps))

    def stage(self, path: mx.array | None, node: mx.array | None = None) -> None:
        """Stage a verified tree's accepted path: its K/V ``path (L,)`` (node indices; None:
        already in place) moved to ``[offset, offset + L)``, and the recurrent states of
        ``node ()``, its last accepted node. Lazy; :meth:`commit` makes them part of the
        prefix."""
        if path is not None:
            self.kv.reserve(self.offset, path.shape[0])
            self.kv.compact(self.offset, path)
        if self.states is not None and node is not None:
            self.states.keep(node)

    def commit(self, ids: list[int]) -> None:
        """The next ``len(ids)`` written slots (tokens ``ids``) join the prefix, with the
        recurrent states staged after them, the index and every part."""
        self._ids.extend(ids)
        if self.states is not None:
            self.states.commit()
            self.states.checkpoint(self.offset)  # an answer's follow-up may come back to here
        if self._index is not None:
            self._index.extend(ids)
        for part in self.parts:
            part.commit(ids)
        self.version = next(_VERSIONS)

    # -- going back

    def snapshot(self) -> None:
        """Remember the recurrent states here, so the sequence can rewind here (K/V rewind
        anywhere: nothing to do without recurrent layers)."""
        if self.states is not None:
            self.states.snapshot(self.offset)

    def rewindable(self, length: int) -> bool:
        """Whether :meth:`rewind` can cut back to ``length`` tokens."""
        if self.states is None or length == self.offset:
            return True
        return 0 <= length < self.offset and length in self.states.kept

    def rewind(self, length: int) -> None:
        """Cut back to the first ``length`` committed tokens (every part with them).
        ValueError where recurrent states have no snapshot at ``length``."""
        length = min(max(length, 0), self.offset)
        if length == self.offset:
            return
        if not self.rewindable(length):
            raise ValueError(
                f"cannot rewind to {length} tokens: recurrent layers keep their state only at "
                f"{self.states.kept}"
            )
        if self.states is not None:
            self.states.restore(length)
        if self._index is not None:
            self._index.rewind(length)
        for part in self.parts:
            part.rewind(length)
        del self._ids[length:]
        self.version = next(_VERSIONS)

    def reuse_prefix(self, ids: list[int]) -> tuple[int, int]:
        """Rewind to the longest prefix shared with ``ids`` (a whole prompt's token ids) that
        can be rewound to, keeping at least one of ``ids`` to feed (its hidden state predicts
        the next token) -> ``(reused, reread)``: ``ids[reused:]`` is what to feed, and
        ``reread`` of those were cached but must be fed again (recurrent layers keep their
        state only at some offsets: :attr:`StateStore.kept`)."""
        shared = max(min(self.shared_prefix(ids), len(ids) - 1), 0)
        reused = shared
        if self.states is not None:  # the latest state held at or before that
            reused = max(n for n in (*self.states.kept, self.offset) if n <= shared)
        self.rewind(reused)
        return reused, shared - reused

    def mark(self) -> Mark:
        """Where the sequence is now, to come back to with :meth:`restore` (a snapshot of the
        recurrent states is taken here)."""
        self.snapshot()
        return Mark(self.offset, self.version)

    def restore(self, mark: Mark) -> None:
        """Back to ``mark`` exactly: the same tokens and the same version, so a decode state
        made there can step again (what timing a step many times needs)."""
        self.rewind(mark.offset)
        self.version = mark.version


@dataclass(frozen=True)
class Mark:
    """A point of a sequence (:meth:`Sequence.mark`)."""

    offset: int
    version: int


@dataclass
class View:
    """One forward's access to its sequence: each layer's cache writes through it.

    ``positions (T,)`` and ``mask`` (``(T, S + T)`` boolean, None, or ``"causal"``) are the
    forward's; ``levels`` its tree grouped by depth (recurrent layers only; None for a chain).
    ``taps`` asks for the hidden states after the listed layers: the forward puts each in
    ``hidden[layer] (T, H)``.
    """

    sequence: Sequence
    positions: mx.array
    mask: mx.array | str | None
    levels: Levels | None = None
    taps: frozenset[int] = frozenset()
    hidden: dict[int, mx.array] = field(default_factory=dict)

    @property
    def offset(self) -> int:
        return self.sequence.offset

    def record(self, layer: int, hidden: mx.array) -> None:
        """Keep layer ``layer``'s output ``(1, T, H)`` when the forward taps it."""
        if layer in self.taps:
            self.hidden[layer] = hidden[0]

    # attention layers

    def write(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write K/V ``(1, K, T, D)`` after the prefix -> the layer's ``(1, K, S + T, D)``."""
        return self.sequence.kv.write(layer, self.offset, keys, values)

    def keys(self, layer: int) -> mx.array | None:
        return self.sequence.kv.keys[layer]

    def tie_keys(self, layer: int, value: mx.array) -> None:
        """Replace a layer's key buffer by the same buffer made to depend on other work
        (``mx.depends``: a pipeline stage ties its send to the last layer's keys)."""
        self.sequence.kv.keys[layer] = value

    # recurrent layers

    def committed_states(self, layer: int) -> States | None:
        return self.sequence.states.committed[layer]

    def stage_states(self, layer: int, states: States) -> None:
        """A chain's end state of recurrent ``layer`` (committed by the next commit)."""
        self.sequence.states.stage(layer, states)

    def node_states(self, layer: int, states: States) -> None:
        """Every tree node's state of recurrent ``layer``, rows in :attr:`levels`' order."""
        self.sequence.states.hold_nodes(layer, states, self.levels.node_rows)
