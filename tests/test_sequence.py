"""The sequence owns a step's state: ids, n-gram index, drafter parts and K/V move together,
a spent decode state cannot be stepped, and a forward taps chosen layers' hidden states."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from support import decoder_for, decoding_of, tiny_llama

from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.cache import KVStore
from redrafter_mlx.core.decode.lookup import NgramIndex
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.step import SpentState
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import random_drafter

PROMPT = [5, 9, 2, 5, 9, 3, 5, 9, 2]


class RecordingPart:
    """A drafter's per-sequence part that remembers what the sequence told it."""

    def __init__(self):
        self.ids: list[int] = []

    def commit(self, ids):
        self.ids.extend(ids)

    def rewind(self, length):
        del self.ids[length:]

    def arrays(self):
        return []


def fed(model, ids):
    sequence = llm.new_sequence(model)
    n = len(ids)
    mx.eval(llm.forward(model, mx.array(ids), mx.arange(n), llm.CAUSAL, sequence))
    sequence.commit(ids)
    return sequence


def test_index_and_parts_follow_commits_and_rewinds():
    model = tiny_llama(seed=1)
    sequence = fed(model, PROMPT[:4])
    part = RecordingPart()
    sequence.parts.append(part)
    part.ids = list(sequence.ids)
    index = sequence.index  # built now, from the ids so far; kept in step afterwards
    positions = mx.arange(4, len(PROMPT))
    mx.eval(llm.forward(model, mx.array(PROMPT[4:]), positions, llm.CAUSAL, sequence))
    sequence.commit(PROMPT[4:])
    assert sequence.index is index and index.tokens == PROMPT == part.ids
    fresh = NgramIndex(PROMPT)
    np.testing.assert_array_equal(index.propose(5, 2, 3), fresh.propose(5, 2, 3))
    sequence.rewind(5)
    assert index.tokens == PROMPT[:5] == part.ids == list(sequence.ids)
    np.testing.assert_array_equal(index.propose(9, 2, 3), NgramIndex(PROMPT[:5]).propose(9, 2, 3))


def test_reuse_prefix_keeps_one_token_to_feed():
    sequence = fed(tiny_llama(seed=1), PROMPT)
    assert sequence.reuse_prefix(PROMPT) == (len(PROMPT) - 1, 0)
    assert sequence.offset == len(PROMPT) - 1
    assert sequence.reuse_prefix([5, 9, 7]) == (2, 0)


def test_a_spent_state_cannot_step_and_a_restored_one_can():
    model = tiny_llama(seed=2)
    drafter = BeamDrafter(random_drafter(64, 64, seed=3), model.model.embed_tokens)
    decoder = decoder_for(model, drafter)
    sequence = decoder.new_sequence()
    state, _ = decoder.prefill(sequence, PROMPT, decoding_of(drafter, BeamShape(2, 3)))
    mark = sequence.mark()
    following, step = decoder.step(state)
    with pytest.raises(SpentState):
        decoder.step(state)
    sequence.restore(mark)
    _, again = decoder.step(state)
    assert again.tokens == step.tokens
    with pytest.raises(SpentState):  # the sequence went back past it
        decoder.step(following)


def test_an_autoregressive_state_is_spent_once_stepped():
    model = tiny_llama(seed=2)
    decoder = decoder_for(model)
    sequence = decoder.new_sequence()
    state, first = decoder.prefill(sequence, PROMPT, decoding_of(autoregressive=True))
    assert first is None
    decoder.step(state)
    with pytest.raises(SpentState):
        decoder.step(state)


@pytest.mark.parametrize("layer", [0, 2])
def test_taps_equal_the_model_run_to_that_layer(layer):
    """A forward's tap of layer i is the residual stream after layer i, as mlx-lm's own layers
    compute it; the final hidden state is unchanged by tapping."""
    model = tiny_llama(seed=4, layers=3)
    forward = decoder_for(model).forward
    tokens = mx.array(PROMPT)
    positions = mx.arange(len(PROMPT))
    plain = forward(tokens, positions, llm.CAUSAL, llm.new_sequence(model), compiled=False)
    taps = {layer: None}
    hidden = forward(
        tokens, positions, llm.CAUSAL, llm.new_sequence(model), compiled=False, taps=taps
    )
    h = model.model.embed_tokens(tokens[None])
    for block in model.model.layers[: layer + 1]:
        h = block(h, "causal", None)
    assert set(taps) == {layer}
    np.testing.assert_allclose(taps[layer], h[0], atol=1e-4)
    np.testing.assert_allclose(hidden, plain, atol=1e-5)


def test_taps_of_a_verified_tree_step():
    """Tapping a compiled one-token step (what a drafter reading several layers asks of
    each verify forward) gives the same as tapping the prompt's last position."""
    model = tiny_llama(seed=4, layers=3)
    forward = decoder_for(model).forward
    whole, taps, last = llm.new_sequence(model), {1: None}, {1: None}
    forward(mx.array(PROMPT), mx.arange(len(PROMPT)), llm.CAUSAL, whole, compiled=False, taps=taps)
    sequence = fed(model, PROMPT[:-1])
    n = len(PROMPT) - 1
    forward(mx.array(PROMPT[-1:]), mx.array([n]), None, sequence, taps=last)
    np.testing.assert_allclose(last[1][0], taps[1][-1], atol=1e-4)


def _store_after_forward(offset: int, capacity: int = 4096):
    """A 2-layer KVStore ``(1, 4, capacity, 64)`` with a 3-node forward written at ``offset``
    -> (store, the written keys per layer, a path that depends on the forward's output)."""
    store = KVStore(2, mx.float32)
    store.capacity = capacity
    for buffers in (store.keys, store.values):
        buffers[:] = [mx.zeros((1, 4, capacity, 64)) for _ in range(2)]
    written = [mx.random.normal((1, 4, 3, 64), key=mx.random.key(i)) for i in range(2)]
    views = [store.write(i, offset, written[i], -written[i]) for i in range(2)]
    read = mx.sum(mx.stack([keys.sum() for keys, _ in views]))
    path = mx.array([0, 2]) + (read > 1e30).astype(mx.int32)  # [0, 2], lazily
    mx.eval(store.arrays(), path)
    return store, written, path


@pytest.mark.parametrize("forgotten", [False, True])
def test_compaction_moves_the_path_and_updates_in_place(forgotten):
    """The accepted path lands at the offset; gathered from the forward's own K/V, the update
    reuses the buffers (no buffer-sized allocation: copying them was most of a tree step's
    overhead at long contexts); without them (``forgotten``) it still moves the right rows."""
    offset = 4000
    store, written, path = _store_after_forward(offset)
    if forgotten:
        store._written = [None, None]
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    store.compact(offset, path)
    mx.eval(store.arrays())
    for i in range(2):
        np.testing.assert_array_equal(
            store.keys[i][..., offset : offset + 2, :], written[i][..., [0, 2], :]
        )
        np.testing.assert_array_equal(
            store.values[i][..., offset : offset + 2, :], -written[i][..., [0, 2], :]
        )
    buffer = 4 * 4096 * 64 * 4
    if not forgotten:
        assert mx.get_peak_memory() - before < buffer / 8
