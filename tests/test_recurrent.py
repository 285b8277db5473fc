"""The recurrent state store: a chain's state staged then committed, a tree's accepted node's
state kept, snapshots as the only rewind points, bounded in number."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.core.decode.recurrent import Levels, StateStore


def states(value: float, rows: int = 1) -> list[mx.array]:
    return [mx.full((rows, 2), value), mx.full((rows, 3), -value)]


def test_staged_states_wait_for_the_commit():
    store = StateStore(2)
    store.stage(1, states(1.0))
    assert store.committed[1] is None
    store.commit()
    np.testing.assert_array_equal(store.committed[1][0], states(1.0)[0])
    assert store.committed[0] is None and store.staged == [None, None]


def test_keep_stages_the_accepted_nodes_row():
    """Node states are held in depth order; keep finds the node's row through ``node_rows``."""
    parents, depths = np.array([-1, 0, 0, 1]), np.array([0, 1, 1, 2])
    levels = Levels.of(parents, depths)
    store = StateStore(1)
    by_row = mx.arange(4, dtype=mx.float32)[:, None]  # row r holds the value r
    store.hold_nodes(0, [by_row], levels.node_rows)
    store.keep(mx.array(3))
    store.commit()
    row_of_node_3 = int(np.array(levels.node_rows)[3])
    assert float(store.committed[0][0][0, 0]) == row_of_node_3
    assert store.nodes == [None] and store.node_rows is None


def test_restore_goes_back_to_a_snapshot_and_forgets_later_ones():
    store = StateStore(1)
    store.stage(0, states(1.0))
    store.commit()
    store.snapshot(5)
    store.stage(0, states(2.0))
    store.commit()
    store.snapshot(9)
    store.restore(5)
    assert float(store.committed[0][0][0, 0]) == 1.0
    assert sorted(store.snapshots) == [0, 5]
    with pytest.raises(KeyError):
        store.restore(9)


def test_snapshots_are_bounded_and_the_empty_state_stays():
    store = StateStore(1, max_snapshots=2)
    for offset in (3, 6, 9):
        store.stage(0, states(float(offset)))
        store.commit()
        store.snapshot(offset)
    assert sorted(store.snapshots) == [0, 6, 9]
    store.restore(0)
    assert store.committed == [None]


def committed_at(store: StateStore, offset: int) -> None:
    store.stage(0, states(float(offset)))
    store.commit()
    store.checkpoint(offset)


def test_checkpoints_spread_over_an_answer_and_go_at_the_next_snapshot():
    """After a prompt's snapshot each commit may be kept, at most ``max_checkpoints`` spread
    evenly (the stride doubles): an answer's follow-up resumes near where it changed."""
    store = StateStore(1, max_checkpoints=4)
    committed_at(store, 10)
    store.snapshot(10)
    for offset in range(11, 22):  # eleven one-token steps of an answer
        committed_at(store, offset)
    assert sorted(store.checkpoints) == [11, 14, 18]  # strides of 4 tokens, each one's first
    assert store.kept == [0, 10, 11, 14, 18]
    store.restore(14)
    assert float(store.committed[0][0][0, 0]) == 14.0
    assert store.kept == [0, 10, 11, 14]
    committed_at(store, 30)  # the next prompt, fed from there
    store.snapshot(30)
    assert store.kept == [0, 10, 30] and store.checkpoints == {}
