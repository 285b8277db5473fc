"""Acceptance: the longest beam prefix the target agrees with, plus the target's next token.

Legend: W beam width, L beam length, T tree nodes, V vocab.

One rule covers greedy and sampling. At every tree node the target's *choice* is drawn once from
its own distribution (argmax at temperature 0; temperature / top-p / top-k applied by the same
mlx-lm sampler the autoregressive path uses). Walking from the root, a child is accepted iff its
token equals its parent's choice; the first node whose choice matches no child emits that choice.

Why this is exact: at each node on the walk the emitted token is the node's choice, a fresh draw
from the target's conditional given the accepted prefix; the drafts only decide how far one
verify pass reaches. This equals REDRAFTER.md section 4's rule (try children in order, accept
child x with p(x), renormalise on rejection, sample the residual on total rejection): both emit
x with probability p(x) at every node. Greedy is the temperature -> 0 case of the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler

Sampler = Callable[[mx.array], mx.array]

# mlx-lm's sampler scales logits by 1 / temp in the logits' dtype: below this, logits of
# magnitude ~65 overflow float16's range (65504) to inf and the draw is garbage (1e-40 does
# it in float32 too). And the draw is already the argmax unless two logits lie within ~0.01.
GREEDY_BELOW = 1e-3


def greedy(scores: mx.array) -> mx.array:
    """The temperature-0 sampler: argmax of the last axis of logits or log-probs (the same)."""
    return mx.argmax(scores, axis=-1)


def is_greedy(temp: float) -> bool:
    """Whether ``temp`` decodes greedily: 0, or too small to scale logits by (the one rule the
    commands and the server share)."""
    return temp < GREEDY_BELOW


def temperature(sampler: Sampler | None) -> float:
    """The temperature ``sampler`` draws at: 0 for greedy (or None), its own for one of
    :func:`make_sampler`'s, 1 for any other sampler (it samples)."""
    if sampler is None or sampler is greedy:
        return 0.0
    return getattr(sampler, "settings", {}).get("temp", 1.0)


def make_sampler(temp: float = 0.0, top_p: float = 0.0, top_k: int = 0) -> Sampler:
    """mlx-lm's sampler for these settings; a greedy temperature (:func:`is_greedy`) gives
    :func:`greedy` (mlx-lm's is the same argmax), which :func:`choose` recognises. Without
    top-p the sampler is marked ``reads_logits``: temperature and top-k only scale and rank
    their input, and a categorical draw (argmax of scaled scores + Gumbel noise) is the same for
    logits and log-probs, which differ by a constant per row."""
    if is_greedy(temp):
        return greedy
    sampler = mlx_lm_sampler(temp, top_p=top_p, top_k=top_k)
    sampler.reads_logits = not 0 < top_p < 1  # top-p sums probabilities: needs log-probs
    sampler.settings = {"temp": temp, "top_p": top_p, "top_k": top_k}  # to make it again
    return sampler


def choose(logits: mx.array, sampler: Sampler) -> mx.array:
    """The sampler's pick per row of ``logits (..., V)``. Samplers take log-probs; greedy and
    the ``reads_logits`` ones get raw logits (the same pick) and skip the log-softmax over each
    row, which costs about as much as the draw over a large vocabulary."""
    if sampler is greedy or getattr(sampler, "reads_logits", False):
        return sampler(logits)
    return sampler(log_softmax(logits))


def log_softmax(logits: mx.array) -> mx.array:
    """Logits ``(..., V)`` -> log-probs ``(..., V)``: the one log-softmax of the package."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def accepted_lengths(drafted: mx.array, targets: mx.array) -> mx.array:
    """Drafted tokens accepted per beam: the length of the prefix of ``drafted (..., W, n)``
    that agrees with the target's choices ``targets (..., W, n)`` (broadcast) -> ``(..., W)``
    int32. The one greedy acceptance rule: the decode loop's and the replay simulator's."""
    agree = drafted == targets
    return mx.cumprod(agree.astype(mx.int32), axis=-1).sum(axis=-1)


@dataclass
class Acceptance:
    best: mx.array  # () index of the accepted beam
    num_accepted: mx.array  # () drafted tokens accepted (0 .. L-1)
    path: mx.array  # (L,) nodes of the accepted beam (root first)
    next_token: mx.array  # () the target's choice after the last accepted node
    last_node: mx.array  # () the node whose hidden state predicted next_token


def accept(beams: mx.array, unpack: mx.array, logits: mx.array, sampler: Sampler) -> Acceptance:
    """``beams (W, L)``, ``unpack (W, L)`` node per beam position, target ``logits (T, V)``."""
    choices = choose(logits, sampler).astype(mx.int32)[unpack]  # (W, L) pick after each position
    accepted = accepted_lengths(beams[:, 1:], choices[:, :-1])  # (W,)
    best = mx.argmax(accepted)
    num_accepted = accepted[best]
    path = unpack[best]
    return Acceptance(best, num_accepted, path, choices[best, num_accepted], path[num_accepted])
