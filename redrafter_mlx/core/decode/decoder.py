"""The :class:`Decoder`, built once per (target, drafter, plan): a prefill and a step per
mode over one :class:`~redrafter_mlx.core.decode.sequence.Sequence`.

Legend: W beam width, L beam length, T tree nodes, S cached tokens, H hidden, V vocab.

::

    decoder = backend.plan.build_decoder(model, drafter)
    sequence = decoder.new_sequence()
    state, first = decoder.prefill(sequence, prompt, Decoding(mode, shape, sampler))
    state, step = decoder.step(state)          # again and again

A speculative mode steps a :class:`~redrafter_mlx.core.decode.speculative.TreeState`
(:mod:`~redrafter_mlx.core.decode.speculative`), the autoregressive mode a
:class:`~redrafter_mlx.core.decode.autoregressive.ChainState`
(:mod:`~redrafter_mlx.core.decode.autoregressive`). A state is stepped once: stepping it again after
the sequence moved on raises :class:`~redrafter_mlx.core.decode.step.SpentState`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from redrafter_mlx.core.decode import autoregressive, llm, speculative
from redrafter_mlx.core.decode.accept import Sampler, choose
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.plan import Plan
from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.shape import BeamShape, verified_sizes
from redrafter_mlx.core.decode.source import Source, new_part, observe, taps_of
from redrafter_mlx.core.decode.step import Decoding, PhaseTimer, SpentState, Step, emitted_logprobs
from redrafter_mlx.core.errors import Cancelled, ContextFull

State = speculative.TreeState | autoregressive.ChainState


@dataclass(frozen=True)
class Decoder:
    """A target, its drafter (or None) and the device plan, built once, never changed.

    ``forward`` is the target's verify forward (``llm.Forward`` or a plan's own, over a copy of
    the target: the caller's model is not changed); ``model`` is the model it runs. ``drafter``
    is any :class:`~redrafter_mlx.core.decode.source.Source` (ReDrafter's RNN, EAGLE-3, DFlash, MTP)
    or None.
    """

    forward: llm.Forward
    drafter: Source | None = None
    plan: Plan = Plan()
    max_context: int | None = None

    @property
    def model(self) -> nn.Module:
        return self.forward.model

    def new_sequence(self) -> Sequence:
        sequence = llm.new_sequence(self.model)
        part = new_part(self.drafter)
        if part is not None:  # the drafter's own state, committed and rewound with it
            sequence.parts.append(part)
        return sequence

    def check(self, decoding: Decoding) -> None:
        """ValueError when ``decoding`` cannot run here: a drafter mode without a drafter,
        lookup alone without lookup beams, more beams than draft tokens, or a shape the
        drafter cannot draft (longer beams than a DFlash block)."""
        mode, shape = decoding.mode, decoding.shape
        if mode is Mode.REDRAFTER and self.drafter is None:
            raise ValueError("ReDrafter decoding needs a drafter")
        if mode is Mode.LOOKUP and not shape.lookup:
            raise ValueError("speculative decoding needs a drafter or lookup beams")
        if mode.drafted:
            self.drafter.check_shape(shape)

    # -- prefill and steps

    def prefill(
        self,
        sequence: Sequence,
        prompt: list[int],
        decoding: Decoding,
        *,
        timer: PhaseTimer | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> tuple[State, Step | None]:
        """Feed ``prompt`` after the sequence and draft the first beams: the first state and
        the first emitted token (None when autoregressive: its first step emits it,
        pipelined). ``cancelled`` is asked between prompt chunks (raises Cancelled; the chunks
        fed so far stay committed, a prefix the next prompt can reuse)."""
        return run_chunks(self.prefilling(sequence, prompt, decoding, timer=timer), cancelled)

    def prefilling(
        self,
        sequence: Sequence,
        prompt: list[int],
        decoding: Decoding,
        *,
        timer: PhaseTimer | None = None,
    ) -> Generator[None, None, tuple[State, Step | None]]:
        """:meth:`prefill` one prompt chunk per ``next``: it yields between chunks (where a
        server steps its other sequences) and returns :meth:`prefill`'s result."""
        self.check(decoding)
        fed = yield from self.feeding(sequence, prompt, decoding.sampler)
        pending, context, logits = fed
        if not decoding.mode.speculative:
            first = autoregressive.first_state(sequence, decoding, pending, logits, context)
            return first, None
        emitted = emitted_logprobs(decoding, logits, pending[None])
        state = speculative.drafted_state(
            self, sequence, decoding, context, pending, emitted, timer
        )
        return state, emitted.read([state.pending])

    def step(self, state: State) -> tuple[State, Step]:
        """One decode step from ``state``: the next state and what the step emitted.
        ContextFull when the context has no room for the step's first token; SpentState when
        the sequence has moved on since ``state`` was made."""
        if state.version != state.sequence.version:
            raise SpentState(
                f"this decode state was made at version {state.version} of its sequence, "
                f"which is at {state.sequence.version}: step the state the last step returned"
            )
        if isinstance(state, speculative.TreeState):
            return speculative.speculative_step(self, state)
        return autoregressive.chain_step(self, state)

    def switch(self, state: State, decoding: Decoding) -> tuple[State, Step | None]:
        """``state`` continued with ``decoding``, speculative or plain, between two steps: a
        plain state turned speculative emits its pending token (the returned step) and drafts
        for it; a speculative one turned plain feeds its pending token (emitted already) and
        chooses the next, emitting nothing (None). A decoding of the state's own kind (or a
        full context's last tokens, or a batch's plain state, which keeps no hidden state) leaves
        ``state`` as it is. Drafters that keep a part per sequence (EAGLE-3, DFlash, MTP) read
        every committed token's taps, which plain steps do not record: ValueError."""
        if decoding.mode.speculative == isinstance(state, speculative.TreeState):
            return state, None
        if new_part(self.drafter) is not None:
            raise ValueError("this drafter keeps a part per sequence: it cannot switch modes")
        undrafted = isinstance(state, autoregressive.ChainState) and state.context is None
        if undrafted or not self.has_room(state.sequence, 2):  # a batch's, or near the end
            return state, None
        self.check(decoding)
        if isinstance(state, speculative.TreeState):
            return autoregressive.from_tree(self, state, decoding), None
        return speculative.from_chain(self, state, decoding)

    def next_token(self, sequence: Sequence, token: mx.array, sampler: Sampler):
        """Feed ``token (1,)`` after the sequence (not committed) -> the sampler's next token
        ``(1,)``, the hidden state ``(1, H)`` and the logits ``(1, V)`` it was chosen from,
        lazily."""
        hidden = self.forward(token, mx.array([sequence.offset]), None, sequence)
        logits = self.forward.lm_head(hidden)
        return choose(logits, sampler), hidden, logits

    # -- the context's room

    def room(self, sequence: Sequence) -> int | None:
        """Tokens the context still has room for after the sequence (None: no limit)."""
        return None if self.max_context is None else self.max_context - sequence.offset

    def has_room(self, sequence: Sequence, needed: int) -> bool:
        room = self.room(sequence)
        return room is None or needed <= room

    def prompt_fits(self, prompt_tokens: int) -> bool:
        """Whether a prompt of ``prompt_tokens`` leaves room for at least one new token."""
        return self.max_context is None or prompt_tokens + 1 <= self.max_context

    def check_room(self, sequence: Sequence, needed: int) -> None:
        if not self.has_room(sequence, needed):
            raise ContextFull(
                f"context full: {sequence.offset} cached + {needed} new tokens exceed the "
                f"model's {self.max_context}-token context"
            )

    def feed(self, sequence: Sequence, prompt: list[int], sampler: Sampler, cancelled=None):
        """Feed ``prompt`` in chunks and commit it -> the next token ``()``, its context
        ``(H,)`` and the logits ``(1, V)`` it was chosen from."""
        return run_chunks(self.feeding(sequence, prompt, sampler), cancelled)

    def feeding(self, sequence: Sequence, prompt: list[int], sampler: Sampler):
        """:meth:`feed`, yielding between its chunks."""
        if not prompt:
            raise ValueError("empty prompt: nothing to condition on")
        self.check_room(sequence, len(prompt) + 1)
        chunk_size = self.plan.prefill_chunk
        taps = dict.fromkeys(taps_of(self.drafter))
        for start in range(0, len(prompt), chunk_size):
            if start:
                yield
            chunk = prompt[start : start + chunk_size]
            positions = mx.arange(sequence.offset, sequence.offset + len(chunk))
            # prompts have arbitrary lengths: uncompiled (fixed shapes are the decode steps')
            hidden = self.forward(
                mx.array(chunk), positions, llm.CAUSAL, sequence, compiled=False, taps=taps
            )
            observe(self.drafter, sequence, taps, mx.arange(len(chunk)))
            mx.eval(hidden, *sequence.arrays())  # bound the graph per chunk
            mx.clear_cache()  # a chunk's activations are large: give them back (as mlx-lm)
            sequence.commit(chunk)
        sequence.snapshot()  # recurrent layers: a later prompt can come back to here
        logits = self.forward.lm_head(hidden[-1:])
        token = choose(logits, sampler)[0]
        return token.astype(mx.int32), hidden[-1], logits

    # -- what a step compiles and drafts

    def compiles(self, size: int, decoding: Decoding) -> bool:
        """Whether a forward of ``size`` tokens runs compiled: the sizes ``decoding``'s steps
        verify (each traced by :meth:`warm_up`) up to the plan's limit. Others (prompts,
        beams cut short near the context's end) run eagerly: a new size met mid-answer would
        stop it to compile."""
        if size > self.plan.compiled_max_rows:
            return False
        if size == 1:  # a one-token step (probing and timing use it too)
            return True
        drafted = decoding.mode.drafted
        speculative_mode = decoding.mode.speculative
        return speculative_mode and size in _verified_sizes(
            decoding.shape, self.plan.tree_sizes, drafted
        )

    def search_options(self, shape: BeamShape) -> dict:
        """The drafter's options for ``shape``. Without the plan's early stop a floored search
        drafts every depth (no host read per depth); the step prunes the tree by the same
        floor after its one read, so the verified tree is the same."""
        options = shape.search_options()
        if not self.plan.draft_early_stop:
            options["min_prob"] = 0.0
        return options

    def warm_up(self, decoding: Decoding) -> None:
        """Trace (and build the kernels of) everything a step of ``decoding`` runs: a prompt
        forward, the verify forward at each compiled size, the sampler at every size a step
        can sample (the prompt's one row included), the beam search to its full depth.

        Call it when the shape or sampler is chosen, not mid-answer: on the CPU backend MLX
        runs g++ while compiling, which swallows Ctrl-C. Costs one small forward per compiled
        size (each is traced once per decoder). Draws from MLX's random stream: re-seed
        after it where answers must be reproducible.
        """
        self.check(decoding)
        speculative_mode = decoding.mode.speculative
        sizes = [1]
        if speculative_mode:
            sizes = _verified_sizes(decoding.shape, self.plan.tree_sizes, decoding.mode.drafted)
        sequence = self.new_sequence()
        hidden = self.forward(
            mx.zeros((2,), mx.int32), mx.arange(2), llm.CAUSAL, sequence, compiled=False
        )
        logits = self.forward.lm_head(hidden)
        mx.eval(logits)
        for size in sorted({1, *sizes}):
            if self.compiles(size, decoding):  # bigger trees run eagerly: nothing to trace
                mask = llm.chain_mask(0, size) if size > 1 else None
                tokens = mx.zeros((size,), mx.int32)
                hidden = self.forward(tokens, mx.arange(size), mask, sequence)
            rows = mx.zeros((size, logits.shape[-1]), logits.dtype)
            mx.eval(hidden, choose(rows, decoding.sampler))
        if decoding.mode.drafted:
            pending = mx.array(0, mx.int32)
            self.drafter.warm_up(hidden[-1], pending, **self.search_options(decoding.shape))


def run_chunks(chunks: Generator, cancelled: Callable[[], bool] | None = None):
    """Run a generator that yields between prompt chunks to its end -> what it returns;
    ``cancelled`` is asked at each yield (Cancelled: the chunks fed so far stay committed)."""
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return done.value
        if cancelled is not None and cancelled():
            chunks.close()
            raise Cancelled("cancelled during the prompt")


@functools.lru_cache(maxsize=64)
def _verified_sizes(shape: BeamShape, tree_sizes: tuple[int, ...], drafted: bool) -> frozenset:
    return frozenset(verified_sizes(shape, tree_sizes, drafted=drafted))
