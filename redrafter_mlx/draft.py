"""RNN beam search with the drafter: ``(h, pending) -> beams (W, L)``.

Legend: W beam width, L beam length (column 0 is ``pending``), H hidden, K draft vocab.

The search runs ``L - 1`` drafter calls with all beams batched. The first expansion starts from a
single live beam (W copies would only give duplicates); each later one scores ``W x K``
extensions by cumulative log-prob, keeps the top W and re-gathers tokens and RNN states by
source beam. Beams come out best first. There are no host reads inside, so the whole search is
one lazy graph, compiled once per ``(W, L)``; the exception is a search with a path-probability
floor, which reads the best score after each depth and stops once it is below the floor.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx

from redrafter_mlx.drafter import Drafter


def beam_search(
    drafter: Drafter,
    embed: Callable[[mx.array], mx.array],
    context: mx.array,
    pending: mx.array,
    *,
    width: int,
    length: int,
) -> tuple[mx.array, mx.array]:
    """Draft ``width`` beams of ``length`` tokens from ``context (H,)`` and ``pending ()``.

    Returns ``beams (W, L)`` int32 (column 0 = pending) and the drafter's log-prob of each
    drafted token ``(W, L - 1)``.
    """
    search = start(drafter, context, pending, width)
    for _ in range(length - 1):
        search = expand(drafter, embed, context, *search, width=width)
    return search[0], search[2]


def check_width(drafter: Drafter, width: int) -> None:
    """ValueError when ``width`` beams cannot be drafted: more than the drafter's tokens."""
    vocab = drafter.args.draft_vocab
    if width > vocab:
        raise ValueError(f"beam width {width} exceeds the drafter's vocabulary ({vocab})")


def start(drafter: Drafter, context: mx.array, pending: mx.array, width: int) -> tuple:
    """The search before any expansion: one live beam ``[pending]`` with score 0."""
    check_width(drafter, width)
    beams = pending.reshape(1, 1).astype(mx.int32)
    state = mx.zeros((1, context.shape[-1]), context.dtype)
    return beams, mx.zeros((1,)), mx.zeros((1, 0)), state


def expand(
    drafter: Drafter,
    embed: Callable[[mx.array], mx.array],
    context: mx.array,
    beams: mx.array,
    scores: mx.array,
    token_logprobs: mx.array,
    state: mx.array,
    *,
    width: int,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """One depth: ``beams (B, d)``, cumulative ``scores (B,)``, ``token_logprobs (B, d - 1)``,
    RNN ``state (B, H)`` -> the same for the top ``width`` of the ``B x K`` extensions (best
    first), one token longer."""
    vocab = drafter.args.draft_vocab
    state = drafter.rnn_step(state, embed(beams[:, -1]))
    ctx = mx.broadcast_to(context, state.shape)
    logprobs = nn_log_softmax(drafter.logits(ctx, state).astype(mx.float32))
    flat = (scores[:, None] + logprobs).reshape(-1)  # (B * K,) cumulative scores
    if width == 1:
        top = mx.argmax(flat, keepdims=True)  # ~4x cheaper than partition + sort over K here
    else:
        top = mx.argpartition(-flat, kth=width - 1)[:width]
        top = top[mx.argsort(-flat[top])]  # best first
    source, index = top // vocab, top % vocab
    tokens = drafter.draft_ids(index).astype(mx.int32)
    beams = mx.concatenate([beams[source], tokens[:, None]], axis=1)
    token_logprobs = mx.concatenate(
        [token_logprobs[source], logprobs[source, index][:, None]], axis=1
    )
    return beams, flat[top], token_logprobs, state[source]


def nn_log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class BeamDrafter:
    """A drafter bound to its target's embedding, with beam search compiled per ``(W, L)``.

    Compiled functions capture the drafter's weights as constants: build a new ``BeamDrafter``
    after changing them. ``syncs`` is the number of host reads the last call made (0 unless
    it stopped early on ``min_prob``).
    """

    def __init__(
        self, drafter: Drafter, embed: Callable[[mx.array], mx.array], compile: bool = True
    ):
        self.drafter = drafter
        self.embed = embed
        self.compile = compile
        self._compiled: dict[tuple[int, int], Callable] = {}
        self._expanders: dict[int, Callable] = {}
        self.syncs = 0

    def __call__(
        self,
        context: mx.array,
        pending: mx.array,
        *,
        width: int,
        length: int,
        min_prob: float = 0.0,
    ):
        """``context (H,)``, ``pending ()`` -> ``beams (W, L)``, ``token_logprobs (W, L - 1)``.

        With ``min_prob`` > 0 the search stops at the first depth where no beam's path
        probability reaches it (a host read per depth): nothing deeper could reach it either,
        so those positions get token -1 and log-prob -inf instead of costing drafter passes.
        """
        self.syncs = 0
        if min_prob > 0:
            return self._search_until(context, pending, width, length, math.log(min_prob))
        if not self.compile:
            return beam_search(
                self.drafter, self.embed, context, pending, width=width, length=length
            )
        fn = self._compiled.get((width, length))
        if fn is None:

            def search(context, pending):
                return beam_search(
                    self.drafter, self.embed, context, pending, width=width, length=length
                )

            fn = self._compiled[(width, length)] = mx.compile(search)
        return fn(context, pending)

    def warm_up(
        self, context: mx.array, pending: mx.array, *, width: int, length: int, min_prob: float
    ) -> None:
        """Trace this shape's search to its full depth (a floored search may stop early)."""
        if min_prob > 0:
            mx.eval(*self._search_until(context, pending, width, length, -math.inf))
        else:
            mx.eval(*self(context, pending, width=width, length=length))

    def _search_until(self, context, pending, width: int, length: int, floor: float):
        step = self._expander(width)
        search = start(self.drafter, context, pending, width)
        for depth in range(1, length):
            search = step(context, *search)
            if depth < length - 1:
                self.syncs += 1
                if search[1][0].item() < floor:  # host read: the best path's log-prob
                    break
        beams, _, token_logprobs, _ = search
        missing = length - beams.shape[1]
        if missing:
            rows = beams.shape[0]
            beams = mx.concatenate([beams, mx.full((rows, missing), -1, mx.int32)], axis=1)
            token_logprobs = mx.concatenate(
                [token_logprobs, mx.full((rows, missing), -mx.inf, token_logprobs.dtype)], axis=1
            )
        return beams, token_logprobs

    def _expander(self, width: int) -> Callable:
        """One search depth (:func:`expand`), compiled per width (traced per input shape)."""
        fn = self._expanders.get(width)
        if fn is None:

            def one(context, beams, scores, token_logprobs, state):
                return expand(
                    self.drafter,
                    self.embed,
                    context,
                    beams,
                    scores,
                    token_logprobs,
                    state,
                    width=width,
                )

            fn = self._expanders[width] = mx.compile(one) if self.compile else one
        return fn
