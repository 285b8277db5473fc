"""Tree packing: the worked example, and brute-force checks on random beams."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from redrafter_mlx.tree import pack_beams, pad_tree, tree_mask, verified_size


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
