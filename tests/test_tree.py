"""Tree packing: the worked example, and brute-force checks on random beams."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from redrafter_mlx.core.decode.tree import pack_beams, pad_tree, prune, tree_mask, verified_size


def test_worked_example():
    beams = np.array([[91, 92, 93, 95], [91, 92, 94, 96], [91, 92, 93, 97]])
    tree = pack_beams(beams)
    assert tree.tokens.tolist() == [91, 92, 93, 95, 94, 96, 97]
    assert tree.unpack.tolist() == [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 2, 6]]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 1, 4, 2]
    assert tree.depths.tolist() == [0, 1, 2, 3, 2, 3, 3]


beam_arrays = st.integers(1, 16).flatmap(
    lambda w: st.integers(2, 6).flatmap(
        lambda length: arrays(np.int64, (w, length), elements=st.integers(0, 3))
    )
)


@settings(max_examples=200, deadline=None)
@given(beam_arrays)
def test_pack_matches_brute_force(beams):
    beams[:, 0] = beams[0, 0]  # every beam starts at the same pending token
    tree = pack_beams(beams)
    width, length = beams.shape
    # unpack reproduces the beams
    assert (tree.tokens[tree.unpack] == beams).all()
    # one node per distinct prefix
    prefixes = {tuple(beams[w, : k + 1]) for w in range(width) for k in range(length)}
    assert tree.size == len(prefixes)

    # node prefix: follow parents to the root
    def path(node):
        return path(tree.parents[node]) + [tree.tokens[node]] if node >= 0 else []

    node_prefix = [tuple(path(t)) for t in range(tree.size)]
    assert len(set(node_prefix)) == tree.size
    # ancestor mask: a is an ancestor-or-self of t iff a's prefix is a prefix of t's
    for t in range(tree.size):
        for a in range(tree.size):
            is_prefix = node_prefix[t][: len(node_prefix[a])] == node_prefix[a]
            assert tree.ancestors[t, a] == is_prefix
    mask = np.array(tree_mask(tree, cached=3))
    assert mask[:, :3].all() and (mask[:, 3:] == tree.ancestors).all()


def test_padding_adds_inert_nodes_only():
    tree = pack_beams(np.array([[91, 92, 93, 95], [91, 92, 94, 96], [91, 92, 93, 97]]))
    assert verified_size(tree.size, (1, 2, 4, 8, 16)) == 8 and verified_size(20, (8, 16)) == 20
    padded = pad_tree(tree, 8)
    mask = np.array(tree_mask(padded, 3))
    t = tree.size
    assert padded.size == 8 and (padded.unpack == tree.unpack).all()
    assert (mask[:t, : 3 + t] == np.array(tree_mask(tree, 3))).all()
    assert not mask[:t, 3 + t :].any()  # real nodes never see padding
    assert (mask[t:, :3]).all() and (mask[t:, 3 + t :] == np.eye(8 - t, dtype=bool)).all()
    assert not mask[t:, 3 : 3 + t].any()
    assert pad_tree(tree, t) is tree


def _beam_search_like(rng, width, length):
    """Beams sharing prefixes (as beam search makes them) and consistent per-token log-probs:
    equal prefixes carry equal log-probs, as they come from the same source beam."""
    beams = rng.integers(0, 3, (width, length))
    beams[:, 0] = 7
    logp_of = {}
    logprobs = np.zeros((width, length - 1))
    for w in range(width):
        for k in range(1, length):
            key = tuple(beams[w, : k + 1])
            logp_of.setdefault(key, float(np.log(rng.uniform(0.05, 1.0))))
            logprobs[w, k - 1] = logp_of[key]
    return beams, logprobs


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    width=st.integers(1, 5),
    length=st.integers(2, 6),
    min_prob=st.sampled_from([0.0, 0.05, 0.2, 0.5, 0.9]),
    buckets=st.sampled_from([(), (1, 2, 4, 8, 16)]),
)
def test_prune_keeps_probable_nodes_closed_under_parents(seed, width, length, min_prob, buckets):
    beams, logprobs = _beam_search_like(np.random.default_rng(seed), width, length)
    full = pack_beams(beams)
    tree = prune(full, logprobs, min_prob, buckets)
    path_prob = np.exp(np.concatenate([np.zeros((width, 1)), logprobs.cumsum(1)], axis=1))
    kept = tree.unpack >= 0
    # every position at or above the floor is kept; kept positions map to their own tokens
    assert kept[path_prob >= min_prob].all() and kept[:, 0].all()
    assert (tree.tokens[tree.unpack[kept]] == beams[kept]).all()
    # a beam is kept up to some depth and pruned after it (prefixes of kept nodes are kept)
    assert (np.diff(kept.astype(int), axis=1) <= 0).all()
    # the sub-tree's parents and ancestors are the full tree's, renumbered
    positions = list(zip(*np.nonzero(kept), strict=True))
    prefixes = {tuple(beams[w, : k + 1]) for w, k in positions}
    assert tree.size == len(np.unique(tree.unpack[kept])) == len(prefixes)
    for w, k in positions:
        if k:
            assert tree.parents[tree.unpack[w, k]] == tree.unpack[w, k - 1]
            assert tree.ancestors[tree.unpack[w, k], tree.unpack[w, : k + 1]].all()
    assert tree.ancestors.sum() == sum(tree.depths + 1)
    # it fills the verified size the kept nodes pad to anyway, never beyond the full tree
    assert tree.size == min(verified_size(tree.size, buckets), full.size)
    if min_prob == 0.0:
        assert tree is full


def test_prune_worked_example():
    beams = np.array([[91, 92, 93, 95], [91, 92, 94, 96], [91, 92, 93, 97]])
    logprobs = np.log([[0.9, 0.5, 0.5], [0.9, 0.4, 0.9], [0.9, 0.5, 0.1]])
    # path probs: 92: 0.9; 93: 0.45; 94: 0.36; 95: 0.225; 96: 0.324; 97: 0.045
    tree = prune(pack_beams(beams), logprobs, 0.3, ())
    assert tree.tokens.tolist() == [91, 92, 93, 94, 96]
    assert tree.unpack.tolist() == [[0, 1, 2, -1], [0, 1, 3, 4], [0, 1, 2, -1]]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 3]
    # a 5-node tree verified at 8 rows anyway: the two next most probable nodes fill it
    assert prune(pack_beams(beams), logprobs, 0.3, (1, 2, 8)).size == 7
    chain = prune(pack_beams(beams[:1]), logprobs[:1], 0.3, ())
    assert chain.unpack.tolist() == [[0, 1, 2, -1]]


def test_accepted_nodes_move_only_when_not_already_after_the_prefix():
    from redrafter_mlx.core.decode.speculative import accepted_nodes

    beams = np.array([[91, 92, 93, 95], [91, 92, 94, 96], [91, 92, 93, 97]])
    tree = pack_beams(beams)  # nodes [91, 92, 93, 95, 94, 96, 97]
    assert accepted_nodes(tree, 1, 3).tolist() == [0, 1, 4, 5]
    assert accepted_nodes(tree, 2, 3).tolist() == [0, 1, 2, 6]
    assert accepted_nodes(tree, 0, 3) is None  # beam 0's nodes are numbered first
    assert accepted_nodes(tree, 2, 2) is None  # [0, 1, 2]: beam 0's prefix
    assert accepted_nodes(tree, 1, 0) is None  # the root alone
