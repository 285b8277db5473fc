"""The autoregressive step: one target pass, one token, one host read, pipelined as mlx-lm's
loop is (the next token's forward is handed to the device before the pending token is read).

Legend: V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx

from redrafter_mlx.core.sequence import Sequence
from redrafter_mlx.core.step import Decoding, Emitted, Step, emitted_logprobs


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


def first_state(sequence: Sequence, decoding: Decoding, token: mx.array, logits) -> ChainState:
    """The state after a prompt whose next token is ``token ()``, chosen from ``logits
    (1, V)``: its read waits for the first step, so the device starts at once."""
    emitted = emitted_logprobs(decoding, logits, token[None])
    mx.async_eval(token, *emitted.arrays())
    return ChainState(sequence, decoding, token[None], emitted, sequence.version)


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
    choice, _, logits = decoder.next_token(sequence, token, state.decoding.sampler)  # its K/V
    emitted = emitted_logprobs(state.decoding, logits, choice)
    mx.async_eval(choice, *emitted.arrays())
    value = token.item()  # host read: this token (the next one is computing)
    return chained(state, choice, emitted, value)


def chained(state: ChainState, choice: mx.array, emitted: Emitted, value: int):
    """After the read of ``state``'s pending token ``value`` (its K/V written): commit it ->
    the state whose pending token is ``choice (1,)`` (log-probs ``emitted``) and the step that
    emitted ``value``."""
    sequence = state.sequence
    sequence.commit([value])
    new = ChainState(sequence, state.decoding, choice, emitted, sequence.version, state.steps + 1)
    return new, state.emitted.read([value])
