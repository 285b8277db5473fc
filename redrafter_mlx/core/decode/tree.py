"""Dynamic tree attention: pack beams that share prefixes into one tree of unique nodes.

Legend: W beam width, L beam length, T packed tree nodes, S cached tokens.

All beams have the same length, so dedup is tensor work (REDRAFTER.md section 3):
``same_prefix[i, j, k]`` says beams i and j agree on tokens ``0..k``; ``first[i, k]`` is the
smallest such j. Token ``(i, k)`` is a node iff ``first[i, k] == i``. Nodes are numbered in
row-major order of the kept ``(i, k)``; ``unpack (W, L)`` maps every beam position to its node.

Packing runs on the host in numpy: the beams are already there after the step's single sync,
and the number of nodes T must be known on the host to shape the verify forward anyway.

Example: beams ``[[91,92,93,95],[91,92,94,96],[91,92,93,97]]`` pack to nodes
``[91,92,93,95,94,96,97]`` with unpack ``[[0,1,2,3],[0,1,4,5],[0,1,2,6]]``.

:func:`prune` then drops the nodes the drafter itself gives little chance (path probability below
a floor), so a step verifies a long beam only when the drafter is confident in it; dropped beam
positions have ``unpack == -1`` and can never be accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Tree:
    tokens: np.ndarray  # (T,) token ids of the nodes
    depths: np.ndarray  # (T,) 0 for the root; a node's position is cache length + depth
    parents: np.ndarray  # (T,) parent node, -1 for the root
    unpack: np.ndarray  # (W, L) node of each beam position (-1: pruned, never accepted)
    ancestors: np.ndarray  # (T, T) bool, [t, a]: a is t or an ancestor of t

    @property
    def size(self) -> int:
        return len(self.tokens)

    def select(self, keep: np.ndarray) -> Tree:
        """The sub-tree of nodes ``keep (T,)`` bool (closed under parents), renumbered in order;
        beam positions of dropped nodes get ``unpack == -1``."""
        new = np.where(keep, np.cumsum(keep) - 1, -1)
        parents = self.parents[keep]
        return Tree(
            self.tokens[keep],
            self.depths[keep],
            np.where(parents >= 0, new[np.maximum(parents, 0)], -1),
            np.where(self.unpack >= 0, new[self.unpack], -1),
            self.ancestors[np.ix_(keep, keep)],
        )


def pack_beams(beams: np.ndarray) -> Tree:
    """Deduplicate shared beam prefixes. ``beams (W, L)`` -> ``Tree`` with T nodes."""
    width, length = beams.shape
    eq = beams[:, None, :] == beams[None, :, :]  # (W, W, L)
    same_prefix = np.cumsum(eq, axis=2) == np.arange(1, length + 1)
    first = np.argmax(same_prefix, axis=1)  # (W, L) smallest beam sharing the prefix
    keep = first == np.arange(width)[:, None]
    node_of = np.cumsum(keep.reshape(-1)).reshape(width, length) - 1  # valid where keep
    unpack = node_of[first, np.arange(length)[None, :]]
    rows, cols = np.nonzero(keep)  # row-major, so in node order
    parents = np.where(cols > 0, unpack[rows, np.maximum(cols - 1, 0)], -1)
    ancestors = np.zeros((len(rows), len(rows)), dtype=bool)
    for k in range(length):
        ancestors[unpack[:, k, None], unpack[:, : k + 1]] = True
    return Tree(beams[rows, cols], cols, parents, unpack, ancestors)


def prune(
    tree: Tree, token_logprobs: np.ndarray, min_prob: float, buckets: tuple[int, ...] = ()
) -> Tree:
    """Keep the root and every node whose drafter path probability is at least ``min_prob``;
    when those pad up to a bigger verified size anyway, fill it with the next most probable.

    ``token_logprobs (W, L - 1)`` are the drafter's log-probs of each beam's drafted tokens. A
    node's path probability is the product along its beam prefix, so it never exceeds its
    parent's: taking nodes in descending probability (parents first on ties) keeps the set closed
    under parents, and each kept beam position's prefix is kept too.
    """
    path_logprobs = np.concatenate(
        [np.zeros((len(token_logprobs), 1)), np.cumsum(token_logprobs, axis=1)], axis=1
    )
    node_logprobs = np.empty(tree.size)
    node_logprobs[tree.unpack] = path_logprobs  # shared prefixes share their score
    wanted = int((node_logprobs >= np.log(min_prob)).sum()) if min_prob > 0 else tree.size
    drafted = int(np.isfinite(node_logprobs).sum())  # a search stopped early left -inf slots
    size = min(verified_size(max(wanted, 1), buckets), drafted)
    order = np.lexsort((tree.depths, -node_logprobs))
    keep = np.zeros(tree.size, dtype=bool)
    keep[order[:size]] = True
    return tree if keep.all() else tree.select(keep)


def verified_size(size: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds ``size`` nodes (``size`` itself when none does)."""
    return min((b for b in buckets if b >= size), default=size)


def pad_tree(tree: Tree, size: int) -> Tree:
    """Append ``size - T`` inert nodes: token 0 at depth 0, attending only to the cache and
    themselves, never an ancestor of a real node and never in ``unpack`` (so never accepted).

    Some BLAS kernels are much slower for some row counts than for a few more
    (benchmarks/HISTORY.md, "tree padding"); padding picks the cheaper shape.
    """
    extra = size - tree.size
    if extra <= 0:
        return tree
    t = tree.size
    ancestors = np.zeros((size, size), dtype=bool)
    ancestors[:t, :t] = tree.ancestors
    ancestors[np.arange(t, size), np.arange(t, size)] = True
    return Tree(
        np.concatenate([tree.tokens, np.zeros(extra, tree.tokens.dtype)]),
        np.concatenate([tree.depths, np.zeros(extra, tree.depths.dtype)]),
        np.concatenate([tree.parents, np.full(extra, -1, tree.parents.dtype)]),
        tree.unpack,
        ancestors,
    )


def tree_mask(tree: Tree, cached: int) -> mx.array:
    """Boolean attention mask (T, S + T): the whole cache plus each node's own ancestors. Only
    the (T, T) ancestor block goes from the host to the device; the cache's part is made
    there."""
    prefix = mx.ones((tree.size, cached), dtype=mx.bool_)
    return mx.concatenate([prefix, mx.array(tree.ancestors)], axis=1)
