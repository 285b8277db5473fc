"""Pre-allocated K/V of every attention layer of one sequence, with compaction of an accepted
tree path. Owned by :class:`~redrafter_mlx.core.sequence.Sequence`, which says where its
committed prefix ends (``offset``).

Legend: S committed tokens, T tokens written by one forward, L beam length, K KV heads,
D head dim.

A verify forward writes the K/V of its ``T`` tree nodes into a *scratch* area right after the
committed prefix (``[offset, offset + T)``) without committing them. ``compact(offset, path)``
then moves the accepted root-to-leaf path to ``[offset, offset + L)``; the sequence commits
only the accepted count once the host knows it. Slots past the prefix are dead and get
overwritten by the next forward.
"""

from __future__ import annotations

import mlx.core as mx

GROW_STEP = 256


class KVStore:
    """K/V buffers ``(1, K, capacity, D)`` per attention layer (None before its first write:
    layers may differ in heads and head size)."""

    def __init__(self, num_layers: int, dtype: mx.Dtype):
        self.dtype = dtype
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.capacity = 0

    def reserve(self, offset: int, num_new: int) -> None:
        """Room for ``num_new`` tokens after ``offset`` (grows in steps of 256)."""
        needed = offset + num_new
        if needed <= self.capacity:
            return
        new_capacity = -(-needed // GROW_STEP) * GROW_STEP
        # Fresh arrays per slot: slice assignment mutates the array object in place.
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                if old is not None:
                    b, h, _, d = old.shape
                    extra = mx.zeros((b, h, new_capacity - self.capacity, d), self.dtype)
                    buffers[i] = mx.concatenate([old, extra], axis=2)
        self.capacity = new_capacity

    def _allocate(self, layer: int, keys: mx.array, values: mx.array) -> None:
        for buffers, x in ((self.keys, keys), (self.values, values)):
            b, h, _, d = x.shape
            buffers[layer] = mx.zeros((b, h, self.capacity, d), self.dtype)

    def write(
        self, layer: int, offset: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write K/V ``(1, K, T, D)`` at ``[offset, offset + T)``; return ``(1, K, S + T, D)``."""
        end = offset + keys.shape[2]
        if self.keys[layer] is None:
            self._allocate(layer, keys, values)
        self.keys[layer][..., offset:end, :] = keys.astype(self.dtype)
        self.values[layer][..., offset:end, :] = values.astype(self.dtype)
        return self.keys[layer][..., :end, :], self.values[layer][..., :end, :]

    def compact(self, offset: int, path: mx.array) -> None:
        """Move scratch nodes ``path (L,)`` (relative to ``offset``) to ``[offset, offset + L)``.
        Lazy: ``path`` may be an unevaluated device array."""
        src = offset + path
        end = offset + path.shape[0]
        for i in range(len(self.keys)):
            if self.keys[i] is None:
                continue
            self.keys[i][..., offset:end, :] = mx.take(self.keys[i], src, axis=2)
            self.values[i][..., offset:end, :] = mx.take(self.values[i], src, axis=2)

    def arrays(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None]


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
