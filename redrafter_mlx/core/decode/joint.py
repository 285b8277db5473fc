"""One forward over several sequences' new tokens at once: :class:`JointView`.

Legend: B sequences, T_i the new tokens of sequence i, N their sum, S_i its cached tokens,
K KV heads, D head dim.

A batch step verifies B sequences' trees (an autoregressive sequence's one token is a 1-node
tree) in ONE target forward: their tokens are concatenated into one row of ``N`` tokens, so
every weight (projections, MLP, LM head) is read once for all of them, the cost a small model
is bound by. Attention stays each sequence's own: each segment of rows writes its K/V into its
own sequence (through that sequence's :class:`~redrafter_mlx.core.decode.sequence.View`) and sees
only that sequence's cache and tree.

The generic forward runs the model's own modules over :class:`JointLayerCache`: each segment's
rows attend its own sequence's cache ``(1, K, S_i + T_i, D)`` under its own mask, one fused
attention call per segment (:func:`route_attention` points the model's attention modules at
:meth:`JointLayerCache.attend`), so no cache is copied and no row scores another sequence's
keys. An attention module that computes attention itself gets what mlx-lm's caches give:
the segments' caches side by side ``(1, K, sum(S_i + T_i), D)`` and a block mask (a segment's
rows see only its own block), built lazily, so they cost nothing where the routed attention
runs instead. The CPU plan's forward attends each segment against its own sequence's cache
alone (``backend.cpu.fused.FusedForward.run_joint``), all segments of a layer in one kernel
call.
"""

from __future__ import annotations

import functools
import types
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
        self._masks: dict[tuple, list[mx.array | None]] = {}
        self._blocks: list[tuple[mx.array, tuple[int, int] | None]] = []

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

    def masks(self, window: tuple[int, int] | None) -> list[mx.array | None]:
        """Each segment's mask ``(T_i, S_i + T_i)`` (None: sees its whole cache), narrowed
        by position on a sliding-window layer (``window`` ``(size, keep)``: a key is seen
        when ``pos(q) - pos(k) < size``, or among the sequence's first ``keep`` tokens)."""
        key = window or (None, 0)
        if key not in self._masks:
            views = self.views
            self._masks[key] = [_windowed(v.mask, v.offset, v.positions, window) for v in views]
        return self._masks[key]

    def block_mask(self, window: tuple[int, int] | None = None) -> mx.array:
        """``(N, sum(S_i + T_i))`` boolean: each segment's :meth:`masks` on its own block,
        for attention that is not routed per segment (lazy: unused, never computed)."""
        widths = [s + b - a for s, (a, b) in zip(self.cached(), self.bounds, strict=True)]
        total, rows, left = sum(widths), [], 0
        for own, width, (start, stop) in zip(self.masks(window), widths, self.bounds, strict=True):
            if own is None:
                own = mx.ones((stop - start, width), mx.bool_)
            before = mx.zeros((stop - start, left), mx.bool_)
            after = mx.zeros((stop - start, total - left - width), mx.bool_)
            rows.append(mx.concatenate([before, own, after], axis=1))
            left += width
        block = mx.concatenate(rows, axis=0)
        self._blocks.append((block, window))
        return block

    def window_of(self, mask) -> tuple[bool, tuple[int, int] | None]:
        """Whether ``mask`` is a block mask of this forward, and the window it was made for."""
        for block, window in self._blocks:
            if mask is block:
                return True, window
        return False, None


def _windowed(mask, cached: int, positions: mx.array, window) -> mx.array | None:
    """One segment's ``mask (T, S + T)`` (or None) narrowed to ``window`` ``(size, keep)``;
    cached tokens sit at positions ``0 .. S - 1``."""
    if window is None or window[0] is None:
        return mask
    size, keep = window
    key_positions = mx.concatenate([mx.arange(cached, dtype=mx.int32), positions])
    seen = positions[:, None] - key_positions[None] < size
    if keep:  # the first ``keep`` tokens of the sequence stay visible
        seen = seen | (mx.arange(key_positions.shape[0]) < keep)[None]
    return seen if mask is None else seen & mask


