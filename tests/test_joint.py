"""The generic joint forward (core/decode/joint.py through core/decode/llm.py): each member's
rows attend its own sequence's cache alone, and get the hidden states its own forward gives."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from support.families import build

from redrafter_mlx.core.decode.joint import Segment
from redrafter_mlx.core.decode.llm import CAUSAL, Forward, new_sequence

# llama: full attention; ministral and gemma3_text: sliding windows shorter than the caches
# (gemma3's masks come from two layers' caches); gemma2: an attention module that calls MLX
# itself (not routed: it gets the caches side by side and a block mask)
FAMILIES = ["llama", "ministral", "gemma3_text", "gemma2"]
ROUTED = ["llama", "ministral", "gemma3_text"]
PROMPTS = [[3, 14, 15, 9, 26, 5, 35, 3, 14], [1, 2, 3, 4], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
TREES = [[-1, 0, 0, 1], [-1], [-1, 0, 1]]  # each member's tree by parent (a token: [-1])


def prefilled(forward: Forward, ids: list[int]):
    """A sequence of ``ids``, committed."""
    sequence = new_sequence(forward.model)
    hidden = forward(mx.array(ids), mx.arange(len(ids)), CAUSAL, sequence, compiled=False)
    mx.eval(hidden)
    sequence.commit(ids)
    return sequence


def segment(sequence, parents: list[int], first: int) -> Segment:
    """A tree of ``len(parents)`` tokens (``first``, ``first + 1``, ...) after ``sequence``:
    each node sees the cache and its ancestors (one token: mask None)."""
    count, cached = len(parents), sequence.offset
    ancestors, depths = np.zeros((count, count), bool), np.zeros(count, np.int32)
    for node in range(count):
        up = node
        while up >= 0:
            ancestors[node, up] = True
            up = parents[up]
        depths[node] = ancestors[node].sum() - 1
    mask = None
    if count > 1:
        mask = mx.concatenate([mx.ones((count, cached), mx.bool_), mx.array(ancestors)], axis=1)
    tokens = mx.arange(first, first + count)
    return Segment(sequence, tokens, mx.array(depths + cached), mask)


def members(forward: Forward, prompts: list[list[int]]) -> list[Segment]:
    """Each prompt's sequence with its tree of :data:`TREES` after it."""
    return [
        segment(prefilled(forward, p), parents, 60 + 5 * i)
        for i, (p, parents) in enumerate(zip(prompts, TREES, strict=True))
    ]


def joint_and_alone(family: str, prompts: list[list[int]]):
    """Each member's hidden ``(T_i, H)`` from one joint forward, and from its own forward."""
    forward = Forward(build(family))
    segments = members(forward, prompts)
    joint = forward.joint(segments)
    mx.eval(joint)
    alone = [forward.segment(s) for s in segments]
    mx.eval(alone)
    return joint, alone


@pytest.mark.parametrize("family", FAMILIES)
def test_each_member_of_a_joint_forward_gets_its_own_forward_s_hidden(family):
    joint, alone = joint_and_alone(family, PROMPTS)
    for mine, own in zip(joint, alone, strict=True):
        assert mine.shape == own.shape
        assert mx.allclose(mine, own, atol=1e-5).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_member_s_rows_never_see_another_member_s_keys(family):
    """The first member's hidden is the same whatever the others' caches hold, and changes
    when its own cache does (so a member attending another's keys fails here)."""
    first, _ = joint_and_alone(family, PROMPTS)
    others = [PROMPTS[0], [90, 91, 92, 93], [p % 7 for p in PROMPTS[2]]]
    second, _ = joint_and_alone(family, others)
    own_changed = [[p + 1 for p in PROMPTS[0]], *PROMPTS[1:]]
    third, _ = joint_and_alone(family, own_changed)
    assert mx.allclose(first[0], second[0], atol=1e-6).item()
    assert mx.abs(first[0] - third[0]).max().item() > 1e-3


@pytest.mark.parametrize("family", ROUTED)
def test_routed_attention_reads_each_member_s_cache_alone(family, monkeypatch):
    """Every attention call of a routed model's joint forward sees one member's keys: no
    cache is copied side by side."""
    widths, real = [], mx.fast.scaled_dot_product_attention

    def spy(queries, keys, values, **kwargs):
        widths.append(keys.shape[2])
        return real(queries, keys, values, **kwargs)

    forward = Forward(build(family))
    segments = members(forward, PROMPTS)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    mx.eval(forward.joint(segments))
    own = {len(p) + len(t) for p, t in zip(PROMPTS, TREES, strict=True)}
    assert widths and set(widths) <= own
