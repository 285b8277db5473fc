"""Self-distillation data: the target's own greedy answers, with the hidden states behind them.

Legend: B prompts in a batch, S padded prompt length, G generated tokens (``max_new``), N tokens
of one sequence, H hidden size.

At decode time the drafter reads the target's hidden state along the target's *own* greedy path.
Teacher forcing over human-written answers (``extract.teacher_force``) shows it other text;
here the target answers the training prompts itself, one left-padded batch at a time, and every
hidden state it computes on the way is kept, so one pass yields the same per-token record as
teacher forcing (token, hidden, the target's next token, assistant mask) at a batched decoder's
speed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList

from redrafter_mlx.core.decode import llm
from redrafter_mlx.training.taps import features as tap_arrays
from redrafter_mlx.training.taps import tapped

SYNC_EVERY = 8  # decode steps between host checks for "every row has ended"


def greedy_batch(
    model, prompts: list[list[int]], max_new: int, eos: set[int], layers: tuple[int, ...] = ()
) -> list[dict[str, np.ndarray]]:
    """Greedy-decode ``prompts`` together -> one record per prompt.

    Record: ``tokens (N,)`` prompt + answer (through its end-of-turn token, or the first
    ``max_new - 1`` answer tokens), ``mask (N,)`` True on answer tokens, ``hidden (N, H)`` f16
    final-norm hidden states, ``argmax (N,)`` the target's next token at each answer position and
    at the last prompt position (other prompt positions hold the next prompt token: never trained
    on); with ``layers``, ``taps (N, n H)`` f16, those layers' features (``training/taps.py``).
    """
    with tapped(model, layers) as got:
        answers, hidden = _decode(model, prompts, max_new, eos)
    taps = np.array(tap_arrays(got, layers)) if layers else [None] * len(prompts)
    pads = [max(map(len, prompts)) - len(p) for p in prompts]
    return [
        _record(p, pad, a, h, eos, t)
        for p, pad, a, h, t in zip(prompts, pads, answers, hidden, taps, strict=True)
    ]


def _decode(model, prompts: list[list[int]], max_new: int, eos: set[int]):
    """``greedy_batch``'s decoding -> answers ``(B, T)`` and hidden states ``(B, S + T - 1, H)``
    f16, as numpy arrays."""
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    x = mx.array([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)])  # (B, S)
    cache = batch_cache(model, pads)
    inner = llm.inner_model(model)
    prefill = inner(x, cache=cache)  # (B, S, H)
    nxt = mx.argmax(llm.lm_head(model, prefill[:, -1:]), axis=-1)  # (B, 1)
    hiddens, tokens = [prefill.astype(mx.float16)], [nxt]
    ended = np.zeros(len(prompts), bool)
    for step in range(1, max_new):
        hidden = inner(nxt, cache=cache)  # (B, 1, H)
        nxt = mx.argmax(llm.lm_head(model, hidden), axis=-1)
        hiddens.append(hidden.astype(mx.float16))
        tokens.append(nxt)
        mx.async_eval(nxt, hiddens[-1])
        if step % SYNC_EVERY == 0:
            recent = np.array(mx.concatenate(tokens[-SYNC_EVERY:], axis=1))
            ended |= np.isin(recent, list(eos)).any(axis=1)
            if ended.all():
                break
    answers = np.array(mx.concatenate(tokens, axis=1))  # (B, T)
    return answers, np.array(mx.concatenate(hiddens, axis=1))  # (B, S + T - 1, H)


def batch_cache(model, pads: list[int]) -> list:
    """mlx-lm's per-layer caches for a left-padded batch: ``BatchKVCache`` for attention,
    ``ArraysCache`` with the padding (masked out of the recurrence) for recurrent layers."""

    def batched(cache):
        if isinstance(cache, CacheList):
            return CacheList(*(batched(c) for c in cache.caches))
        if isinstance(cache, ArraysCache):
            return ArraysCache(len(cache.cache), left_padding=pads)
        return BatchKVCache(pads)

    if not hasattr(model, "make_cache"):
        return [BatchKVCache(pads) for _ in llm.inner_model(model).layers]
    return [batched(c) for c in model.make_cache()]


def _record(prompt, pad: int, answer: np.ndarray, hidden: np.ndarray, eos: set[int], taps=None):
    """One row of ``greedy_batch``: cut the answer after its first end token. The last generated
    token has no hidden state (it was never fed back), so at most ``T - 1`` answer tokens stay."""
    ends = np.nonzero(np.isin(answer, list(eos)))[0]
    keep = min(int(ends[0]) + 1 if len(ends) else len(answer), len(answer) - 1)
    ids = np.concatenate([np.asarray(prompt, np.int32), answer[:keep].astype(np.int32)])
    n = len(prompt)
    record = {
        "tokens": ids,
        "mask": np.arange(len(ids)) >= n,
        "hidden": hidden[pad : pad + len(ids)],
        "argmax": np.concatenate([ids[1:n], answer[: keep + 1]]).astype(np.int32),
    }
    if taps is not None:
        record["taps"] = taps[pad : pad + len(ids)]
    return record