class JointLayerCache:
    """One attention layer's cache over a :class:`JointView`, as mlx-lm's attention modules
    use a cache: ``offset`` the N tokens' positions (for
    :class:`~redrafter_mlx.core.decode.llm.TokenRope`), ``update_and_fetch`` writes each
    segment's K/V into its sequence, ``attend`` runs each segment's attention on its own
    cache; an unrouted module gets the caches side by side and a block mask instead
    (``make_mask``, narrowed by position on sliding-window layers)."""

    def __init__(self, joint: JointView, layer: int, window=None):
        self.joint, self.layer, self.window = joint, layer, window
        self.offset = joint.positions
        self._own: list[tuple[mx.array, mx.array]] = []
        self._fetched: tuple[mx.array, mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._own = [
            view.write(self.layer, k, v)
            for view, k, v in zip(
                self.joint.views,
                self.joint.split(keys, 2),
                self.joint.split(values, 2),
                strict=True,
            )
        ]
        # lazy: copied only if the module attends them itself (see ``attend``)
        self._fetched = (
            mx.concatenate([k for k, _ in self._own], axis=2),
            mx.concatenate([v for _, v in self._own], axis=2),
        )
        return self._fetched

    def make_mask(self, n: int, *, window_size: int | None = None, **_) -> mx.array:
        window = (window_size, 0) if window_size else self.window
        return self.joint.block_mask(window)

    def attend(self, queries, keys, values, *, scale: float, mask, **kwargs) -> mx.array:
        """Attention of the joint rows ``queries (1, heads, N, D)`` -> ``(1, heads, N, D)``:
        each segment's rows on its own cache under its own mask, where ``keys``, ``values``
        and ``mask`` are what this cache handed out; otherwise over what the module passes."""
        routed, window = self.joint.window_of(mask)
        fetched = self._fetched
        if not routed or fetched is None or keys is not fetched[0] or values is not fetched[1]:
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask=mask, **kwargs
            )
        parts = zip(self.joint.split(queries, 2), self._own, self.joint.masks(window), strict=True)
        return mx.concatenate(
            [
                mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m, **kwargs)
                for q, (k, v), m in parts
            ],
            axis=2,
        )


ATTENTION_NAME = "scaled_dot_product_attention"  # mlx-lm's attention, by its modules' name


def route_attention(model) -> None:
    """Point every attention module of ``model`` (a copy: its modules' classes change) that
    calls mlx-lm's ``scaled_dot_product_attention`` at :func:`_attention`, which hands a
    :class:`JointLayerCache`'s attention to :meth:`JointLayerCache.attend` and any other
    cache's to mlx-lm's own function."""
    for _, module in model.named_modules():
        call = type(module).__call__
        code = getattr(call, "__code__", None)
        if code is not None and ATTENTION_NAME in code.co_names:
            if callable(call.__globals__.get(ATTENTION_NAME)):
                module.__class__ = _routed(type(module))


@functools.cache
def _routed(cls: type) -> type:
    """``cls`` with its ``__call__`` reading :data:`ATTENTION_NAME` as the routed attention:
    the same code over a copy of its module's globals (mlx-lm's modules stay as they are)."""
    call = cls.__call__
    scope = dict(call.__globals__)
    scope[ATTENTION_NAME] = functools.partial(_attention, scope[ATTENTION_NAME])
    routed = types.FunctionType(
        call.__code__, scope, call.__name__, call.__defaults__, call.__closure__
    )
    routed.__kwdefaults__ = call.__kwdefaults__
    return type(cls.__name__, (cls,), {"__call__": routed, "__module__": cls.__module__})


def _attention(original, queries, keys, values, cache, scale, mask, **kwargs) -> mx.array:
    if isinstance(cache, JointLayerCache):
        return cache.attend(queries, keys, values, scale=scale, mask=mask, **kwargs)
    return original(queries, keys, values, cache, scale=scale, mask=mask, **kwargs)


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
