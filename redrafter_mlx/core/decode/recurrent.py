"""Recurrent layers (Gated DeltaNet, Mamba/Mamba2, short convolutions) along a packed tree.

Legend: T tree nodes, n_d the nodes at depth d, H hidden size.

A recurrent layer's state after a token depends on the whole path to it, so a tree cannot be
verified as one chain. Every node has exactly one parent, though: the layer runs depth by
depth, all nodes of depth ``d`` as one batch of one-token sequences, each starting from its
parent's state (the committed state for depth 0). That is the layer's own mlx-lm module, called
with mlx-lm's own ``ArraysCache`` per depth (batch ``n_d``, one token each, exactly what an
autoregressive step computes), so it keeps the tree's prefix sharing and stays exact. Every
node's state is kept (``(T, ...)`` per state array); after acceptance the accepted node's
becomes the committed state, and the rest are dropped.

A prompt, or any other chain of tokens, runs through the module as a chain (mlx-lm's own
prefill, with whatever fast kernel the device has).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache

States = list  # one layer's state arrays (e.g. [conv state, SSM state]), batch first


class StateStore:
    """The recurrent state of every recurrent layer of one sequence.

    ``committed[i]``: layer ``i``'s state after the committed tokens (None: no token yet);
    ``staged[i]``: its state after the last forward's tokens, committed by :meth:`commit`;
    ``nodes[i]``: every node's state after a tree forward, ``(T, ...)`` per array in depth
    order (``node_rows (T,)``: each node's row), until :meth:`keep` stages the accepted
    node's. ``snapshots`` map an offset to the committed states there (each prompt's end);
    ``checkpoints`` do the same for offsets after the latest snapshot (an answer's), at most
    ``max_checkpoints`` spread evenly over them: together the only offsets a cache with
    recurrent layers can rewind to.

    A client resends an answer as text, which may come back tokenized otherwise from any
    point on (a byte-level token, a merge across two tokens): with states only at the prompt's
    end, such a follow-up re-read the whole answer where attention re-reads from the first
    changed token. Checkpoints bound that to about ``1 / max_checkpoints`` of the answer. A
    state array is never copied (each commit makes new ones): a checkpoint holds references,
    and costs the memory of the states it keeps alive.
    """

    def __init__(self, count: int, max_snapshots: int = 4, max_checkpoints: int = 4):
        self.committed: list[States | None] = [None] * count
        self.staged: list[States | None] = [None] * count
        self.nodes: list[States | None] = [None] * count
        self.node_rows: mx.array | None = None
        self.snapshots: dict[int, list[States | None]] = {0: [None] * count}
        self.max_snapshots = max_snapshots
        self.checkpoints: dict[int, list[States | None]] = {}
        self.max_checkpoints = max_checkpoints
        self._stride = 1  # tokens between checkpoints (doubled whenever there are too many)

    def __len__(self) -> int:
        return len(self.committed)

    def stage(self, layer: int, states: States) -> None:
        """Layer ``layer``'s state after a chain's last token (committed by :meth:`commit`)."""
        self.staged[layer] = states

    def hold_nodes(self, layer: int, states: States, node_rows: mx.array) -> None:
        """Every node's state of a tree forward for ``layer`` (rows ``node_rows``), until
        :meth:`keep` stages the accepted node's."""
        self.nodes[layer] = states
        self.node_rows = node_rows

    def keep(self, node: mx.array) -> None:
        """Stage node ``node ()`` of the last tree forward (lazily: a device index)."""
        row = self.node_rows[node[None]]
        for i, states in enumerate(self.nodes):
            if states is not None:
                self.staged[i] = [mx.take(x, row, axis=0) for x in states]

    def commit(self) -> None:
        """The staged states become the committed ones."""
        for i, states in enumerate(self.staged):
            if states is not None:
                self.committed[i] = states
        self.staged = [None] * len(self)
        self.nodes, self.node_rows = [None] * len(self), None

    def snapshot(self, offset: int) -> None:
        """Remember the committed states as the states at ``offset`` (arrays are immutable:
        a snapshot holds references, no copy); the oldest beyond ``max_snapshots`` go."""
        self.snapshots.pop(offset, None)
        self.snapshots[offset] = list(self.committed)
        while len(self.snapshots) > self.max_snapshots + 1:  # offset 0 (no state) stays
            del self.snapshots[next(o for o in self.snapshots if o)]
        self.checkpoints.clear()  # the next answer's start from here
        self._stride = 1

    def checkpoint(self, offset: int) -> None:
        """Keep the committed states at ``offset`` (after the latest snapshot) when no
        checkpoint is in its stride yet; when more than ``max_checkpoints`` are kept the
        stride doubles and each new stride keeps its first."""
        base = max(self.snapshots)
        if offset <= base or self._bucket(offset, base) in self._buckets(base):
            return
        self.checkpoints[offset] = list(self.committed)
        while len(self.checkpoints) > self.max_checkpoints:
            self._stride *= 2
            kept = {}
            for o in sorted(self.checkpoints):
                kept.setdefault(self._bucket(o, base), o)
            self.checkpoints = {o: self.checkpoints[o] for o in sorted(kept.values())}

    def _bucket(self, offset: int, base: int) -> int:
        return (offset - base) // self._stride

    def _buckets(self, base: int) -> set[int]:
        return {self._bucket(o, base) for o in self.checkpoints}

    @property
    def kept(self) -> list[int]:
        """The offsets whose states are held (snapshots and checkpoints), ascending."""
        return sorted({*self.snapshots, *self.checkpoints})

    def restore(self, offset: int) -> None:
        """Committed states := those kept at ``offset`` (KeyError when there are none)."""
        kept = self.snapshots[offset] if offset in self.snapshots else self.checkpoints[offset]
        self.committed = list(kept)
        self.staged = [None] * len(self)
        self.nodes, self.node_rows = [None] * len(self), None
        for held in (self.snapshots, self.checkpoints):  # states of tokens no longer cached
            for o in [o for o in held if o > offset]:
                del held[o]

    def arrays(self) -> list[mx.array]:
        """Arrays to evaluate to materialise the states (the snapshots' too: what the states
        hold in memory), each once."""
        groups = self.committed + self.staged + self.nodes
        for held in (self.snapshots, self.checkpoints):
            groups += [states for kept in held.values() for states in kept]
        found = {id(x): x for states in groups if states is not None for x in states}
        return [x for x in found.values() if x is not None]


@dataclass(frozen=True)
class Levels:
    """A packed tree grouped by depth, the same for every recurrent layer of one forward:
    ``nodes[d]`` the nodes of depth ``d`` (``(n_d,)``), ``parents[d]`` each one's parent's row
    among depth ``d - 1``'s nodes (None at depth 0: they start from the committed state), and
    ``node_rows (T,)`` each node's row when the depths are concatenated in order."""

    nodes: list[mx.array]
    parents: list[mx.array | None]
    node_rows: mx.array

    @classmethod
    def of(cls, parents: np.ndarray, depths: np.ndarray) -> Levels:
        """The levels of a tree with ``parents (T,)`` (-1: the root) and ``depths (T,)``."""
        row = np.zeros(len(parents), np.int64)  # each node's row among its depth's
        nodes, parent_rows = [], []
        for depth in range(int(depths.max()) + 1):
            level = np.flatnonzero(depths == depth)
            row[level] = np.arange(len(level))
            nodes.append(level)
            parent_rows.append(None if depth == 0 else _index(row[parents[level]]))
        node_rows = _index(np.argsort(np.concatenate(nodes)))
        return cls([_index(n) for n in nodes], parent_rows, node_rows)


def _index(rows: np.ndarray) -> mx.array:
    return mx.array(rows.astype(np.int32))


class StateSlot:
    """One recurrent layer's cache as the model passes it to the layer, for one forward
    (``view``: the forward's :class:`~redrafter_mlx.core.decode.sequence.View`; its ``levels`` None
    for a chain of tokens, else the tree grouped by depth). ``make_mask`` returns None: the
    layer never sees padding (a chain is run whole, a tree one token per sequence).
    """

    def __init__(self, view, index: int, size: int):
        self.view, self.index, self.size = view, index, size

    def __getitem__(self, i: int):
        committed = self.view.committed_states(self.index)
        return None if committed is None else committed[i]

    def make_mask(self, n: int, **_) -> None:
        return None

    def run(self, mixer: nn.Module, call: dict, input_name: str) -> mx.array:
        """Run ``mixer`` (its keyword arguments ``call``; its input ``(1, T, H)`` under
        ``input_name``) over this forward's tokens -> its output ``(1, T, H')``."""
        if self.view.levels is None:
            cache = self._arrays_cache(self.view.committed_states(self.index))
            out = mixer(**{**call, "cache": cache})
            self.view.stage_states(self.index, list(cache.cache))
            return out
        return self._run_tree(mixer, call, input_name)

    def _arrays_cache(self, states: States | None) -> ArraysCache:
        cache = ArraysCache(self.size)
        if states is not None:
            cache.cache = list(states)
        return cache

    def _run_tree(self, mixer: nn.Module, call: dict, input_name: str) -> mx.array:
        """Depth by depth: the nodes of depth d as a batch of one-token sequences, each from
        its parent's state; every node's state is held until the step keeps one."""
        x = call[input_name][0]  # (T, H)
        levels, previous = self.view.levels, self.view.committed_states(self.index)
        outs, states = [], []
        for nodes, parents in zip(levels.nodes, levels.parents, strict=True):
            if parents is None:  # depth 0: the committed state, once per node
                parents = mx.zeros(nodes.shape, mx.int32)
            start = None if previous is None else [s[parents] for s in previous]
            cache = self._arrays_cache(start)
            outs.append(mixer(**{**call, input_name: x[nodes][:, None], "cache": cache}))
            previous = list(cache.cache)
            states.append(previous)
        # the states stay in depth order (no copy into node order): keep() finds a node's row
        self.view.node_states(self.index, [mx.concatenate(p) for p in zip(*states, strict=True)])
        return mx.concatenate(outs)[levels.node_rows].swapaxes(0, 1)  # (1, T, H') node order


class TreeMixer(nn.Module):
    """A recurrent mixer module (the part of a layer that takes the recurrent cache) that
    runs a :class:`StateSlot` itself and passes every other call through unchanged."""

    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.inner = mixer
        self._signature = inspect.signature(mixer.__call__)
        self._input = next(iter(self._signature.parameters))

    def __call__(self, *args, **kwargs):
        bound = self._signature.bind(*args, **kwargs)
        slot = bound.arguments.get("cache")
        if not isinstance(slot, StateSlot):
            return self.inner(*args, **kwargs)
        call = dict(bound.arguments)
        if "mask" in call:
            call["mask"] = None  # no padding: a chain runs whole, a tree a token per sequence
        return slot.run(self.inner, call, self._input)


def takes_cache(module: nn.Module) -> bool:
    """Whether ``module``'s call has a ``cache`` parameter (a mixer, or attention)."""
    try:
        return "cache" in inspect.signature(module.__call__).parameters
    except (TypeError, ValueError):
        return False


def wrap_mixers(layer: nn.Module) -> None:
    """Wrap every outermost submodule of ``layer`` that takes a cache in :class:`TreeMixer`
    (in place: ``layer`` is a structural copy)."""
    for name, child in layer.children().items():
        children = child if isinstance(child, list) else [child]
        for i, module in enumerate(children):
            if not isinstance(module, nn.Module) or isinstance(module, TreeMixer):
                continue
            if takes_cache(module):
                wrapped = TreeMixer(module)
                if isinstance(child, list):
                    child[i] = wrapped
                else:
                    layer[name] = wrapped
            else:
                wrap_mixers(module)
