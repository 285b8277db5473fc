"""RNN beam search with the drafter: ``(h, pending) -> beams (W, L)``.

Legend: W beam width, L beam length (column 0 is ``pending``), H hidden, K draft vocab.

The search runs ``L - 1`` drafter calls with all beams batched. The first expansion starts from a
single live beam (W copies would only give duplicates); each later one scores ``W x K``
extensions by cumulative log-prob, keeps the top W and re-gathers tokens and RNN states by
source beam. Beams come out best first. There are no host reads inside, so the whole search is
one lazy graph, compiled once per ``(W, L, S)``; the exception is a search with a path-probability
floor, which reads the best score after each depth and stops once it is below the floor.

A search width ``S > W`` keeps S beams while searching and returns the W of them chosen by
:func:`select_paths`: the drafter's expected accepted length of a tree is the sum of its nodes'
path probabilities, and the top W beams by score mostly share their first tokens, so they hedge
where acceptance is already unlikely (the last tokens) instead of where most drafts fail (the
first drafted token).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx

from redrafter_mlx.core.decode.accept import log_softmax
from redrafter_mlx.core.decode.source import Source
from redrafter_mlx.core.drafters.redrafter import Drafter, tap_features
from redrafter_mlx.core.errors import ConfigError


def beam_search(
    drafter: Drafter,
    embed: Callable[[mx.array], mx.array],
    context: mx.array,
    pending: mx.array,
    *,
    width: int,
    length: int,
    search_width: int = 0,
) -> tuple[mx.array, mx.array]:
    """Draft ``width`` beams of ``length`` tokens from ``context (H,)`` and ``pending ()``,
    searching with ``max(width, search_width)`` beams.

    Returns ``beams (W, L)`` int32 (column 0 = pending) and the drafter's log-prob of each
    drafted token ``(W, L - 1)``.
    """
    kept = max(width, search_width)
    search = start(drafter, context, pending, kept)
    for _ in range(length - 1):
        search = expand(drafter, embed, context, *search, width=kept)
    return narrow(search[0], search[2], width)


def narrow(beams: mx.array, token_logprobs: mx.array, width: int) -> tuple[mx.array, mx.array]:
    """``beams (..., S, L)`` of a search -> the ``width`` to verify: all of them when S <= W,
    else :func:`select_paths`."""
    if beams.shape[-2] <= width:
        return beams, token_logprobs
    return select_paths(beams, token_logprobs, width)


def select_paths(
    beams: mx.array, token_logprobs: mx.array, width: int
) -> tuple[mx.array, mx.array]:
    """The ``width`` of ``beams (..., S, L)`` whose merged tree has the most expected accepted
    tokens under the drafter: the sum over the tree's distinct nodes of their path probability
    (``exp`` of the summed log-probs ``token_logprobs (..., S, L - 1)`` down to the node).

    Greedy: each pick is the beam whose nodes not yet in the tree add the most probability (the
    first pick is the beam with the largest summed prefix probabilities). Lazy, no host read.
    Returns ``(beams (..., W, L), token_logprobs (..., W, L - 1))``, in pick order.
    """
    drafted = beams[..., 1:]  # column 0, the pending token, is shared by all
    equal = drafted[..., :, None, :] == drafted[..., None, :, :]  # (..., S, S, L - 1)
    shared = mx.cumprod(equal.astype(mx.float32), axis=-1)  # [i, j, d]: same nodes to depth d
    path_probs = mx.exp(mx.cumsum(token_logprobs.astype(mx.float32), axis=-1))  # (..., S, L - 1)
    covered = mx.zeros_like(path_probs)  # [j, d]: beam j's depth-d node is in the tree
    picks = []
    for _ in range(width):
        pick = mx.argmax((path_probs * (1.0 - covered)).sum(axis=-1), axis=-1)  # (...,)
        index = mx.broadcast_to(
            pick[..., None, None, None], (*shared.shape[:-3], 1, *shared.shape[-2:])
        )
        covered = mx.maximum(covered, mx.take_along_axis(shared, index, axis=-3)[..., 0, :, :])
        picks.append(pick)
    chosen = mx.stack(picks, axis=-1)[..., None]  # (..., W, 1)
    return (
        mx.take_along_axis(beams, chosen, axis=-2),
        mx.take_along_axis(token_logprobs, chosen, axis=-2),
    )


def check_width(drafter: Drafter, width: int) -> None:
    """ConfigError when ``width`` beams cannot be drafted: more than the drafter's tokens."""
    vocab = drafter.args.draft_vocab
    if width > vocab:
        raise ConfigError(f"{width} beams exceed the drafter's vocabulary ({vocab} tokens)")


