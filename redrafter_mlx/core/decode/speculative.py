"""The speculative step: pack -> verify -> accept -> stage -> draft, then one host read.

Legend: W drafted beams, k lookup beams, L beam length, T tree nodes, H hidden, V vocab.

Each step makes exactly one host read: the accepted beam, its accepted count, the next pending
token and the *next* step's beams, all in one array; everything between two reads is one lazy
graph. With a path-probability floor (``BeamShape.min_prob``) and the plan's early stop the
drafter also reads its best score after each depth but the last, to stop drafting as soon as
nothing deeper could be verified (``Step.syncs`` counts those reads). Lookup beams
(:mod:`redrafter_mlx.core.decode.lookup`) are proposed on the host from the sequence's n-gram index
after the read: the same tree, verify and acceptance, no extra read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from redrafter_mlx.core.decode.accept import accept
from redrafter_mlx.core.decode.joint import Segment
from redrafter_mlx.core.decode.lookup import Lookup
from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.source import Reading, observe, taps_of
from redrafter_mlx.core.decode.step import (
    Decoding,
    Emitted,
    PhaseTimer,
    Step,
    emitted_logprobs,
    host_read,
)
from redrafter_mlx.core.decode.tree import (
    Tree,
    pack_beams,
    pad_tree,
    prune,
    tree_mask,
    verified_size,
)

LOOKUP = Lookup()  # the lookup beams' source (it keeps nothing: one serves every step)


@dataclass(frozen=True)
class TreeState:
    """Between two speculative steps: the host's next token ``pending``, the beams drafted for
    it ``drafted (W, L)`` (no rows without a drafter) and, when the tree is pruned by them (the
    shape's floor, or a drafter whose beams end early: ``Source.prunes``), their drafted
    tokens' log-probs ``floor_logprobs (W, L - 1)`` (else None);
    ``version`` the sequence's when this state was made."""

    sequence: Sequence
    decoding: Decoding
    pending: int
    drafted: np.ndarray
    floor_logprobs: np.ndarray | None
    version: int
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    steps: int = 0


def drafted_state(
    decoder,
    sequence: Sequence,
    decoding: Decoding,
    context: mx.array,
    pending: mx.array,
    emitted: Emitted | None = None,
    timer: PhaseTimer | None = None,
) -> TreeState:
    """The state of ``pending ()`` drafted from the hidden state ``context (H,)`` (after a
    prompt: its rows are committed), after one host read (``emitted``'s arrays evaluated with
    it)."""
    drafted, _ = draft(decoder, decoding, sequence, Reading.after_prompt(context, pending))
    evaluated = () if emitted is None else emitted.arrays()
    read, floor_logprobs = read_step(pending[None], drafted, evaluated)
    beams = _beams(decoding, read[1:])
    timer = timer or PhaseTimer()
    return TreeState(
        sequence, decoding, int(read[0]), beams, floor_logprobs, sequence.version, timer
    )


def from_chain(decoder, state, decoding: Decoding) -> tuple[TreeState, Step]:
    """A plain ``state`` (a ``ChainState``: its pending token on the device, not yet
    emitted) turned speculative: the step emitting the pending token, and the state of that
    token drafted from the hidden state it was chosen from (one host read for both)."""
    pending = state.pending[0]
    new = drafted_state(decoder, state.sequence, decoding, state.context, pending, state.emitted)
    new = replace(new, steps=state.steps)
    return new, state.emitted.read([new.pending])


def speculative_step(decoder, state: TreeState) -> tuple[TreeState, Step]:
    """One step from ``state``'s pending token, its drafted beams and its lookup beams."""
    state.timer.start()
    planned = plan_tree(decoder, state)
    hidden, taps, logits = verify_forward(decoder, state, planned)
    outcome = conclude(decoder, state, planned, hidden, taps, logits)
    if decoder.plan.async_layers:  # dispatched while the device verifies, not at the read
        mx.async_eval(*outcome.values, *outcome.evaluated)
    read = host_read(*outcome.values, evaluated=outcome.evaluated)
    state.timer.mark("draft")
    return finish(state, planned, outcome, read)


@dataclass(frozen=True)
class PlannedTree:
    """A step's tree, ready for its verify forward: the beams ``(W + k, L)``, their packed
    (pruned, padded) tree, its size before padding, and its tokens ``(T,)``, positions
    ``(T,)`` and mask ``(T, S + T)``."""

    beams: np.ndarray
    tree: Tree
    size: int
    tokens: mx.array
    positions: mx.array
    mask: mx.array

    def segment(self, sequence: Sequence, taps: dict | None = None) -> Segment:
        """This tree as ``sequence``'s part of a forward (``taps``: the layers it keeps)."""
        return Segment(sequence, self.tokens, self.positions, self.mask, self.tree, taps)


@dataclass(frozen=True)
class Outcome:
    """A verified tree's acceptance and the next beams, lazily: ``values`` what the step's
    read reads (the chosen beam, its accepted count, the next token; the drafted beams; their
    log-probs where the tree is pruned by them), ``evaluated`` what it evaluates with them."""

    values: tuple[mx.array, ...]
    evaluated: tuple[mx.array, ...]
    emitted: Emitted
    draft_syncs: int


def plan_tree(decoder, state: TreeState) -> PlannedTree:
    """Pack the step's tree (ContextFull when the context has no room for its root)."""
    beams, tree, size = pack(decoder, state)
    offset = state.sequence.offset
    mask = tree_mask(tree, offset)
    positions = mx.array(offset + tree.depths)
    state.timer.mark("pack", mask)
    return PlannedTree(beams, tree, size, mx.array(tree.tokens), positions, mask)


def verify_forward(decoder, state: TreeState, planned: PlannedTree):
    """One target forward over the planned tree (K/V into the sequence's scratch), lazily ->
    ``(hidden (T, H), taps, logits (T, V))``; ``taps``: the outputs ``(T, H)`` of the layers
    the drafter reads."""
    compiled = decoder.compiles(planned.tree.size, state.decoding)
    taps = dict.fromkeys(taps_of(decoder.drafter))
    hidden = decoder.forward.segment(planned.segment(state.sequence, taps), compiled=compiled)
    logits = decoder.forward.lm_head(hidden)
    if decoder.plan.async_layers:  # the device verifies while Python builds accept and draft
        mx.async_eval(logits)
    state.timer.mark("verify", logits)
    return hidden, taps, logits


def conclude(decoder, state: TreeState, planned: PlannedTree, hidden, taps, logits) -> Outcome:
    """After the verify forward, lazily: accept, stage the accepted path in the sequence, draft
    the next beams from it."""
    accepted = accept_and_stage(decoder, state, planned, hidden, taps, logits)
    drafted = draft(decoder, state.decoding, state.sequence, accepted.reading)
    return accepted.outcome(*drafted)


@dataclass(frozen=True)
class Accepted:
    """A verified tree's acceptance, lazily: what the step emits (``emitted``), what the
    drafter reads next (``reading``) and the values the step's read starts with."""

    chosen: mx.array  # (3,) the accepted beam, its accepted count, the next token
    emitted: Emitted
    reading: Reading

    def outcome(self, drafted: tuple, draft_syncs: int) -> Outcome:
        """The step's :class:`Outcome` once the next beams ``drafted`` are (lazily) known."""
        values = step_values(self.chosen, drafted)
        return Outcome(values, self.emitted.arrays(), self.emitted, draft_syncs)


def accept_and_stage(decoder, state: TreeState, planned: PlannedTree, hidden, taps, logits):
    """Accept, hand the drafter its taps, stage the recurrent state -> :class:`Accepted`."""
    sequence, decoding, beams = state.sequence, state.decoding, planned.beams
    result = accept_tree(state, planned, logits)
    path_tokens = _path_tokens(beams, result) if decoding.any_logprobs else None
    emitted = emitted_logprobs(decoding, logits[result.path], path_tokens)
    observe(decoder.drafter, sequence, taps, result.path)
    sequence.stage(None, result.last_node)  # the recurrent layers' state (lazily)
    state.timer.mark("compact", *sequence.arrays())
    reading = Reading(
        hidden[result.last_node],
        result.next_token,
        result.path,
        mx.array(beams)[result.best],
        result.num_accepted + 1,
    )
    chosen = mx.stack([result.best, result.num_accepted, result.next_token])
    return Accepted(chosen, emitted, reading)


def finish(
    state: TreeState, planned: PlannedTree, outcome: Outcome, read
) -> tuple[TreeState, Step]:
    """After the step's read (``read``: :attr:`Outcome.values` on the host): commit the
    accepted tokens -> the next state and what the step emitted."""
    sequence, decoding, beams = state.sequence, state.decoding, planned.beams
    read, floor_logprobs = (read, None) if len(outcome.values) == 1 else read
    best, num_accepted, next_token = (int(x) for x in read[:3])
    root_and_accepted = beams[best, : num_accepted + 1].tolist()
    sequence.stage(accepted_nodes(planned.tree, best, num_accepted))
    sequence.commit(root_and_accepted)
    step = outcome.emitted.read(
        root_and_accepted[1:] + [next_token],
        num_accepted + 1,
        tree_size=planned.size,
        syncs=1 + outcome.draft_syncs,
        accepted_from=accepted_source(beams, len(state.drafted), best, num_accepted),
    )
    new = TreeState(
        sequence,
        decoding,
        next_token,
        _beams(decoding, read[3:]),
        floor_logprobs,
        sequence.version,
        state.timer,
        state.steps + 1,
    )
    return new, step


def pack(decoder, state: TreeState) -> tuple[np.ndarray, Tree, int]:
    """The step's beams ``(W + k, L)`` (cut short near the context's end), their packed,
    pruned and padded tree, and its size before padding."""
    sequence, shape = state.sequence, state.decoding.shape
    beams, logprobs = with_lookup(state)
    decoder.check_room(sequence, 1)  # the root's position
    room = decoder.room(sequence)
    if room is not None and room < beams.shape[1]:  # near the context's end: shorter
        beams = beams[:, :room]  # beams, so the answer stops where the autoregressive one does
        logprobs = None if logprobs is None else logprobs[:, : room - 1]
    tree = pack_beams(beams)
    if logprobs is not None:
        tree = prune(tree, logprobs, shape.min_prob, decoder.plan.tree_sizes)
    size = tree.size
    return beams, pad_tree(tree, verified_size(size, decoder.plan.tree_sizes)), size


def accept_tree(state: TreeState, planned: PlannedTree, logits: mx.array):
    """The acceptance of the planned beams by the target's ``logits (T, V)``, lazily."""
    tree, beams = planned.tree, planned.beams
    pruned = tree.unpack < 0  # never accepted: a token id no choice can equal
    result = accept(
        mx.array(np.where(pruned, -1, beams)),
        mx.array(np.maximum(tree.unpack, 0)),
        logits,
        state.decoding.sampler,
    )
    state.timer.mark("accept", result.num_accepted, result.next_token)
    return result


def draft(decoder, decoding: Decoding, sequence: Sequence, reading: Reading):
    """The drafter's beams ``(W, L)`` (and log-probs) of the decoding's shape from
    ``reading`` (its pending token first), lazily, and the host reads the search made;
    ``(None, None), 0`` without a drafter."""
    if not decoding.mode.drafted:
        return (None, None), 0
    options = decoder.search_options(decoding.shape)
    beams, logprobs, syncs = decoder.drafter.draft(sequence, reading, **options)
    return (beams, pruning_logprobs(decoder, decoding, logprobs)), syncs


def pruning_logprobs(decoder, decoding: Decoding, logprobs: mx.array) -> mx.array | None:
    """The drafted tokens' log-probs where the tree is pruned by them, else None (nothing
    prunes the tree by them: the read leaves them out)."""
    if not (decoding.shape.min_prob or decoder.drafter.prunes):
        return None
    return logprobs


def step_values(values: mx.array, drafted: tuple) -> tuple[mx.array, ...]:
    """What a step's one host read reads: ``values`` then the drafted beams flattened (int),
    plus the drafted tokens' log-probs when the tree is pruned by them (:func:`draft` leaves
    them None otherwise)."""
    beams, logprobs = drafted
    ints = values.astype(mx.int32)
    if beams is not None:
        ints = mx.concatenate([ints, beams.reshape(-1)])
    if beams is None or logprobs is None:
        return (ints,)
    return ints, logprobs


def read_step(values: mx.array, drafted: tuple, evaluated=()):
    """The step's one host read of :func:`step_values` -> ``(ints, log-probs or None)``;
    ``evaluated``'s arrays are evaluated with it and stay on the device."""
    read = host_read(*step_values(values, drafted), evaluated=evaluated)
    return (read, None) if isinstance(read, np.ndarray) else read


def with_lookup(state: TreeState) -> tuple[np.ndarray, np.ndarray | None]:
    """The drafted beams ``(W, L)`` followed by the lookup beams of the pending token
    ``(k, L)`` (their tokens score log-prob 0: a floor never prunes them); the root alone
    ``(1, 1)`` when there is no beam at all."""
    shape, pending = state.decoding.shape, state.pending
    beams, logprobs = state.drafted, state.floor_logprobs
    if shape.lookup:
        found = LOOKUP.propose(state.sequence, pending, shape.lookup, shape.length)
        beams = np.concatenate([beams, found])
        if logprobs is not None:
            logprobs = np.concatenate([logprobs, np.zeros((len(found), beams.shape[1] - 1))])
    if not len(beams):
        return np.full((1, 1), pending, np.int32), logprobs
    return beams, logprobs


def accepted_nodes(tree: Tree, best: int, num_accepted: int) -> mx.array | None:
    """The tree nodes of the root and the accepted tokens of beam ``best`` ``(n + 1,)``, to
    move after the prefix; None when they already sit there (only the root accepted, or a
    prefix of beam 0, whose nodes are numbered first). Known on the host after the step's
    read, so the common steps queue no compaction at all."""
    nodes = tree.unpack[best, : num_accepted + 1]
    return None if (nodes == np.arange(num_accepted + 1)).all() else mx.array(nodes)


def accepted_source(beams: np.ndarray, drafted: int, best: int, num_accepted: int) -> str | None:
    """Which beams of ``beams (W + k, L)`` (the first ``drafted`` the drafter's, the rest
    lookup's) hold the ``num_accepted`` tokens accepted from beam ``best``: "drafter",
    "lookup", "both", or None when none was accepted."""
    if not num_accepted:
        return None
    accepted = beams[best, 1 : num_accepted + 1]
    holds = (beams[:, 1 : num_accepted + 1] == accepted).all(axis=1)
    from_drafter, from_lookup = bool(holds[:drafted].any()), bool(holds[drafted:].any())
    return "both" if from_drafter and from_lookup else "drafter" if from_drafter else "lookup"


def _beams(decoding: Decoding, values: np.ndarray) -> np.ndarray:
    """The drafted beams ``(W, L)`` of a read (``(0, L)`` without a drafter)."""
    return values.reshape(-1, decoding.shape.length)


def _path_tokens(beams: np.ndarray, result) -> mx.array:
    """The tokens a step emits along the accepted beam, on the device, ``(L,)``: the beam's
    accepted drafts, then the target's own next token at ``num_accepted`` (rows past it are
    dropped after the read)."""
    beam = mx.array(beams)[result.best].astype(mx.int32)
    after = mx.concatenate([beam[1:], result.next_token.reshape(1).astype(mx.int32)])
    at_next = mx.arange(after.shape[0]) == result.num_accepted
    return mx.where(at_next, result.next_token.astype(mx.int32), after)
