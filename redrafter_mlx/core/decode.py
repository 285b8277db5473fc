"""The decode loops: prefill, then per step draft -> pack -> verify -> accept -> compact.

Legend: W beam width, L beam length, T tree nodes, S cached tokens, H hidden, V vocab.

State between steps: the cache holds the accepted prefix; ``pending`` is the target's next token
(emitted, not yet in the cache); ``context`` is the hidden state that predicted it; ``beams`` were
drafted from the two. Each step makes exactly one host read: the accepted beam, its accepted
count, the next pending token and the *next* step's beams, all in one array. Everything between
two reads is one lazy graph. With a path-probability floor (``BeamShape.min_prob``) the drafter
also reads its best score after each depth but the last, to stop drafting as soon as nothing
deeper could be verified (``Step.syncs`` counts those reads).

With ``BeamShape.lookup`` K > 0 the step adds up to K prompt-lookup beams
(:mod:`redrafter_mlx.core.lookup`), made on the host from the token history after the read: the
same tree, verify and acceptance, no extra read. Without a drafter they are the only beams.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from redrafter_mlx.core import llm
from redrafter_mlx.core.accept import Sampler, accept, choose
from redrafter_mlx.core.cache import KVCache
from redrafter_mlx.core.draft import BeamDrafter, check_width
from redrafter_mlx.core.errors import ContextFull
from redrafter_mlx.core.lookup import NgramIndex
from redrafter_mlx.core.plan import Plan
from redrafter_mlx.core.shape import BeamShape, verified_sizes
from redrafter_mlx.core.tree import pack_beams, pad_tree, prune, tree_mask, verified_size

PHASES = ("draft", "pack", "verify", "accept", "compact")


@dataclass
class Step:
    """What one decode step emitted, with its counters."""

    tokens: list[int]  # emitted tokens (accepted drafts + the target's own next token)
    tree_size: int = 1  # nodes verified (1 for an autoregressive step)
    syncs: int = 1  # host reads this step made (excluding timing evals)
    # Where the accepted drafts came from: "drafter", "lookup", "both" (a beam of each source
    # held them) or None (none accepted).
    accepted_from: str | None = None


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


@dataclass
class Decoder:
    """A target model (plus optional drafter) and the knobs of one generation."""

    model: nn.Module
    sampler: Sampler
    drafter: BeamDrafter | None = None
    shape: BeamShape = field(default_factory=BeamShape)
    max_context: int | None = None
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    plan: Plan = field(default_factory=Plan)  # how this device runs it (backend.plan_for)
    seed: int | None = None  # the sampling seed (warm_up re-seeds with it)

    def new_cache(self) -> KVCache:
        return llm.make_cache(self.model)

    def _forward(self, tokens, positions, mask, cache: KVCache, *, compiled: bool = True):
        """:func:`llm.forward` of the target with this decoder's plan."""
        return llm.forward(
            self.model, tokens, positions, mask, cache, compiled=compiled, plan=self.plan
        )

    def _has_room(self, cache: KVCache, needed: int) -> bool:
        return self.max_context is None or cache.offset + needed <= self.max_context

    def _check_room(self, cache: KVCache, needed: int) -> None:
        if not self._has_room(cache, needed):
            raise ContextFull(
                f"context full: {cache.offset} cached + {needed} new tokens exceed the "
                f"model's {self.max_context}-token context"
            )

    @property
    def drafted(self) -> bool:
        """Whether steps draft beams with a drafter (else only lookup beams)."""
        return self.drafter is not None

    def check_shape(self, shape: BeamShape) -> None:
        """ValueError when the drafter cannot search ``shape``: more beams than draft tokens."""
        if isinstance(self.drafter, BeamDrafter):
            check_width(self.drafter.drafter, shape.searched)

    def warm_up(self, *, autoregressive: bool = False) -> None:
        """Trace (and build the kernels of) everything a step of the current shape and sampler
        runs: a prompt forward (mlx-lm's modules), the verify forward at each compiled size of
        :func:`verified_sizes`, the sampler at every size a step can sample (the prompt's one
        row included), the beam search to its full depth. Then re-seed, if a seed was given,
        so the warm-up's draws do not shift the answers.

        Call it when the shape or sampler is chosen, not mid-answer: a new size met in an answer
        would stop it to compile, and on the CPU backend MLX runs g++ meanwhile, which swallows
        Ctrl-C. Costs one small forward per compiled size (each is traced once per model).
        """
        sizes = [1] if autoregressive else self._verified_sizes()
        cache = self.new_cache()
        prompt = mx.zeros((2,), mx.int32)
        hidden = self._forward(prompt, mx.arange(2), llm.CAUSAL, cache, compiled=False)
        logits = llm.lm_head(self.model, hidden)
        mx.eval(logits)
        for size in sorted({1, *sizes}):
            if size <= self.plan.compiled_max_rows:  # bigger trees run eagerly: nothing to trace
                mask = llm.chain_mask(0, size) if size > 1 else None
                tokens = mx.zeros((size,), mx.int32)
                hidden = self._forward(tokens, mx.arange(size), mask, cache)
            rows = mx.zeros((size, logits.shape[-1]), logits.dtype)
            mx.eval(hidden, choose(rows, self.sampler))
        if not autoregressive and self.drafted:
            pending = mx.array(0, mx.int32)
            self.drafter.warm_up(hidden[-1], pending, **self._search_options())
        if self.seed is not None:
            mx.random.seed(self.seed)

    def prefill(self, cache: KVCache, prompt: list[int]) -> tuple[mx.array, mx.array]:
        """Feed ``prompt`` after the cache; return the next token ``()`` and its context (H,)."""
        if not prompt:
            raise ValueError("empty prompt: nothing to condition on")
        self._check_room(cache, len(prompt) + 1)
        for start in range(0, len(prompt), self.plan.prefill_chunk):
            chunk = prompt[start : start + self.plan.prefill_chunk]
            positions = mx.arange(cache.offset, cache.offset + len(chunk))
            hidden = self._forward(
                mx.array(chunk),
                positions,
                llm.CAUSAL,
                cache,
                compiled=False,  # fixed shapes only: decode steps, not prompts
            )
            mx.eval(hidden, *cache.state())  # bound the graph per chunk
            mx.clear_cache()  # a chunk's activations are large: give them back (as mlx-lm)
            cache.commit(chunk)
        logits = llm.lm_head(self.model, hidden[-1:])
        token = choose(logits, self.sampler)[0]
        return token.astype(mx.int32), hidden[-1]

    def autoregressive(self, cache: KVCache, prompt: list[int]) -> Iterator[Step]:
        """Plain decoding with the same forward: one target pass, one token, one sync per step.

        Pipelined as mlx-lm's loop is: the next token's forward is built from the current
        token while it is still on the device, and handed to MLX (``async_eval``) before the
        current token is read, so the device never waits for Python between steps. Each
        yielded token is in the cache (its K/V written, committed) by the time it is yielded,
        but for the last one a full context has no room for.
        """
        token, _ = self.prefill(cache, prompt)
        token = token[None]  # (1,)
        while True:
            if not self._has_room(cache, 1):
                yield Step([token.item()])  # the context's last token: no K/V needed
                self._check_room(cache, 1)  # raises ContextFull
            choice, _ = self._one_token(cache, token)  # writes this token's K/V
            mx.async_eval(choice)
            value = token.item()  # host read: this token (the next one is computing)
            cache.commit([value])
            yield Step([value])
            token = choice

    def speculative(self, cache: KVCache, prompt: list[int]) -> Iterator[Step]:
        """ReDrafter decoding: each step emits 1..L tokens with one target pass, verifying the
        drafter's beams and the shape's lookup beams (lookup beams alone without a drafter)."""
        if not self.drafted and not self.shape.lookup:
            raise ValueError("speculative decoding needs a drafter or lookup beams")
        pending, context = self.prefill(cache, prompt)
        read, draft = self._first_draft(context, pending)
        index = self._lookup_index(cache)
        yield Step([int(read[0])])
        while True:
            draft, step = self._step(cache, *draft, index)
            yield step

    def _lookup_index(self, cache: KVCache) -> NgramIndex | None:
        """The n-gram index of the cached tokens when the shape has lookup beams."""
        return NgramIndex(cache.ids) if self.shape.lookup else None

    def _verified_sizes(self) -> frozenset[int]:
        return _verified_sizes(self.shape, self.plan.tree_sizes, self.drafted)

    def time_steps(self, cache: KVCache, reps: int = 4) -> tuple[float, float]:
        """Seconds of a one-token step and of a ReDrafter step of the current shape at the
        cache's length, timed alike: interleaved, each warmed up, each ending in its host read.

        Both write only scratch K/V after ``cache.offset`` and the cache is rewound after each
        step, so the conversation is intact. The drafted beams come from the last cached token's
        hidden state, so the tree's size is the one this shape verifies there.
        """
        if not self.drafted and not self.shape.lookup:
            raise ValueError("timing a speculative step needs a drafter or lookup beams")
        self._check_room(cache, self.shape.length + 1)
        with _same_random_stream():  # sampled answers after the timing stay as without it
            return self._time_steps(cache, reps)

    def _time_steps(self, cache: KVCache, reps: int) -> tuple[float, float]:
        offset = cache.offset
        cache.reserve(1)
        token = mx.array([cache.ids[-1] if cache.ids else 0])

        def one_token() -> tuple[np.ndarray, mx.array]:
            choice, hidden = self._one_token(cache, token)
            return _host_read(choice), hidden

        pending, hidden = one_token()
        _, draft = self._first_draft(hidden[-1], mx.array(int(pending[0]), mx.int32))
        index = self._lookup_index(cache)

        def speculative() -> None:
            self._step(cache, *draft, index)
            cache.rewind(offset)
            if index is not None:
                index.rewind(offset)

        seconds = {one_token: 0.0, speculative: 0.0}
        for rep in range(reps + 1):  # the first round warms up
            for run in seconds:
                tic = time.perf_counter()
                run()
                if rep:
                    seconds[run] += time.perf_counter() - tic
        return seconds[one_token] / reps, seconds[speculative] / reps

    def _one_token(self, cache: KVCache, token: mx.array) -> tuple[mx.array, mx.array]:
        """Feed ``token (1,)`` at ``cache.offset`` (not committed) -> the sampler's next token
        ``(1,)`` and the hidden state ``(1, H)``, lazily."""
        hidden = self._forward(token, mx.array([cache.offset]), None, cache)
        return choose(llm.lm_head(self.model, hidden), self.sampler), hidden

    def _draft(self, context: mx.array, token: mx.array) -> tuple[mx.array, mx.array | None]:
        """The drafter's beams ``(W, L)`` (and log-probs) of the current shape from the
        hidden state ``context (H,)`` and the pending ``token ()``, lazily."""
        return self.drafter(context, token, **self._search_options())

    def _search_options(self) -> dict:
        """The drafter's options for this shape. Without the plan's early stop a floored search
        drafts every depth (no host read per depth); the step prunes the tree by the same
        floor after its one read, so the verified tree is the same."""
        options = self.shape.search_options()
        if not self.plan.draft_early_stop:
            options["min_prob"] = 0.0
        return options

    def _first_draft(self, context: mx.array, pending: mx.array):
        """Draft from the prompt's (or any) state: one host read -> ``(read, draft)``, where
        ``read[0]`` is ``pending`` and ``draft`` is what :meth:`_step` takes."""
        drafted = self._draft(context, pending) if self.drafted else (None, None)
        read, logprobs = self._read(pending[None], *drafted)
        return read, (int(read[0]), self._beams(read[1:]), logprobs)

    def _beams(self, values: np.ndarray) -> np.ndarray:
        """The drafted beams ``(W, L)`` of a read (``(0, L)`` without a drafter)."""
        return values.reshape(-1, self.shape.length)

    def _read(self, values: mx.array, beams: mx.array | None, logprobs: mx.array | None):
        """The step's one host read: ``values`` then ``beams`` flattened (int), plus the drafted
        tokens' log-probs when the tree is pruned by them (None otherwise)."""
        ints = values.astype(mx.int32)
        if beams is not None:
            ints = mx.concatenate([ints, beams.reshape(-1)])
        if beams is None or not self.shape.min_prob:
            return _host_read(ints), None
        return _host_read(ints, logprobs)

    def _with_lookup(self, pending: int, beams: np.ndarray, logprobs, index: NgramIndex | None):
        """The drafted ``beams (W, L)`` followed by the lookup beams of ``pending`` ``(k, L)``
        (their tokens score log-prob 0: a floor never prunes them); the root alone ``(1, 1)``
        when there is no beam at all."""
        if index is not None:
            found = index.propose(pending, self.shape.lookup, self.shape.length)
            beams = np.concatenate([beams, found])
            if logprobs is not None:
                logprobs = np.concatenate([logprobs, np.zeros((len(found), beams.shape[1] - 1))])
        if not len(beams):
            return np.full((1, 1), pending, np.int32), logprobs
        return beams, logprobs

    def _step(
        self,
        cache: KVCache,
        pending: int,
        drafted: np.ndarray,
        logprobs: np.ndarray | None,
        index: NgramIndex | None = None,
    ) -> tuple[tuple[int, np.ndarray, np.ndarray | None], Step]:
        """One pack -> verify -> accept -> compact -> draft step from the ``pending`` token,
        the host's ``drafted (W, L)`` beams (and their drafted tokens' ``logprobs (W, L - 1)``
        when pruning) and, with ``index``, its lookup beams."""
        timer = self.timer
        timer.start()
        beams, logprobs = self._with_lookup(pending, drafted, logprobs, index)
        self._check_room(cache, 1)  # the root's position
        room = None if self.max_context is None else self.max_context - cache.offset
        if room is not None and room < beams.shape[1]:  # near the context's end: shorter
            beams = beams[:, :room]  # beams, so the answer stops where the autoregressive one does
            logprobs = None if logprobs is None else logprobs[:, : room - 1]
        tree = pack_beams(beams)
        if logprobs is not None:
            tree = prune(tree, logprobs, self.shape.min_prob, self.plan.tree_sizes)
        size = tree.size
        tree = pad_tree(tree, verified_size(size, self.plan.tree_sizes))
        mask = tree_mask(tree, cache.offset)
        positions = mx.array(cache.offset + tree.depths)
        timer.mark("pack", mask)
        cache.reserve(max(tree.size, beams.shape[1]))  # compaction writes L slots
        tokens = mx.array(tree.tokens)
        # shortened beams make sizes warm_up did not compile: run those few eagerly
        compiled = tree.size in self._verified_sizes()
        hidden = self._forward(tokens, positions, mask, cache, compiled=compiled)
        logits = llm.lm_head(self.model, hidden)
        timer.mark("verify", logits)
        pruned = tree.unpack < 0  # never accepted: a token id no choice can equal
        result = accept(
            mx.array(np.where(pruned, -1, beams)),
            mx.array(np.maximum(tree.unpack, 0)),
            logits,
            self.sampler,
        )
        timer.mark("accept", result.num_accepted, result.next_token)
        if not tree.paths_in_place:
            cache.compact(result.path)
        timer.mark("compact", *cache.state())
        if self.drafted:
            next_drafted = self._draft(hidden[result.last_node], result.next_token)
        else:
            next_drafted = (None, None)
        draft_syncs = getattr(self.drafter, "syncs", 0)
        read, next_logprobs = self._read(
            mx.stack([result.best, result.num_accepted, result.next_token]), *next_drafted
        )
        timer.mark("draft")
        best, num_accepted, next_token = (int(x) for x in read[:3])
        root_and_accepted = beams[best, : num_accepted + 1].tolist()
        cache.commit(root_and_accepted)
        if index is not None:
            index.extend(root_and_accepted)
        step = Step(
            root_and_accepted[1:] + [next_token],
            tree_size=size,
            syncs=1 + draft_syncs,
            accepted_from=_source(beams, len(drafted), best, num_accepted),
        )
        return (next_token, self._beams(read[3:]), next_logprobs), step


