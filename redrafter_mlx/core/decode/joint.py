"""One forward over several sequences' new tokens at once: :class:`JointView`.

Legend: B sequences, T_i the new tokens of sequence i, N their sum, S_i its cached tokens,
K KV heads, D head dim.

A batch step verifies B sequences' trees (an autoregressive sequence's one token is a 1-node
tree) in ONE target forward: their tokens are concatenated into one row of ``N`` tokens, so
every weight (projections, MLP, LM head) is read once for all of them, the cost a small model
is bound by. Attention stays each sequence's own: each segment of rows writes its K/V into its
own sequence (through that sequence's :class:`~redrafter_mlx.core.decode.sequence.View`) and sees
only that sequence's cache and tree.

The generic forward runs the model's own modules over :class:`JointLayerCache`, which hands
every layer the segments' caches side by side ``(1, K, sum(S_i + T_i), D)`` and a block mask
(a segment's rows see only its own block): MLX's fused attention then does all segments in
one call. The CPU plan's forward attends each segment against its own sequence's cache alone
(``backend.cpu.fused.FusedForward.run_joint``), all segments of a layer in one kernel call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from redrafter_mlx.core.decode.recurrent import Levels, States, StateSlot
from redrafter_mlx.core.decode.sequence import Sequence, View


@dataclass(frozen=True)
class Segment:
    """One sequence's part of a joint forward: ``tokens (T,)`` at ``positions (T,)`` under
    ``mask`` (``(T, S + T)`` boolean, or None: one token that sees the whole cache), ``tree``
    the packed tree they are (None: a chain), ``taps`` the layers whose output it keeps."""

    sequence: Sequence
    tokens: mx.array
    positions: mx.array
    mask: mx.array | None
    tree: object = None
    taps: dict | None = None

    @property
    def count(self) -> int:
        return self.tokens.shape[0]


class JointView:
    """The views of B segments' sequences, each over its rows ``[start, start + T_i)`` of the
    joint forward's ``N`` rows."""

    def __init__(self, segments: list[Segment]):
        self.segments = segments
        self.views: list[View] = [
            s.sequence.begin(s.positions.astype(mx.int32), s.mask, s.tree, taps=s.taps or ())
            for s in segments
        ]
        starts = [0]
        for s in segments:
            starts.append(starts[-1] + s.count)
        self.bounds = list(zip(starts[:-1], starts[1:], strict=True))
        self.positions = mx.concatenate([v.positions for v in self.views])
        self.taps = frozenset().union(*(v.taps for v in self.views))

    @functools.cached_property
    def tree_levels(self) -> list[Levels] | None:
        """Each segment's tree by depth (a single token's: one node), what the recurrent
        layers run; None when a segment is a chain of several tokens (it runs alone)."""
        chains = (
            v.levels is None and b - a > 1
            for v, (a, b) in zip(self.views, self.bounds, strict=True)
        )
        if any(chains):
            return None
        return [v.levels or Levels.of(np.array([-1]), np.array([0])) for v in self.views]

    @property
    def rows(self) -> int:
        return self.bounds[-1][1]

    def split(self, rows: mx.array, axis: int = 0) -> list[mx.array]:
        """``rows`` (N along ``axis``) -> each segment's part."""
        index = [slice(None)] * rows.ndim
        parts = []
        for start, stop in self.bounds:
            index[axis] = slice(start, stop)
            parts.append(rows[tuple(index)])
        return parts

    def record(self, layer: int, hidden: mx.array) -> None:
        """A tapped layer's output ``(1, N', H)`` (N' >= N: padding rows last) -> each view."""
        for view, (start, stop) in zip(self.views, self.bounds, strict=True):
            view.record(layer, hidden[:, start:stop])

    def finish(self) -> None:
        """Fill each segment's taps from its view."""
        for segment, view in zip(self.segments, self.views, strict=True):
            if segment.taps is not None:
                segment.taps.update(view.hidden)

    def cached(self) -> list[int]:
        """Each segment's cached tokens ``S_i``."""
        return [v.offset for v in self.views]

    def block_mask(self) -> mx.array:
        """``(N, sum(S_i + T_i))`` boolean: each segment's own mask on its own block."""
        widths = [s + b - a for s, (a, b) in zip(self.cached(), self.bounds, strict=True)]
        total = sum(widths)
        rows, left = [], 0
        for view, width, (start, stop) in zip(self.views, widths, self.bounds, strict=True):
            own = view.mask
            if own is None:
                own = mx.ones((stop - start, width), mx.bool_)
            before = mx.zeros((stop - start, left), mx.bool_)
            after = mx.zeros((stop - start, total - left - width), mx.bool_)
            rows.append(mx.concatenate([before, own, after], axis=1))
            left += width
        return mx.concatenate(rows, axis=0)

    def key_positions(self) -> mx.array:
        """The positions of the joint keys ``(sum(S_i + T_i),)``, segment after segment."""
        parts = []
        for s, view in zip(self.cached(), self.views, strict=True):
            parts += [mx.arange(s, dtype=mx.int32), view.positions]
        return mx.concatenate(parts)