def start(drafter: Drafter, context: mx.array, pending: mx.array, width: int) -> tuple:
    """The search before any expansion: one live beam ``[pending]`` with score 0.

    ``context (..., H)``, ``pending (...)`` -> ``beams (..., 1, 1)``, ``scores (..., 1)``,
    ``token_logprobs (..., 1, 0)``, ``state (..., 1, H)``; the optional leading axes ``...``
    batch independent searches (e.g. one from every position of a path).
    """
    check_width(drafter, width)
    batch = pending.shape
    beams = pending.reshape(*batch, 1, 1).astype(mx.int32)
    state = mx.zeros((*batch, 1, context.shape[-1]), context.dtype)
    return beams, mx.zeros((*batch, 1)), mx.zeros((*batch, 1, 0)), state


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
    """One depth: ``beams (..., B, d)``, cumulative ``scores (..., B)``, ``token_logprobs
    (..., B, d - 1)``, RNN ``state (..., B, H)`` of searches from ``context (..., H)`` -> the
    same for the top ``width`` of each search's ``B x K`` extensions (best first), one token
    longer. The drafter runs once on all ``... x B`` rows."""
    *batch, rows, hidden = state.shape
    vocab = drafter.args.draft_vocab
    state = drafter.rnn_step(state.reshape(-1, hidden), embed(beams[..., -1].reshape(-1)))
    ctx = mx.broadcast_to(context[..., None, :], (*batch, rows, hidden)).reshape(-1, hidden)
    logprobs = log_softmax(drafter.logits(ctx, state).astype(mx.float32))  # (... * B, K)
    logprobs = logprobs.reshape(*batch, rows * vocab)
    flat = (scores[..., None] + logprobs.reshape(*batch, rows, vocab)).reshape(logprobs.shape)
    top = best(flat, width)  # (..., W) into each search's B * K cumulative scores
    source, index = top // vocab, top % vocab
    tokens = drafter.draft_ids(index).astype(mx.int32)
    picked = mx.take_along_axis(logprobs, top, axis=-1)
    beams = mx.concatenate([by_source(beams, source), tokens[..., None]], axis=-1)
    token_logprobs = mx.concatenate([by_source(token_logprobs, source), picked[..., None]], axis=-1)
    state = by_source(state.reshape(*batch, rows, hidden), source)
    return beams, mx.take_along_axis(flat, top, axis=-1), token_logprobs, state


def best(scores: mx.array, width: int) -> mx.array:
    """Indices of the ``width`` largest of ``scores (..., N)``, best first -> ``(..., W)``."""
    if width == 1:  # argmax keeps the first of tied maxima, and costs less than a sort
        return mx.argmax(scores, axis=-1, keepdims=True)
    top = mx.argpartition(-scores, kth=width - 1, axis=-1)[..., :width]
    order = mx.argsort(-mx.take_along_axis(scores, top, axis=-1), axis=-1)
    return mx.take_along_axis(top, order, axis=-1)


def by_source(rows: mx.array, source: mx.array) -> mx.array:
    """``rows (..., B, n)`` gathered by ``source (..., W)`` beam indices -> ``(..., W, n)``."""
    return mx.take_along_axis(rows, source[..., None], axis=-2)


