"""Pre-allocated K/V of every attention layer of one sequence, with compaction of an accepted
tree path. Owned by :class:`~redrafter_mlx.core.decode.sequence.Sequence`, which says where its
committed prefix ends (``offset``).

Legend: S committed tokens, T tokens written by one forward, L beam length, K KV heads,
D head dim.

A verify forward writes the K/V of its ``T`` tree nodes into a *scratch* area right after the
committed prefix (``[offset, offset + T)``) without committing them. ``compact(offset, path)``
then moves the accepted root-to-leaf path to ``[offset, offset + L)``; the sequence commits
only the accepted count once the host knows it. Slots past the prefix are dead and get
overwritten by the next forward.

The accepted path is gathered from the forward's own new K/V (kept by ``write``), not from the
buffer it is moved within: MLX updates a buffer in place only when nothing else holds it, and
a gather from the buffer still holds it (its CPU task retains its inputs until it runs), so
the update would copy the whole buffer, every layer, every step (at long contexts that copy
costs about as much as the verify forward itself).
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
        # per layer: the last forward's (offset, keys, values) as written, for ``compact``
        self._written: list[tuple[int, mx.array, mx.array] | None] = [None] * num_layers

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
        keys, values = keys.astype(self.dtype), values.astype(self.dtype)
        self.keys[layer][..., offset:end, :] = keys
        self.values[layer][..., offset:end, :] = values
        self._written[layer] = (offset, keys, values)
        return self.keys[layer][..., :end, :], self.values[layer][..., :end, :]

    def compact(self, offset: int, path: mx.array) -> None:
        """Move scratch nodes ``path (L,)`` (relative to ``offset``) to ``[offset, offset + L)``.
        Lazy: ``path`` may be an unevaluated device array."""
        end = offset + path.shape[0]
        for i in range(len(self.keys)):
            if self.keys[i] is None:
                continue
            written, self._written[i] = self._written[i], None
            if written is not None and written[0] == offset:  # the scratch as written
                keys, values, nodes = written[1], written[2], path
            else:
                keys, values, nodes = self.keys[i], self.values[i], offset + path
            self.keys[i][..., offset:end, :] = mx.take(keys, nodes, axis=2)
            self.values[i][..., offset:end, :] = mx.take(values, nodes, axis=2)

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
