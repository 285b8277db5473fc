"""The decode step: prefill, then per step pack -> verify -> accept -> compact -> draft.

Legend: W beam width, L beam length, T tree nodes, S cached tokens, H hidden, V vocab.

A :class:`Verifier` is built once per (target, drafter, plan) and never changes; a
:class:`DecodeState` holds everything that moves between two steps, and
:meth:`Verifier.step` is the one way to advance it::

    verifier = backend.plan.build_verifier(model, drafter)
    state, first = verifier.prefill(cache, prompt, Decoding(mode, shape, sampler))
    state, step = verifier.step(state)          # again and again

State between steps: the cache holds the accepted prefix; ``pending`` is the target's next token
(emitted, not yet in the cache); ``beams`` were drafted from it and the hidden state that
predicted it. Each speculative step makes exactly one host read: the accepted beam, its
accepted count, the next pending token and the *next* step's beams, all in one array.
Everything between two reads is one lazy graph. With a path-probability floor
(``BeamShape.min_prob``) and the plan's early stop the drafter also reads its best score after
each depth but the last, to stop drafting as soon as nothing deeper could be verified
(``Step.syncs`` counts those reads).

With ``BeamShape.lookup`` K > 0 the step adds up to K prompt-lookup beams
(:mod:`redrafter_mlx.core.lookup`), made on the host from the token history after the read: the
same tree, verify and acceptance, no extra read. Without a drafter (:data:`Mode.LOOKUP`) they
are the only beams. An autoregressive state steps one token at a time through the same call.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from redrafter_mlx.core import llm
from redrafter_mlx.core.accept import Sampler, accept, choose, greedy
from redrafter_mlx.core.cache import KVCache
from redrafter_mlx.core.draft import BeamDrafter, check_width
from redrafter_mlx.core.errors import Cancelled, ContextFull
from redrafter_mlx.core.lookup import NgramIndex
from redrafter_mlx.core.mode import Mode
from redrafter_mlx.core.plan import Plan
from redrafter_mlx.core.shape import BeamShape, verified_sizes
from redrafter_mlx.core.tree import Tree, pack_beams, pad_tree, prune, tree_mask, verified_size

PHASES = ("draft", "pack", "verify", "accept", "compact")


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
class DecodeState:
    """Everything a step reads and the next step needs.

    ``cache`` advances in place (it is the conversation's KV buffer): a state is spent once it
    has been stepped. ``pending`` is the host's next token (speculative modes) or, pipelined,
    the device's ``(1,)`` next token not read yet (autoregressive). ``beams (W, L)`` and their
    drafted tokens' ``logprobs (W, L - 1)`` (only when a floor prunes) were drafted for
    ``pending``; ``index`` is the n-gram index of the cached tokens when the shape has lookup
    beams.
    """

    cache: KVCache
    decoding: Decoding
    pending: int | mx.array
    beams: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    index: NgramIndex | None = None
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    steps: int = 0  # decode steps taken since the prefill
    pending_logprobs: mx.array | None = None  # (1, V) autoregressive, with Decoding.logprobs
    pending_top: tuple | None = None  # autoregressive, with Decoding.top_logprobs


@dataclass(frozen=True)
class Verifier:
    """A target, its drafter (or None) and the device plan, built once, never changed.

    ``forward`` is the target's verify forward (``llm.Forward`` or a plan's own, over a copy of
    the target: the caller's model is not changed); ``model`` is the model it runs. ``drafter``
    is a :class:`BeamDrafter` or anything with its ``search`` method.
    """

    forward: llm.Forward
    drafter: BeamDrafter | None = None
    plan: Plan = Plan()
    max_context: int | None = None

    @property
    def model(self) -> nn.Module:
        return self.forward.model

    def new_cache(self) -> KVCache:
        return llm.make_cache(self.model)

    def check(self, decoding: Decoding) -> None:
        """ValueError when ``decoding`` cannot run here: a drafter mode without a drafter,
        lookup alone without lookup beams, or more beams than draft tokens."""
        mode, shape = decoding.mode, decoding.shape
        if mode is Mode.REDRAFTER and self.drafter is None:
            raise ValueError("ReDrafter decoding needs a drafter")
        if mode is Mode.LOOKUP and not shape.lookup:
            raise ValueError("speculative decoding needs a drafter or lookup beams")
        if mode.drafted and isinstance(self.drafter, BeamDrafter):
            check_width(self.drafter.drafter, shape.searched)

    # -- prefill and steps

    def prefill(
        self,
        cache: KVCache,
        prompt: list[int],
        decoding: Decoding,
        *,
        timer: PhaseTimer | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> tuple[DecodeState, Step | None]:
        """Feed ``prompt`` after the cache and draft the first beams: the first state and the
        first emitted token (None when autoregressive: its first step emits it, pipelined).
        ``cancelled`` is asked between prompt chunks (raises Cancelled; the chunks fed so far
        stay committed, a prefix the next prompt can reuse)."""
        self.check(decoding)
        timer = timer or PhaseTimer()
        pending, context, logits = self._feed(cache, prompt, decoding.sampler, cancelled)
        rows, top = emitted_logprobs(decoding, logits, pending[None])
        if not decoding.mode.speculative:
            mx.async_eval(pending, *_present(rows, *(top or ())))
            state = DecodeState(
                cache,
                decoding,
                pending[None],
                timer=timer,
                pending_logprobs=rows,
                pending_top=top,
            )
            return state, None
        keep = _present(rows, *(top or ()))
        state = self._drafted_state(cache, decoding, context, pending, keep, timer)
        return state, Step([state.pending], logprobs=rows, top_logprobs=TopLogprobs.read(top))

    def probe(self, cache: KVCache, decoding: Decoding) -> DecodeState:
        """A speculative state after the cached tokens, as if the last of them were fed again:
        its forward writes only scratch K/V after ``cache.offset`` (for timing steps at this
        length; rewind the cache to its offset after each step)."""
        cache.reserve(1)
        token = mx.array([cache.ids[-1] if cache.ids else 0])
        choice, hidden, _ = self._next_token(cache, token, decoding.sampler)
        pending = mx.array(int(_host_read(choice)[0]), mx.int32)
        return self._drafted_state(cache, decoding, hidden[-1], pending)

    def _drafted_state(
        self, cache, decoding: Decoding, context, pending, keep=(), timer=None
    ) -> DecodeState:
        """The speculative state of ``pending ()`` drafted from ``context (H,)``, after one
        host read (``keep``'s arrays evaluated with it), with the cached tokens' n-gram index
        when the shape has lookup beams."""
        read, beams, logprobs = self._first_draft(decoding, context, pending, keep)
        index = NgramIndex(cache.ids) if decoding.shape.lookup else None
        timer = timer or PhaseTimer()
        return DecodeState(cache, decoding, int(read[0]), beams, logprobs, index, timer)

    def step(self, state: DecodeState) -> tuple[DecodeState, Step]:
        """One decode step from ``state``: the next state and what the step emitted.
        ContextFull when the context has no room for the step's first token."""
        if state.decoding.mode.speculative:
            return self._speculative_step(state)
        return self._autoregressive_step(state)

    def one_token(
        self, cache: KVCache, token: mx.array, sampler: Sampler
    ) -> tuple[mx.array, mx.array]:
        """Feed ``token (1,)`` at ``cache.offset`` (not committed) -> the sampler's next token
        ``(1,)`` and the hidden state ``(1, H)``, lazily."""
        choice, hidden, _ = self._next_token(cache, token, sampler)
        return choice, hidden

    def _next_token(self, cache: KVCache, token: mx.array, sampler: Sampler):
        """:meth:`one_token`, and the logits ``(1, V)`` the choice was made from."""
        hidden = self.forward(token, mx.array([cache.offset]), None, cache)
        logits = self.forward.lm_head(hidden)
        return choose(logits, sampler), hidden, logits

    def has_room(self, cache: KVCache, needed: int) -> bool:
        return self.max_context is None or cache.offset + needed <= self.max_context

    def check_room(self, cache: KVCache, needed: int) -> None:
        if not self.has_room(cache, needed):
            raise ContextFull(
                f"context full: {cache.offset} cached + {needed} new tokens exceed the "
                f"model's {self.max_context}-token context"
            )

    def _feed(self, cache: KVCache, prompt: list[int], sampler: Sampler, cancelled):
        """Feed ``prompt`` in chunks -> the next token ``()``, its context (H,) and the logits
        ``(1, V)`` it was chosen from."""
        if not prompt:
            raise ValueError("empty prompt: nothing to condition on")
        self.check_room(cache, len(prompt) + 1)
        chunk_size = self.plan.prefill_chunk
        for start in range(0, len(prompt), chunk_size):
            if cancelled is not None and start and cancelled():
                raise Cancelled("cancelled during the prompt")
            chunk = prompt[start : start + chunk_size]
            positions = mx.arange(cache.offset, cache.offset + len(chunk))
            # prompts have arbitrary lengths: uncompiled (fixed shapes are the decode steps')
            hidden = self.forward(mx.array(chunk), positions, llm.CAUSAL, cache, compiled=False)
            mx.eval(hidden, *cache.state())  # bound the graph per chunk
            mx.clear_cache()  # a chunk's activations are large: give them back (as mlx-lm)
            cache.commit(chunk)
        cache.snapshot()  # recurrent layers: a later prompt can come back to here
        logits = self.forward.lm_head(hidden[-1:])
        token = choose(logits, sampler)[0]
        return token.astype(mx.int32), hidden[-1], logits

    def _autoregressive_step(self, state: DecodeState) -> tuple[DecodeState, Step]:
        """Plain decoding with the same forward: one target pass, one token, one sync.

        Pipelined as mlx-lm's loop is: the next token's forward is built from the pending
        token while it is still on the device, and handed to MLX (``async_eval``) before the
        pending token is read, so the device never waits for Python between steps. Each
        emitted token is in the cache (its K/V written, committed) when the step returns, but
        for the last one a full context has no room for.
        """
        cache, token = state.cache, state.pending
        emitted = {"logprobs": state.pending_logprobs}
        if not self.has_room(cache, 1):
            if token is None:  # the context's last token was emitted by the previous step
                self.check_room(cache, 1)  # raises ContextFull
            value = token.item()  # the context's last token: no K/V needed
            last = Step([value], **emitted, top_logprobs=TopLogprobs.read(state.pending_top))
            return replace(state, pending=None, steps=state.steps + 1), last
        choice, _, logits = self._next_token(cache, token, state.decoding.sampler)  # its K/V
        rows, top = emitted_logprobs(state.decoding, logits, choice)
        mx.async_eval(choice, *_present(rows, *(top or ())))
        value = token.item()  # host read: this token (the next one is computing)
        cache.commit([value])
        step = Step([value], **emitted, top_logprobs=TopLogprobs.read(state.pending_top))
        new = replace(
            state, pending=choice, steps=state.steps + 1, pending_logprobs=rows, pending_top=top
        )
        return new, step

    def _speculative_step(self, state: DecodeState) -> tuple[DecodeState, Step]:
        """pack -> verify -> accept -> compact -> draft from ``state``'s pending token, its
        drafted beams and, with an index, its lookup beams; then the step's one host read."""
        cache, timer, decoding = state.cache, state.timer, state.decoding
        timer.start()
        beams, tree, size = self._pack(state)
        hidden, logits, result = self._verify(state, beams, tree)
        # the log-probs along the accepted beam: row i is what its i-th emitted token came from
        path_logprobs, top = emitted_logprobs(
            decoding,
            logits[result.path],
            _path_tokens(beams, result) if decoding.any_logprobs else None,
        )
        if not tree.paths_in_place:
            cache.compact(result.path)
        cache.keep(result.last_node)  # recurrent layers: the accepted node's state
        timer.mark("compact", *cache.state())
        drafted, draft_syncs = self._draft(decoding, hidden[result.last_node], result.next_token)
        chosen = mx.stack([result.best, result.num_accepted, result.next_token])
        keep = _present(path_logprobs, *(top or ()))
        read, next_logprobs = self._read(decoding, chosen, drafted, keep)
        timer.mark("draft")
        best, num_accepted, next_token = (int(x) for x in read[:3])
        root_and_accepted = beams[best, : num_accepted + 1].tolist()
        cache.commit(root_and_accepted)
        if state.index is not None:
            state.index.extend(root_and_accepted)
        step = Step(
            root_and_accepted[1:] + [next_token],
            tree_size=size,
            syncs=1 + draft_syncs,
            accepted_from=accepted_source(beams, len(state.beams), best, num_accepted),
            logprobs=None if path_logprobs is None else path_logprobs[: num_accepted + 1],
            top_logprobs=TopLogprobs.read(top, num_accepted + 1),
        )
        new = replace(
            state,
            pending=next_token,
            beams=self._beams(decoding, read[3:]),
            logprobs=next_logprobs,
            steps=state.steps + 1,
        )
        return new, step

    def _pack(self, state: DecodeState) -> tuple[np.ndarray, Tree, int]:
        """The step's beams ``(W + k, L)`` (cut short near the context's end), their packed,
        pruned and padded tree, and its size before padding."""
        cache, shape = state.cache, state.decoding.shape
        beams, logprobs = self._with_lookup(state)
        self.check_room(cache, 1)  # the root's position
        room = None if self.max_context is None else self.max_context - cache.offset
        if room is not None and room < beams.shape[1]:  # near the context's end: shorter
            beams = beams[:, :room]  # beams, so the answer stops where the autoregressive one does
            logprobs = None if logprobs is None else logprobs[:, : room - 1]
        tree = pack_beams(beams)
        if logprobs is not None:
            tree = prune(tree, logprobs, shape.min_prob, self.plan.tree_sizes)
        size = tree.size
        return beams, pad_tree(tree, verified_size(size, self.plan.tree_sizes)), size

    def _verify(self, state: DecodeState, beams: np.ndarray, tree: Tree):
        """One target forward over ``tree`` (K/V into the cache's scratch) and the acceptance
        of ``beams``, lazily -> ``(hidden (T, H), logits (T, V), Acceptance)``."""
        cache, timer = state.cache, state.timer
        mask = tree_mask(tree, cache.offset)
        positions = mx.array(cache.offset + tree.depths)
        timer.mark("pack", mask)
        cache.reserve(max(tree.size, beams.shape[1]))  # compaction writes L slots
        # shortened beams make sizes warm_up did not compile: run those few eagerly
        compiled = tree.size in self._verified_sizes(state.decoding)
        hidden = self.forward(
            mx.array(tree.tokens), positions, mask, cache, compiled=compiled, tree=tree
        )
        logits = self.forward.lm_head(hidden)
        timer.mark("verify", logits)
        pruned = tree.unpack < 0  # never accepted: a token id no choice can equal
        result = accept(
            mx.array(np.where(pruned, -1, beams)),
            mx.array(np.maximum(tree.unpack, 0)),
            logits,
            state.decoding.sampler,
        )
        timer.mark("accept", result.num_accepted, result.next_token)
        return hidden, logits, result

    # -- drafting and the host read

    def _draft(self, decoding: Decoding, context: mx.array, token: mx.array):
        """The drafter's beams ``(W, L)`` (and log-probs) of the decoding's shape from the
        hidden state ``context (H,)`` and the pending ``token ()``, lazily, and the host reads
        the search made; ``(None, None), 0`` without a drafter."""
        if not decoding.mode.drafted:
            return (None, None), 0
        beams, logprobs, syncs = self.drafter.search(
            context, token, **self._search_options(decoding.shape)
        )
        return (beams, logprobs), syncs

    def _search_options(self, shape: BeamShape) -> dict:
        """The drafter's options for ``shape``. Without the plan's early stop a floored search
        drafts every depth (no host read per depth); the step prunes the tree by the same
        floor after its one read, so the verified tree is the same."""
        options = shape.search_options()
        if not self.plan.draft_early_stop:
            options["min_prob"] = 0.0
        return options

    def _first_draft(self, decoding: Decoding, context: mx.array, pending: mx.array, keep=()):
        """Draft from the prompt's (or any) state: one host read (``keep``'s arrays evaluated
        with it) -> ``(read, beams, logprobs)``, where ``read[0]`` is ``pending``."""
        drafted, _ = self._draft(decoding, context, pending)
        read, logprobs = self._read(decoding, pending[None], drafted, keep)
        return read, self._beams(decoding, read[1:]), logprobs

    def _beams(self, decoding: Decoding, values: np.ndarray) -> np.ndarray:
        """The drafted beams ``(W, L)`` of a read (``(0, L)`` without a drafter)."""
        return values.reshape(-1, decoding.shape.length)

    def _read(self, decoding: Decoding, values: mx.array, drafted: tuple, keep=()):
        """The step's one host read: ``values`` then the drafted beams flattened (int), plus
        the drafted tokens' log-probs when the tree is pruned by them (None otherwise);
        ``keep``'s arrays are evaluated with it and stay on the device."""
        beams, logprobs = drafted
        ints = values.astype(mx.int32)
        if beams is not None:
            ints = mx.concatenate([ints, beams.reshape(-1)])
        if beams is None or not decoding.shape.min_prob:
            return _host_read(ints, keep=keep), None
        return _host_read(ints, logprobs, keep=keep)

    def _with_lookup(self, state: DecodeState):
        """The drafted beams ``(W, L)`` followed by the lookup beams of the pending token
        ``(k, L)`` (their tokens score log-prob 0: a floor never prunes them); the root alone
        ``(1, 1)`` when there is no beam at all."""
        shape, pending = state.decoding.shape, state.pending
        beams, logprobs = state.beams, state.logprobs
        if beams is None:
            beams = np.zeros((0, shape.length), np.int32)
        if state.index is not None:
            found = state.index.propose(pending, shape.lookup, shape.length)
            beams = np.concatenate([beams, found])
            if logprobs is not None:
                logprobs = np.concatenate([logprobs, np.zeros((len(found), beams.shape[1] - 1))])
        if not len(beams):
            return np.full((1, 1), pending, np.int32), logprobs
        return beams, logprobs

    # -- warm-up

    def warm_up(self, decoding: Decoding) -> None:
        """Trace (and build the kernels of) everything a step of ``decoding`` runs: a prompt
        forward, the verify forward at each compiled size of :func:`verified_sizes`, the
        sampler at every size a step can sample (the prompt's one row included), the beam
        search to its full depth.

        Call it when the shape or sampler is chosen, not mid-answer: a new size met in an answer
        would stop it to compile, and on the CPU backend MLX runs g++ meanwhile, which swallows
        Ctrl-C. Costs one small forward per compiled size (each is traced once per verifier).
        Draws from MLX's random stream: re-seed after it where answers must be reproducible.
        """
        self.check(decoding)
        speculative = decoding.mode.speculative
        sizes = self._verified_sizes(decoding) if speculative else frozenset([1])
        cache = self.new_cache()
        hidden = self.forward(
            mx.zeros((2,), mx.int32), mx.arange(2), llm.CAUSAL, cache, compiled=False
        )
        logits = self.forward.lm_head(hidden)
        mx.eval(logits)
        for size in sorted({1, *sizes}):
            if size <= self.plan.compiled_max_rows:  # bigger trees run eagerly: nothing to trace
                mask = llm.chain_mask(0, size) if size > 1 else None
                tokens = mx.zeros((size,), mx.int32)
                hidden = self.forward(tokens, mx.arange(size), mask, cache)
            rows = mx.zeros((size, logits.shape[-1]), logits.dtype)
            mx.eval(hidden, choose(rows, decoding.sampler))
        if decoding.mode.drafted:
            pending = mx.array(0, mx.int32)
            self.drafter.warm_up(hidden[-1], pending, **self._search_options(decoding.shape))

    def _verified_sizes(self, decoding: Decoding) -> frozenset[int]:
        return _verified_sizes(decoding.shape, self.plan.tree_sizes, decoding.mode.drafted)


@functools.lru_cache(maxsize=64)
def _verified_sizes(shape: BeamShape, tree_sizes: tuple[int, ...], drafted: bool) -> frozenset:
    return frozenset(verified_sizes(shape, tree_sizes, drafted=drafted))


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


def _present(*arrays: mx.array | None) -> tuple[mx.array, ...]:
    """The arrays that are there (optional outputs, such as log-probs, to evaluate too)."""
    return tuple(a for a in arrays if a is not None)


def emitted_logprobs(decoding: Decoding, logits: mx.array, tokens: mx.array | None):
    """What ``decoding`` asks for of the tokens ``tokens (n,)`` chosen from ``logits (n, V)``,
    lazily: ``(log-probs (n, V) or None, top_logprobs' arrays or None)``."""
    if not decoding.any_logprobs:
        return None, None
    rows = log_softmax(logits)
    top = (
        None if decoding.top_logprobs is None else top_logprobs(rows, tokens, decoding.top_logprobs)
    )
    return (rows if decoding.logprobs else None), top


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


def _path_tokens(beams: np.ndarray, result) -> mx.array:
    """The tokens a step emits along the accepted beam, on the device, ``(L,)``: the beam's
    accepted drafts, then the target's own next token at ``num_accepted`` (rows past it are
    dropped after the read)."""
    beam = mx.array(beams)[result.best].astype(mx.int32)
    after = mx.concatenate([beam[1:], result.next_token.reshape(1).astype(mx.int32)])
    at_next = mx.arange(after.shape[0]) == result.num_accepted
    return mx.where(at_next, result.next_token.astype(mx.int32), after)


def log_softmax(logits: mx.array) -> mx.array:
    """Logits ``(..., V)`` -> log-probs ``(..., V)`` (what mlx-lm's responses carry)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _host_read(*values: mx.array, keep=()) -> np.ndarray | tuple[np.ndarray, ...]:
    """The one place a decode step reads device values back to the host (one evaluation, of
    ``keep``'s arrays too, which stay on the device)."""
    mx.eval(*values, *keep)
    arrays = tuple(np.array(v) for v in values)
    return arrays[0] if len(arrays) == 1 else arrays