class BeamDrafter(Source):
    """A drafter bound to its target's embedding, with beam search compiled per ``(W, L, S)``.

    Compiled functions capture the drafter's weights as constants: build a new ``BeamDrafter``
    after changing them.
    """

    kind = "redrafter"
    batch_fits = True  # its search drafts any width and length up to the asked shape

    def __init__(self, drafter: Drafter, embed: Callable[[mx.array], mx.array]):
        self.drafter = drafter
        self.embed = embed
        self.taps = drafter.taps  # the target layers it reads (none: the final hidden only)
        self._compiled: dict[tuple[int, int, int], Callable] = {}
        self._expanders: dict[int, Callable] = {}

    # -- as the speculative step's source (``core/decode/source.py``)

    def check_shape(self, shape) -> None:
        """ConfigError (a ValueError) when the shape searches more beams than draft tokens."""
        check_width(self.drafter, shape.searched)

    def new_part(self) -> TapsPart | None:
        """Per sequence: the tapped features of its last committed token (layered drafters)."""
        return TapsPart(self) if self.taps else None

    def observe(self, sequence, taps: dict, rows: mx.array) -> None:
        """Stage the tapped features ``(n, n_taps H)`` of a forward's ``rows (n,)``."""
        if self.taps:
            self._part(sequence).staged = tap_features([taps[i][rows] for i in self.taps])

    def draft(self, sequence, reading, **options) -> tuple:
        """:meth:`search` from the reading's context: the final hidden state, fused with the
        tapped features of the same row for a layered drafter (the last accepted path row, or
        after a prompt the last committed token)."""
        context = reading.context
        if self.taps:
            part = self._part(sequence)
            if reading.path.shape[0]:
                features = part.staged[reading.count - 1]
            else:
                features = part.last
            if features is None:  # fed without taps (an autoregressive step): drafts are
                features = mx.zeros((len(self.taps) * context.shape[-1],))  # worse, not wrong
            context = self.drafter.fuse(context[None], features[None])[0]
        return self.search(context, reading.pending, **options)

    def _part(self, sequence) -> TapsPart:
        return sequence.part_of(self)

    def __call__(self, context: mx.array, pending: mx.array, **options):
        """:meth:`search`'s beams and log-probs (without its count of host reads)."""
        beams, token_logprobs, _ = self.search(context, pending, **options)
        return beams, token_logprobs

    def search(
        self,
        context: mx.array,
        pending: mx.array,
        *,
        width: int,
        length: int,
        min_prob: float = 0.0,
        search_width: int = 0,
    ) -> tuple[mx.array, mx.array, int]:
        """``context (H,)``, ``pending ()`` -> ``beams (W, L)``, ``token_logprobs (W, L - 1)``,
        searched with ``max(W, search_width)`` beams (:func:`beam_search`), and the number of
        host reads the search made (0 unless it stopped early on ``min_prob``).

        With ``min_prob`` > 0 the search stops at the first depth where no beam's path
        probability reaches it (a host read per depth): nothing deeper could reach it either,
        so those positions get token -1 and log-prob -inf instead of costing drafter passes.
        """
        kept = max(width, search_width)
        if min_prob > 0:
            return self._search_until(context, pending, width, kept, length, math.log(min_prob))

        def search(context, pending):
            return beam_search(
                self.drafter,
                self.embed,
                context,
                pending,
                width=width,
                length=length,
                search_width=kept,
            )

        fn = self._compiled.get((width, length, kept))
        if fn is None:
            fn = self._compiled[(width, length, kept)] = mx.compile(search)
        return (*fn(context, pending), 0)

    def warm_up(
        self,
        context: mx.array,
        pending: mx.array,
        *,
        width: int,
        length: int,
        min_prob: float,
        search_width: int = 0,
    ) -> None:
        """Trace this shape's search to its full depth (a floored search may stop early)."""
        kept = max(width, search_width)
        if min_prob > 0:
            mx.eval(*self._search_until(context, pending, width, kept, length, -math.inf)[:2])
        else:
            mx.eval(*self(context, pending, width=width, length=length, search_width=kept))

    def _search_until(self, context, pending, width: int, kept: int, length: int, floor: float):
        step = self._expander(kept)
        search = start(self.drafter, context, pending, kept)
        syncs = 0
        for depth in range(1, length):
            search = step(context, *search)
            if depth < length - 1:
                syncs += 1
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
        return (*narrow(beams, token_logprobs, width), syncs)

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

            fn = self._expanders[width] = mx.compile(one)
        return fn


class TapsPart:
    """A sequence's tapped features for a layered drafter (a ``core/decode/sequence.py: Part``):
    ``last`` ``(n_taps H,)`` of its last committed token, ``staged (n, n_taps H)`` of a forward's
    rows in the order they join (the next commit keeps its last committed row)."""

    def __init__(self, owner: BeamDrafter):
        self.owner = owner
        self.last: mx.array | None = None
        self.staged: mx.array | None = None

    def commit(self, ids: list[int]) -> None:
        n, staged = len(ids), self.staged
        if n:
            self.last = staged[n - 1] if staged is not None and staged.shape[0] >= n else None
        self.staged = None

    def rewind(self, length: int) -> None:
        del length  # the features of the token now last are gone: the next feed sets them
        self.last = self.staged = None

    def arrays(self) -> list[mx.array]:
        return [] if self.last is None else [self.last]
