"""Several sequences' decode steps as one batch step: one target forward for all their trees,
one host read for all their results.

Legend: B sequences, T_i tree nodes of sequence i, N their sum, H hidden, V vocab.

Each :class:`Member` keeps its own decoding (mode, shape, sampler, log-probs), its own tree and
its own sequence; a batch step packs each member's tree as its own step would (an
autoregressive member's pending token is a 1-node tree), verifies them all in one joint forward
(:mod:`~redrafter_mlx.core.decode.joint`: the weights read once for all N tokens), applies the LM
head once, then each member accepts and stages as alone and drafts from its own state (the
members' beam searches of one shape run as one search, their rows stacked: the drafter's
weights read once too), and one host read brings back every member's result. A member whose
context is full gets its ContextFull and leaves; the others step on.

Where the plan bounds a batch's rows (``Plan.batch_rows``: a CPU, whose products turn
compute-bound past a few rows), each member's tree is fitted to its share for the step
(:func:`fitted`: fewer lookup beams, fewer drafted beams, shorter beams, down to its root
alone, fed as one token as an autoregressive member's is): a large batch decodes plainly, a
small one speculates, and a member alone runs its own shape. Greedy answers are the same at
every fit (the target's own tokens); sampled ones keep their distribution.

Seeded sampling: each member may keep its own random key (``Member.key``), set before its
draws and read back with the batch's read, so its draws are the ones it would make alone
(answers equal to the same seeded request served alone, whoever shares the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from redrafter_mlx.core.decode import autoregressive, speculative
from redrafter_mlx.core.decode.accept import choose
from redrafter_mlx.core.decode.decoder import Decoder, State
from redrafter_mlx.core.decode.joint import Segment
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.source import observe, taps_of
from redrafter_mlx.core.decode.step import Decoding, SpentState, Step, emitted_logprobs, host_read
from redrafter_mlx.core.errors import ContextFull


@dataclass
class Member:
    """One sequence of a batch: its decode state (replaced by each batch step), its own
    random key (``(hi << 32) | lo`` of MLX's key; None: it draws from the global generator)
    and its own decoding (the state's may be fitted to the batch: :func:`fitted`)."""

    state: State
    key: int | None = None
    decoding: Decoding | None = None

    def __post_init__(self):
        if self.decoding is None:
            self.decoding = self.state.decoding

    def seed(self) -> None:
        """Make MLX's generator this member's (before building its draws)."""
        if self.key is not None:
            mx.random.seed(self.key)


def current_key() -> mx.array:
    """MLX's generator's key now ``(2,)`` uint32, lazily."""
    return mx.random.state[0]


def key_value(key: np.ndarray) -> int:
    """A key read to the host -> the integer :func:`mlx.core.random.seed` sets it from."""
    return (int(key[0]) << 32) | int(key[1])


@dataclass
class _Planned:
    """A member's part of a batch step before the forward."""

    member: Member
    segment: Segment
    tree: speculative.PlannedTree | None  # None: one token (autoregressive, or a root alone)


def batch_step(decoder: Decoder, members: list[Member]) -> list[Step | BaseException]:
    """Step every member once (its ``state`` replaced by the next) -> what each emitted, or
    the error that ended it (ContextFull, SpentState): that member is not stepped."""
    _fit(decoder, members)
    results: dict[int, Step | BaseException] = {}
    planned: list[tuple[int, _Planned]] = []
    for i, member in enumerate(members):
        try:
            alone = _plan(decoder, member)
        except (ContextFull, SpentState) as e:
            results[i] = e
            continue
        if isinstance(alone, Step):  # stepped by itself (see _plan)
            results[i] = alone
        else:
            planned.append((i, alone))
    for (i, _), step in zip(planned, _step_planned(decoder, [p for _, p in planned]), strict=True):
        results[i] = step
    return [results[i] for i in range(len(members))]


def fitted(decoding: Decoding, rows: int) -> Decoding:
    """``decoding`` for a step whose tree may verify at most ``rows`` nodes: fewer lookup
    beams, then fewer drafted beams, then shorter beams, then its root alone (no drafter
    pass: a plain step)."""
    if not decoding.mode.speculative:
        return decoding
    shape = decoding.shape
    width = shape.width if decoding.mode.drafted else 0
    lookup, length = shape.lookup, shape.length

    def nodes() -> int:
        return 1 + (width + lookup) * (length - 1)

    while lookup and nodes() > rows:
        lookup -= 1
    while width > 1 and nodes() > rows:
        width -= 1
    while length > 2 and nodes() > rows:
        length -= 1
    if nodes() > rows or not (width or lookup):  # the root alone
        return replace(decoding, mode=Mode.LOOKUP, shape=replace(shape, lookup=0))
    return replace(
        decoding, shape=replace(shape, width=max(width, 1), lookup=lookup, length=length)
    )


def _fit(decoder: Decoder, members: list[Member]) -> None:
    """Give each tree member the decoding its share of the plan's ``batch_rows`` allows
    (its own where there is no bound, or it is alone). Seeded members keep their trees: their
    draws, and so their answers, are those they make alone. Only drafters that say so
    (``Source.batch_fits``) are fitted."""
    budget, drafter = decoder.plan.batch_rows, decoder.drafter
    fits = budget is not None and len(members) > 1
    fits = fits and (drafter is None or drafter.batch_fits)
    for member in members:
        state = member.state
        if isinstance(state, speculative.TreeState) and member.key is None:
            own = member.decoding
            decoding = fitted(own, budget // len(members)) if fits else own
            if decoding != state.decoding:
                member.state = _refitted(state, decoding)


def _refitted(state: speculative.TreeState, decoding: Decoding) -> speculative.TreeState:
    """``state`` to step at ``decoding``: its drafted beams cut to the new shape (none when
    they are shorter than its beams: drafted at a smaller fit)."""
    drafted, floor = state.drafted, state.floor_logprobs
    length = decoding.shape.length
    width = decoding.shape.width if decoding.mode.drafted else 0
    if drafted.shape[1] < length:
        drafted, floor = np.empty((0, length), drafted.dtype), None
    return replace(
        state,
        decoding=decoding,
        drafted=drafted[:width, :length],
        floor_logprobs=None if floor is None else floor[:width, : length - 1],
    )


def _plan(decoder: Decoder, member: Member) -> _Planned | Step:
    """A member's segment, or the step it took alone: an unseeded member alone in the batch
    (the single-sequence step, pipelined where autoregressive), or an autoregressive one at
    the context's end (the single step's rule for its last token)."""
    state = member.state
    if state.version != state.sequence.version:
        raise SpentState("a batch member's state was stepped already")
    sequence = state.sequence
    if isinstance(state, speculative.TreeState) and root_alone(state.decoding):
        decoder.check_room(sequence, 1)  # ContextFull as the tree's step raises it
        token, positions = mx.array([state.pending], mx.int32), mx.array([sequence.offset])
        segment = Segment(sequence, token, positions, None, taps=_taps(decoder))
        return _Planned(member, segment, None)
    if isinstance(state, speculative.TreeState):
        state.timer.start()
        tree = speculative.plan_tree(decoder, state)
        return _Planned(member, tree.segment(sequence, _taps(decoder)), tree)
    if not decoder.has_room(sequence, 1) or state.pending is None:
        member.seed()
        member.state, step = decoder.step(state)
        if member.key is not None:
            member.key = key_value(np.array(current_key()))  # the context's end: once
        return step
    positions = mx.array([sequence.offset])
    return _Planned(member, Segment(sequence, state.pending, positions, None), None)


def _taps(decoder: Decoder) -> dict:
    return dict.fromkeys(taps_of(decoder.drafter))


def _step_planned(decoder: Decoder, planned: list[_Planned]) -> list[Step]:
    """The joint forward, each member's lazy conclusion, the one read, each member's commit."""
    if not planned:
        return []
    if len(planned) == 1 and planned[0].member.key is None:  # alone: the single step
        member = planned[0].member
        if planned[0].tree is None:
            member.state, step = decoder.step(member.state)
            return [step]
        return [_conclude_alone(decoder, planned[0])]
    compiled = all(decoder.compiles(p.segment.count, p.member.state.decoding) for p in planned)
    hidden = decoder.forward.joint([p.segment for p in planned], compiled=compiled)
    logits = _split(decoder.forward.lm_head(mx.concatenate(hidden)), hidden)
    parts: list = [None] * len(planned)  # per member: (values, evaluated, finish)
    keys: list = [None] * len(planned)  # a seeded member's key after its draws
    for i, (p, h, rows) in enumerate(zip(planned, hidden, logits, strict=True)):
        p.member.seed()
        if p.tree is None and isinstance(p.member.state, speculative.TreeState):
            parts[i] = _conclude_root(decoder, p, rows)
        elif p.tree is None:
            parts[i] = _conclude_chain(p, rows)
        else:
            state = p.member.state
            state.timer.mark("verify", rows)
            taps = p.segment.taps or {}
            accepted = speculative.accept_and_stage(decoder, state, p.tree, h, taps, rows)
            # drafted now, in its own random key's turn
            drafted = speculative.draft(decoder, state.decoding, state.sequence, accepted.reading)
            parts[i] = _tree_part(p, accepted.outcome(*drafted))
        if p.member.key is not None:
            keys[i] = current_key()
    values = [
        (*vs, *([] if key is None else [key])) for (vs, _, _), key in zip(parts, keys, strict=True)
    ]
    flat = [v for vs in values for v in vs]
    read = host_read(*flat, evaluated=[a for _, arrays, _ in parts for a in arrays])
    read = [read] if len(flat) == 1 else list(read)
    steps = []
    for p, vs, (_, _, finish) in zip(planned, values, parts, strict=True):
        mine, read = read[: len(vs)], read[len(vs) :]
        if p.member.key is not None:
            p.member.key, mine = key_value(mine[-1]), mine[:-1]
        steps.append(finish(mine))
    return steps


def _tree_part(p: _Planned, outcome: speculative.Outcome):
    """A tree member's ``(values to read, arrays to evaluate, finish)``."""
    member, state = p.member, p.member.state

    def finish_tree(read) -> Step:
        values = read[0] if len(outcome.values) == 1 else tuple(read)
        member.state, step = speculative.finish(state, p.tree, outcome, values)
        return step

    return outcome.values, outcome.evaluated, finish_tree


def _conclude_alone(decoder: Decoder, p: _Planned) -> Step:
    """A speculative member alone: :func:`speculative.speculative_step` from its planned tree."""
    state = p.member.state
    hidden, taps, logits = speculative.verify_forward(decoder, state, p.tree)
    outcome = speculative.conclude(decoder, state, p.tree, hidden, taps, logits)
    read = host_read(*outcome.values, evaluated=outcome.evaluated)
    state.timer.mark("draft")
    p.member.state, step = speculative.finish(state, p.tree, outcome, read)
    return step


def _split(rows: mx.array, like: list[mx.array]) -> list[mx.array]:
    """``rows (N, ...)`` split as ``like``'s arrays' first axes."""
    parts, start = [], 0
    for x in like:
        parts.append(rows[start : start + x.shape[0]])
        start += x.shape[0]
    return parts


def root_alone(decoding: Decoding) -> bool:
    """Whether a tree decoding verifies its pending token alone (:func:`fitted`'s smallest
    fit): no drafted and no lookup beams."""
    return not decoding.mode.drafted and not decoding.shape.lookup


def _conclude_root(decoder: Decoder, p: _Planned, logits: mx.array):
    """A tree member fitted to its root alone, fed as one token with no mask (the
    autoregressive step's forward, not a 1-node tree's): ``(values to read, arrays to
    evaluate, finish)``. Its next token is chosen from ``logits (1, V)`` as the tree's
    acceptance chooses it with nothing drafted; the next state has no drafted beams (a bigger
    fit verifies its lookup beams, or its root, once, then drafts again)."""
    member, state = p.member, p.member.state
    sequence, decoding = state.sequence, state.decoding
    choice = choose(logits, decoding.sampler)
    emitted = emitted_logprobs(decoding, logits, choice)
    observe(decoder.drafter, sequence, p.segment.taps or {}, mx.array([0]))

    def finish_root(read) -> Step:
        next_token = int(read[0][0])
        sequence.commit([state.pending])
        drafted = np.empty((0, decoding.shape.length), np.int32)
        member.state = replace(
            state,
            pending=next_token,
            drafted=drafted,
            floor_logprobs=None,
            version=sequence.version,
            steps=state.steps + 1,
        )
        return emitted.read([next_token], 1)

    return (choice.astype(mx.int32),), emitted.arrays(), finish_root


def _conclude_chain(p: _Planned, logits: mx.array):
    """An autoregressive member's ``(values to read, arrays to evaluate, finish)``: its next
    token chosen from ``logits (1, V)``, lazily."""
    member, state = p.member, p.member.state
    choice = choose(logits, state.decoding.sampler)
    emitted = emitted_logprobs(state.decoding, logits, choice)
    values = (mx.concatenate([state.pending, choice]).astype(mx.int32),)

    def finish_chain(read) -> Step:
        member.state, step = autoregressive.chained(state, choice, emitted, int(read[0][0]))
        return step

    return values, emitted.arrays(), finish_chain
