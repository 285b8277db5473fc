"""RNN beam search with the drafter: ``(h, pending) -> beams (W, L)``.

Legend: W beam width, L beam length (column 0 is ``pending``), H hidden, K draft vocab.

The search runs ``L - 1`` drafter calls with all beams batched. The first expansion starts from a
single live beam (W copies would only give duplicates); each later one scores ``W x K``
extensions by cumulative log-prob, keeps the top W and re-gathers tokens and RNN states by
source beam. Beams come out best first. There are no host reads inside, so the whole search is
one lazy graph, compiled once per ``(W, L)``.
"""

from __future__ import annotations

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
    vocab = drafter.args.draft_vocab
    if width > vocab:
        raise ValueError(f"beam width {width} exceeds the draft vocabulary ({vocab})")
    beams = pending.reshape(1, 1).astype(mx.int32)
    token_logprobs = mx.zeros((1, 0))
    scores = mx.zeros((1,))
    state = mx.zeros((1, context.shape[-1]), context.dtype)
    for _ in range(length - 1):
        state = drafter.rnn_step(state, embed(beams[:, -1]))
        ctx = mx.broadcast_to(context, state.shape)
        logprobs = nn_log_softmax(drafter.logits(ctx, state).astype(mx.float32))
        flat = (scores[:, None] + logprobs).reshape(-1)  # (B * K,) cumulative scores
        top = mx.argpartition(-flat, kth=width - 1)[:width]
        top = top[mx.argsort(-flat[top])]  # best first
        source, index = top // vocab, top % vocab
        tokens = drafter.draft_ids(index).astype(mx.int32)
        beams = mx.concatenate([beams[source], tokens[:, None]], axis=1)
        token_logprobs = mx.concatenate(
            [token_logprobs[source], logprobs[source, index][:, None]], axis=1
        )
        scores, state = flat[top], state[source]
    return beams, token_logprobs


def nn_log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class BeamDrafter:
    """A drafter bound to its target's embedding, with beam search compiled per ``(W, L)``.

    Compiled functions capture the drafter's weights as constants: build a new ``BeamDrafter``
    after changing them.
    """

    def __init__(
        self, drafter: Drafter, embed: Callable[[mx.array], mx.array], compile: bool = True
    ):
        self.drafter = drafter
        self.embed = embed
        self.compile = compile
        self._compiled: dict[tuple[int, int], Callable] = {}

    def __call__(self, context: mx.array, pending: mx.array, *, width: int, length: int):
        """``context (H,)``, ``pending ()`` -> ``beams (W, L)``, ``token_logprobs (W, L - 1)``."""
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
