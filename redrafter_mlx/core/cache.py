"""Pre-allocated KV cache with compaction of an accepted tree path.

Legend: S cached (committed) tokens, T tokens written by one forward, L beam length,
K KV heads, D head dim.

A verify forward writes the K/V of its ``T`` tree nodes into a *scratch* area right after
the committed prefix (``[offset, offset + T)``) without committing them. ``compact(path)``
then moves the accepted root-to-leaf path to ``[offset, offset + L)``; the host commits only
the accepted count with ``commit`` once it knows it (after the step's single sync). Slots past
``offset`` are dead and get overwritten by the next step.
"""

from __future__ import annotations

import mlx.core as mx

from redrafter_mlx.core.recurrent import StateStore

GROW_STEP = 256


class KVCache:
    """K/V for every layer of one sequence; the caller owns it and passes it to ``llm.forward``.

    ``ids`` mirrors the committed token ids on the host so a chat can reuse a shared prefix;
    ``offset`` is their count, so the two can never disagree (an interrupt between two updates
    cannot leave them apart). ``num_layers`` counts attention layers, ``recurrent`` the
    layers with recurrent state (their :class:`StateStore` is ``states``, None without any).
    """

    def __init__(self, num_layers: int, dtype: mx.Dtype, recurrent: int = 0):
        self.dtype = dtype
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.capacity = 0
        self.ids: list[int] = []
        self.states = StateStore(recurrent) if recurrent else None

    @property
    def offset(self) -> int:
        """Committed tokens: where the next forward writes its K/V."""
        return len(self.ids)

    def reserve(self, num_new: int) -> None:
        """Make room for ``num_new`` tokens after ``offset`` (grows in steps of 256)."""
        needed = self.offset + num_new
        if needed <= self.capacity:
            return
        new_capacity = -(-needed // GROW_STEP) * GROW_STEP
        # Fresh arrays per slot: slice assignment mutates the array object in place.
        for cache in (self.keys, self.values):
            for i, old in enumerate(cache):
                if old is not None:
                    b, h, _, d = old.shape
                    extra = mx.zeros((b, h, new_capacity - self.capacity, d), self.dtype)
                    cache[i] = mx.concatenate([old, extra], axis=2)
        self.capacity = new_capacity

    def _allocate(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """A layer's first write sets its shape (layers may differ in heads and head size)."""
        for cache, x in ((self.keys, keys), (self.values, values)):
            b, h, _, d = x.shape
            cache[layer] = mx.zeros((b, h, self.capacity, d), self.dtype)

    def write(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write K/V ``(1, K, T, D)`` at ``[offset, offset + T)``; return ``(1, K, S + T, D)``."""
        end = self.offset + keys.shape[2]
        if self.keys[layer] is None:
            self._allocate(layer, keys, values)
        self.keys[layer][..., self.offset : end, :] = keys.astype(self.dtype)
        self.values[layer][..., self.offset : end, :] = values.astype(self.dtype)
        return self.keys[layer][..., :end, :], self.values[layer][..., :end, :]

    def compact(self, path: mx.array) -> None:
        """Move scratch nodes ``path (L,)`` (relative to ``offset``) to ``[offset, offset + L)``.

        Lazy: ``path`` may be an unevaluated device array; nothing is committed here.
        """
        src = self.offset + path
        end = self.offset + path.shape[0]
        for i in range(len(self.keys)):
            if self.keys[i] is None:
                continue
            self.keys[i][..., self.offset : end, :] = mx.take(self.keys[i], src, axis=2)
            self.values[i][..., self.offset : end, :] = mx.take(self.values[i], src, axis=2)

    def keep(self, node: mx.array) -> None:
        """Stage the recurrent states of tree node ``node ()`` (the last accepted one) for the
        next :meth:`commit` (lazy; nothing to do without recurrent layers)."""
        if self.states is not None:
            self.states.keep(node)

    def commit(self, ids: list[int]) -> None:
        """Mark the next ``len(ids)`` written slots (token ids ``ids``) as part of the prefix,
        with the recurrent states staged after them."""
        self.ids.extend(ids)  # one update: offset follows
        if self.states is not None:
            self.states.commit()

    def snapshot(self) -> None:
        """Remember the recurrent states at the current offset, so the cache can rewind here
        (nothing to do without recurrent layers: K/V rewind anywhere)."""
        if self.states is not None:
            self.states.snapshot(self.offset)

    def rewindable(self, length: int) -> bool:
        """Whether :meth:`rewind` can cut back to ``length`` tokens."""
        if self.states is None or length == self.offset:
            return True
        return 0 <= length < self.offset and length in self.states.snapshots

    def rewind(self, length: int) -> None:
        """Cut back to the first ``length`` committed tokens: the one way to shorten the
        prefix. ValueError where recurrent states have no snapshot at ``length``."""
        length = min(max(length, 0), self.offset)
        if length == self.offset:
            return
        if not self.rewindable(length):
            raise ValueError(
                f"cannot rewind to {length} tokens: recurrent layers keep their state only at "
                f"{sorted(self.states.snapshots)}"
            )
        if self.states is not None:
            self.states.restore(length)
        del self.ids[length:]

    def reuse_prefix(self, ids: list[int]) -> int:
        """Rewind to the longest prefix the cache shares with ``ids`` (the token ids of a whole
        prompt) that it can rewind to, keeping at least one of them to feed: the last one's
        hidden state predicts the next token. Returns how many of ``ids`` are cached
        (``ids[n:]`` is what to feed)."""
        reused = max(min(common_prefix(self.ids, ids), len(ids) - 1), 0)
        if self.states is not None:  # the latest state it holds at or before that
            reused = max(n for n in (*self.states.snapshots, self.offset) if n <= reused)
        self.rewind(reused)
        return reused

    def state(self) -> list[mx.array]:
        """Arrays to evaluate to materialise the cache."""
        arrays = [a for a in self.keys + self.values if a is not None]
        return arrays + (self.states.arrays() if self.states is not None else [])


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
