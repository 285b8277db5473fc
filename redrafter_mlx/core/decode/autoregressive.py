"""The autoregressive step: one target pass, one token, one host read, pipelined as mlx-lm's
loop is (the next token's forward is handed to the device before the pending token is read).

Legend: V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx

from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.step import Decoding, Emitted, Step, emitted_logprobs


@dataclass(frozen=True)
class ChainState:
    """Between two autoregressive steps: ``pending (1,)`` the next token, still on the device
    (None once the context's last token was emitted), and ``emitted`` the log-probs it was
    chosen from; ``version`` the sequence's when this state was made."""

    sequence: Sequence
    decoding: Decoding
    pending: mx.array | None
    emitted: Emitted
    version: int
    steps: int = 0
    # the hidden state ``(H,)`` ``pending`` was chosen from, lazily (what a drafter drafts
    # from when the answer turns speculative: ``speculative.from_chain``); None in a batch
    context: mx.array | None = None


def first_state(
    sequence: Sequence, decoding: Decoding, token: mx.array, logits, context=None
) -> ChainState:
    """The state after a prompt whose next token is ``token ()``, chosen from ``logits
    (1, V)`` (``context (H,)``: the prompt's last hidden state): its read waits for the first
    step, so the device starts at once."""
    emitted = emitted_logprobs(decoding, logits, token[None])
    mx.async_eval(token, *emitted.arrays())
    return ChainState(sequence, decoding, token[None], emitted, sequence.version, context=context)


def from_tree(decoder, state, decoding: Decoding) -> ChainState:
    """A speculative ``state`` (a ``TreeState``: its pending token already emitted) turned
    plain: the pending token fed (its K/V written, committed) and the next one chosen by
    ``decoding``'s sampler, lazily, for the next step to emit. Needs room for two tokens."""
    sequence = state.sequence
    token = mx.array([state.pending], mx.int32)
    choice, hidden, logits = decoder.next_token(sequence, token, decoding.sampler)
    emitted = emitted_logprobs(decoding, logits, choice)
    mx.async_eval(choice, *emitted.arrays())
    sequence.commit([state.pending])
    return ChainState(
        sequence, decoding, choice, emitted, sequence.version, state.steps, hidden[-1]
    )


def chain_step(decoder, state: ChainState) -> tuple[ChainState, Step]:
    """Emit ``state``'s pending token and start the next one's forward.

    Each emitted token is in the sequence (its K/V written, committed) when the step returns,
    but for the last one a full context has no room for.
    """
    sequence, token = state.sequence, state.pending
    if not decoder.has_room(sequence, 1):
        if token is None:  # the context's last token was emitted by the previous step
            decoder.check_room(sequence, 1)  # raises ContextFull
        value = token.item()  # the context's last token: no K/V needed
        return replace(state, pending=None, steps=state.steps + 1), state.emitted.read([value])
    choice, hidden, logits = decoder.next_token(sequence, token, state.decoding.sampler)  # K/V
    emitted = emitted_logprobs(state.decoding, logits, choice)
    mx.async_eval(choice, *emitted.arrays())
    value = token.item()  # host read: this token (the next one is computing)
    return chained(state, choice, emitted, value, hidden[-1])


def chained(state: ChainState, choice: mx.array, emitted: Emitted, value: int, context=None):
    """After the read of ``state``'s pending token ``value`` (its K/V written): commit it ->
    the state whose pending token is ``choice (1,)`` (log-probs ``emitted``, chosen from the
    hidden state ``context (H,)``) and the step that emitted ``value``."""
    sequence = state.sequence
    sequence.commit([value])
    steps = state.steps + 1
    new = ChainState(sequence, state.decoding, choice, emitted, sequence.version, steps, context)
    return new, state.emitted.read([value])