class JointLayerCache:
    """One attention layer's cache over a :class:`JointView`, as mlx-lm's attention modules
    use a cache: ``offset`` the N tokens' positions (for
    :class:`~redrafter_mlx.core.decode.llm.TokenRope`), ``update_and_fetch`` writes each segment's
    K/V into its sequence and returns the segments' caches side by side, ``make_mask`` the
    block mask (narrowed by position on sliding-window layers)."""

    def __init__(self, joint: JointView, layer: int, window=None, mask: mx.array | None = None):
        self.joint, self.layer, self.window = joint, layer, window
        self.offset = joint.positions
        self.mask = mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out_keys, out_values = [], []
        for view, k, v in zip(
            self.joint.views, self.joint.split(keys, 2), self.joint.split(values, 2), strict=True
        ):
            k, v = view.write(self.layer, k, v)
            out_keys.append(k)
            out_values.append(v)
        return mx.concatenate(out_keys, axis=2), mx.concatenate(out_values, axis=2)

    def make_mask(self, n: int, *, window_size: int | None = None, **_) -> mx.array:
        size, keep = (window_size, 0) if window_size else (self.window or (None, 0))
        if size is None:
            return self.mask
        key_positions = self.joint.key_positions()
        seen = self.offset[:, None] - key_positions[None] < size
        if keep:  # the first ``keep`` tokens of each sequence stay visible
            cached, bounds = self.joint.cached(), self.joint.bounds
            firsts = [mx.arange(s + b - a) < keep for s, (a, b) in zip(cached, bounds, strict=True)]
            seen = seen | mx.concatenate(firsts)[None]
            return seen & self.mask
        return seen & self.mask


class JointStateSlot(StateSlot):
    """One recurrent layer's cache over a :class:`JointView`: every segment's tree (a single
    token is a 1-node tree) depth by depth, the nodes of depth ``d`` of all segments as one
    batch of one-token sequences through the layer's own module, each from its parent's state
    (its sequence's committed state at depth 0): the single forward's tree
    (:class:`~redrafter_mlx.core.decode.recurrent.StateSlot`), with the sequences side by side in
    the batch. A segment that is a chain of several tokens (not a decode step) runs alone."""

    def __init__(self, joint: JointView, index: int, size: int):
        self.joint, self.index, self.size = joint, index, size

    def __getitem__(self, i: int):
        raise TypeError("a joint forward's recurrent states are per sequence")

    def run(self, mixer, call: dict, input_name: str) -> mx.array:
        """``mixer`` over the joint forward's ``(1, N, H)`` input -> its output ``(1, N, H')``."""
        joint, levels = self.joint, self.joint.tree_levels
        x = call[input_name][0]  # (N, H)
        starts = [view.committed_states(self.index) for view in joint.views]
        if levels is None or any(s is None for s in starts):  # each as its own forward
            return self._alone(mixer, call, input_name, x)
        outs, states = self._by_depth(mixer, call, input_name, x, levels, starts)
        results = []
        for view, level, out, held in zip(joint.views, levels, outs, states, strict=True):
            if view.levels is None:  # one token: the state after it, committed with it
                view.stage_states(self.index, held[0])
            else:  # depth order, as the single forward holds them
                view.node_states(self.index, [mx.concatenate(p) for p in zip(*held, strict=True)])
            results.append(mx.concatenate(out)[level.node_rows])
        return mx.concatenate(results).swapaxes(0, 1)  # (1, N, H') segment after segment

    def _by_depth(self, mixer, call, input_name, x, levels, previous: list[States]):
        """Each depth of every segment's tree as one batch -> per segment, its outputs and
        its nodes' states, depth by depth."""
        outs: list[list] = [[] for _ in levels]
        states: list[list] = [[] for _ in levels]
        for depth in range(max(len(level.nodes) for level in levels)):
            inputs, begins, counts = [], [], []
            for i, (level, (start, _)) in enumerate(zip(levels, self.joint.bounds, strict=True)):
                if depth >= len(level.nodes):
                    counts.append(0)
                    continue
                nodes, parents = level.nodes[depth], level.parents[depth]
                if parents is None:  # depth 0: the committed state, once per node
                    parents = mx.zeros(nodes.shape, mx.int32)
                inputs.append(x[nodes + start])
                begins.append([s[parents] for s in previous[i]])
                counts.append(nodes.shape[0])
            cache = self._arrays_cache([mx.concatenate(p) for p in zip(*begins, strict=True)])
            out = mixer(**{**call, input_name: mx.concatenate(inputs)[:, None], "cache": cache})
            row = 0
            for i, n in enumerate(counts):
                if n:
                    previous[i] = [s[row : row + n] for s in cache.cache]
                    outs[i].append(out[row : row + n])
                    states[i].append(previous[i])
                    row += n
        return outs, states

    def _alone(self, mixer, call, input_name, x) -> mx.array:
        outs = []
        for view, part in zip(self.joint.views, self.joint.split(x), strict=True):
            slot = StateSlot(view, self.index, self.size)
            outs.append(slot.run(mixer, {**call, input_name: part[None]}, input_name))
        return mx.concatenate(outs, axis=1)