@functools.lru_cache(maxsize=64)
def _verified_sizes(shape: BeamShape, tree_sizes: tuple[int, ...], drafted: bool) -> frozenset:
    return frozenset(verified_sizes(shape, tree_sizes, drafted=drafted))


def _source(beams: np.ndarray, drafted: int, best: int, num_accepted: int) -> str | None:
    """Which beams of ``beams (W + k, L)`` (the first ``drafted`` the drafter's, the rest
    lookup's) hold the ``num_accepted`` tokens accepted from beam ``best``."""
    if not num_accepted:
        return None
    accepted = beams[best, 1 : num_accepted + 1]
    holds = (beams[:, 1 : num_accepted + 1] == accepted).all(axis=1)
    from_drafter, from_lookup = bool(holds[:drafted].any()), bool(holds[drafted:].any())
    return "both" if from_drafter and from_lookup else "drafter" if from_drafter else "lookup"


@contextmanager
def _same_random_stream() -> Iterator[None]:
    """Restore MLX's global random key on exit: draws made inside do not shift later ones."""
    key = mx.array(mx.random.state[0])
    mx.eval(key)
    try:
        yield
    finally:
        mx.random.state[0][...] = key  # in place: the state holds this array


def _host_read(*values: mx.array) -> np.ndarray | tuple[np.ndarray, ...]:
    """The one place a decode step reads device values back to the host (one evaluation)."""
    mx.eval(*values)
    arrays = tuple(np.array(v) for v in values)
    return arrays[0] if len(arrays) == 1 else arrays
