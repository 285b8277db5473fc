"""Several sequences' decode steps as one batch step: one target forward for all their trees,
one host read for all their results.

Legend: B sequences, T_i tree nodes of sequence i, N their sum, H hidden, V vocab.

Each :class:`Member` keeps its own decoding (mode, shape, sampler, log-probs), its own tree and
its own sequence. A batch step gives each member a :class:`MemberStep`, whose methods are the
step's phases: :meth:`~MemberStep.plan` packs the member's tree as its own step would (an
autoregressive member's pending token is a 1-node tree) into its segment of the joint forward
(:mod:`~redrafter_mlx.core.decode.joint`: the weights read once for all N tokens, the LM head
applied once), :meth:`~MemberStep.conclude` accepts and stages as alone and drafts from the
member's own state, lazily, :meth:`~MemberStep.finish` commits after the one host read that
brings back every member's result. A member whose context is full gets its ContextFull and
leaves; the others step on. A member stepping by itself (a batch of one: a single sequence)
takes the single-sequence step (:meth:`~MemberStep.alone`: the pipelined autoregressive step,
or its tree's forward alone).

Where the plan bounds a batch's rows (``Plan.batch_rows``: a CPU, whose products turn
compute-bound past a few rows), each member's tree is fitted to its share for the step
(:func:`fitted`: fewer lookup beams, fewer drafted beams, shorter beams, down to its root
alone, fed as one token as an autoregressive member's is): a large batch decodes plainly, a
small one speculates, and a member alone runs its own shape. The fit is recorded on the member
(:meth:`Member.refit`: its own decoding, the tree decoding it steps at, or its root alone), and
a fitted tree is always a decoding the decoder runs. Greedy answers are the same at every fit
(the target's own tokens); sampled ones keep their distribution.

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
from redrafter_mlx.core.decode.source import observe, taps_of
from redrafter_mlx.core.decode.step import Decoding, SpentState, Step, emitted_logprobs, host_read
from redrafter_mlx.core.errors import ContextFull


@dataclass
class Member:
    """One sequence of a batch: its decode state (replaced by each batch step), its own
    random key (``(hi << 32) | lo`` of MLX's key; None: it draws from the global generator),
    its own decoding (the request's) and its fit for the next step: ``root_alone`` when no
    tree fits its share of the batch's rows (else its state's decoding is the tree it
    verifies, its own or a smaller one: :meth:`refit`)."""

    state: State
    key: int | None = None
    decoding: Decoding | None = None
    root_alone: bool = False

    def __post_init__(self):
        if self.decoding is None:
            self.decoding = self.state.decoding

    def seed(self) -> None:
        """Make MLX's generator this member's (before building its draws)."""
        if self.key is not None:
            mx.random.seed(self.key)

    def refit(self, decoder: Decoder, rows: int | None) -> None:
        """Decide this member's next step at most ``rows`` tree nodes (None: its own decoding):
        a tree decoding :meth:`Decoder.check` accepts, or its root alone. Only tree members
        are fitted, and only unseeded ones: a seeded member's draws, and so its answer, are
        those it makes alone."""
        state = self.state
        if not isinstance(state, speculative.TreeState) or self.key is not None:
            return
        fit = self.decoding if rows is None else fitted(self.decoding, rows)
        self.root_alone = fit is None
        if fit is not None and fit != state.decoding:
            decoder.check(fit)
            self.state = _refitted(state, fit)


def current_key() -> mx.array:
    """MLX's generator's key now ``(2,)`` uint32, lazily."""
    return mx.random.state[0]


def key_value(key: np.ndarray) -> int:
    """A key read to the host -> the integer :func:`mlx.core.random.seed` sets it from."""
    return (int(key[0]) << 32) | int(key[1])


def batch_step(decoder: Decoder, members: list[Member]) -> list[Step | BaseException]:
    """Step every member once (its ``state`` replaced by the next) -> what each emitted, or
    the error that ended it (ContextFull, SpentState): that member is not stepped."""
    _fit(decoder, members)
    results: dict[int, Step | BaseException] = {}
    together: dict[int, MemberStep] = {}
    for i, member in enumerate(members):
        try:
            step = MemberStep.plan(decoder, member)
        except (ContextFull, SpentState) as e:
            results[i] = e
            continue
        if step.by_itself:
            results[i] = step.alone()
        else:
            together[i] = step
    if len(together) == 1:  # a batch of one: the single-sequence step
        ((i, step),) = together.items()
        results[i] = step.alone()
    elif together:
        results.update(zip(together, step_together(decoder, list(together.values())), strict=True))
    return [results[i] for i in range(len(members))]


def step_together(decoder: Decoder, steps: list[MemberStep]) -> list[Step]:
    """The joint forward of the planned ``steps``, each one's lazy conclusion, the one read,
    each one's finish."""
    compiled = all(decoder.compiles(s.segment.count, s.member.state.decoding) for s in steps)
    hidden = decoder.forward.joint([s.segment for s in steps], compiled=compiled)
    logits = _split(decoder.forward.lm_head(mx.concatenate(hidden)), hidden)
    for step, h, rows in zip(steps, hidden, logits, strict=True):
        step.conclude(h, rows)
    values = [v for s in steps for v in s.values]
    read = host_read(*values, evaluated=[a for s in steps for a in s.evaluated])
    read = [read] if len(values) == 1 else list(read)
    done = []
    for step in steps:
        mine, read = read[: len(step.values)], read[len(step.values) :]
        done.append(step.finish(mine))
    return done


def fitted(decoding: Decoding, rows: int) -> Decoding | None:
    """``decoding`` for a step whose tree may verify at most ``rows`` nodes: fewer lookup
    beams, then fewer drafted beams, then shorter beams; None when only its root fits (it
    steps as one token, nothing drafted). A plain decoding is its own fit."""
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
    if nodes() > rows or not (width or lookup):
        return None
    width = width if decoding.mode.drafted else shape.width  # lookup alone drafts no beam
    return replace(decoding, shape=replace(shape, width=width, lookup=lookup, length=length))


def _fit(decoder: Decoder, members: list[Member]) -> None:
    """Each member's fit to its share of the plan's ``batch_rows`` (its own decoding where
    there is no bound, or it is alone). Only drafters that say so (``Source.batch_fits``) are
    fitted."""
    budget, drafter = decoder.plan.batch_rows, decoder.drafter
    fits = budget is not None and len(members) > 1
    fits = fits and (drafter is None or drafter.batch_fits)
    for member in members:
        member.refit(decoder, budget // len(members) if fits else None)


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


class MemberStep:
    """One member's part of one batch step, phase by phase: :meth:`plan` (its segment of the
    joint forward), :meth:`conclude` (lazily: what the read reads, ``values``, and what it
    evaluates, ``evaluated``), :meth:`finish` (after the read: commit, the member's next
    state, the :class:`Step`). :meth:`alone` runs the three by itself: a member stepping
    alone takes the single-sequence step. ``by_itself``: it must step alone even in a batch.

    A tree member steps as :class:`TreeStep`, a tree member fitted to its root alone as
    :class:`RootStep`, an autoregressive one as :class:`ChainStep`.
    """

    by_itself = False
    segment: Segment | None = None
    values: tuple[mx.array, ...] = ()
    evaluated: tuple[mx.array, ...] = ()

    def __init__(self, decoder: Decoder, member: Member):
        self.decoder, self.member, self.state = decoder, member, member.state

    @staticmethod
    def plan(decoder: Decoder, member: Member) -> MemberStep:
        """``member``'s step of its kind, its segment packed (ContextFull when its context
        has no room; SpentState when its state was stepped already)."""
        state = member.state
        if state.version != state.sequence.version:
            raise SpentState("a batch member's state was stepped already")
        if not isinstance(state, speculative.TreeState):
            return ChainStep(decoder, member)
        return RootStep(decoder, member) if member.root_alone else TreeStep(decoder, member)

    def conclude(self, hidden: mx.array, logits: mx.array) -> None:
        """After the forward (``hidden (T, H)``, ``logits (T, V)``: this member's rows), in
        the member's own random key: its draws, lazily (a seeded member's key read with them)."""
        self.member.seed()
        values, self.evaluated = self._conclude(hidden, logits)
        if self.member.key is not None:
            values = (*values, current_key())
        self.values = values

    def finish(self, read: list[np.ndarray]) -> Step:
        """After the read (``read``: :attr:`values` on the host): the member's next state,
        and what its step emitted."""
        if self.member.key is not None:
            self.member.key, read = key_value(read[-1]), read[:-1]
        self.member.state, step = self._finish(read)
        return step

    def alone(self) -> Step:
        """The three phases with a forward of this member's segment alone."""
        decoder = self.decoder
        compiled = decoder.compiles(self.segment.count, self.state.decoding)
        hidden = decoder.forward.segment(self.segment, compiled=compiled)
        self.conclude(hidden, decoder.forward.lm_head(hidden))
        read = host_read(*self.values, evaluated=self.evaluated)
        return self.finish([read] if len(self.values) == 1 else list(read))

    def _conclude(self, hidden, logits) -> tuple[tuple, tuple]:
        raise NotImplementedError

    def _finish(self, read: list[np.ndarray]) -> tuple[State, Step]:
        raise NotImplementedError


class TreeStep(MemberStep):
    """A tree member's step: :func:`speculative.speculative_step`'s phases."""

    def __init__(self, decoder: Decoder, member: Member):
        super().__init__(decoder, member)
        self.state.timer.start()
        self.tree = speculative.plan_tree(decoder, self.state)
        self.segment = self.tree.segment(self.state.sequence, _taps(decoder))

    def _conclude(self, hidden, logits):
        state, taps = self.state, self.segment.taps or {}
        state.timer.mark("verify", logits)
        accepted = speculative.accept_and_stage(
            self.decoder, state, self.tree, hidden, taps, logits
        )
        drafted = speculative.draft(self.decoder, state.decoding, state.sequence, accepted.reading)
        self.outcome = accepted.outcome(*drafted)
        return self.outcome.values, self.outcome.evaluated

    def _finish(self, read):
        self.state.timer.mark("draft")
        values = read[0] if len(self.outcome.values) == 1 else tuple(read)
        return speculative.finish(self.state, self.tree, self.outcome, values)


class RootStep(MemberStep):
    """A tree member fitted to its root alone, fed as one token with no mask (the
    autoregressive step's forward, not a 1-node tree's). Its next token is chosen as the
    tree's acceptance chooses it with nothing drafted; the next state has no drafted beams (a
    bigger fit verifies its lookup beams, or its root, once, then drafts again)."""

    def __init__(self, decoder: Decoder, member: Member):
        super().__init__(decoder, member)
        sequence = self.state.sequence
        decoder.check_room(sequence, 1)  # ContextFull as the tree's step raises it
        token, positions = mx.array([self.state.pending], mx.int32), mx.array([sequence.offset])
        self.segment = Segment(sequence, token, positions, None, taps=_taps(decoder))

    def _conclude(self, hidden, logits):
        decoding = self.state.decoding
        self.choice = choose(logits, decoding.sampler)
        self.emitted = emitted_logprobs(decoding, logits, self.choice)
        observe(self.decoder.drafter, self.state.sequence, self.segment.taps or {}, mx.array([0]))
        return (self.choice.astype(mx.int32),), self.emitted.arrays()

    def _finish(self, read):
        state = self.state
        sequence, next_token = state.sequence, int(read[0][0])
        sequence.commit([state.pending])
        new = replace(
            state,
            pending=next_token,
            drafted=np.empty((0, state.decoding.shape.length), np.int32),
            floor_logprobs=None,
            version=sequence.version,
            steps=state.steps + 1,
        )
        return new, self.emitted.read([next_token], 1)


class ChainStep(MemberStep):
    """An autoregressive member's step: its pending token fed, its next one chosen. Alone it
    is the single-sequence step (:func:`autoregressive.chain_step`, pipelined: the next
    token's forward runs while the pending one is read); at the context's end it steps by
    itself (the single step's rule for its last token)."""

    def __init__(self, decoder: Decoder, member: Member):
        super().__init__(decoder, member)
        state, sequence = self.state, self.state.sequence
        self.by_itself = not decoder.has_room(sequence, 1) or state.pending is None
        if not self.by_itself:
            positions = mx.array([sequence.offset])
            self.segment = Segment(sequence, state.pending, positions, None)

    def alone(self) -> Step:
        if self.member.key is not None and not self.by_itself:
            return super().alone()  # its key read with its token: one read
        self.member.seed()
        self.member.state, step = self.decoder.step(self.state)
        if self.member.key is not None:
            self.member.key = key_value(np.array(current_key()))  # the context's end: once
        return step

    def _conclude(self, hidden, logits):
        state = self.state
        self.choice = choose(logits, state.decoding.sampler)
        self.emitted = emitted_logprobs(state.decoding, logits, self.choice)
        values = (mx.concatenate([state.pending, self.choice]).astype(mx.int32),)
        return values, self.emitted.arrays()

    def _finish(self, read):
        return autoregressive.chained(self.state, self.choice, self.emitted, int(read[0][0]))


def _taps(decoder: Decoder) -> dict:
    return dict.fromkeys(taps_of(decoder.drafter))


def _split(rows: mx.array, like: list[mx.array]) -> list[mx.array]:
    """``rows (N, ...)`` split as ``like``'s arrays' first axes."""
    parts, start = [], 0
    for x in like:
        parts.append(rows[start : start + x.shape[0]])
        start += x.shape[0]
    return parts
