"""The target's verify forward over an mlx-lm model's own modules.

Legend: T new tokens, S cached tokens, H hidden size, V vocab.

Every token carries an explicit position, and attention uses an explicit boolean mask over
``cache + T``, so the same forward serves prefill (a chain), autoregressive steps (T = 1) and
tree verification (a packed tree of draft tokens).

:class:`Forward` runs the model's own ``model.model(tokens, cache=...)`` (any mlx-lm
architecture whose layers are attention layers) on a structural copy of the model (the same
weight arrays, new module objects: the caller's model is never changed): each layer gets a
:class:`TreeLayerCache` that writes its K/V through the forward's
:class:`~redrafter_mlx.core.decode.sequence.View` of the sequence, hands the layer the tree
mask through ``make_mask`` (windowed for sliding-window layers, by position), and whose
``offset`` is the tokens' positions; each RoPE module of the copy is wrapped
(:class:`TokenRope`) to rotate every token at its own position by moving the tokens to the
batch axis, where RoPE takes one offset per row.

Layers with recurrent state (Gated DeltaNet, Mamba, short convolutions: an ``ArraysCache`` in
the model's ``make_cache``) get a :class:`~redrafter_mlx.core.decode.recurrent.StateSlot` instead,
and their mixer runs a tree depth by depth (:mod:`redrafter_mlx.core.decode.recurrent`).

A device's plan may run another forward of the same numbers (``backend/``); this is the one
Metal and CUDA run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache
from mlx_lm.models.cache import KVCache as MlxKVCache

from redrafter_mlx.core.decode.joint import (
    JointLayerCache,
    JointStateSlot,
    JointView,
    Segment,
    route_attention,
)
from redrafter_mlx.core.decode.recurrent import StateSlot, wrap_mixers
from redrafter_mlx.core.decode.sequence import Sequence, View
from redrafter_mlx.core.decode.tree import Tree

# A chain of new tokens after the cache, each attending to the cache and the chain up to it:
# MLX's fused attention builds this mask itself (a prompt's mask is never materialised).
CAUSAL = "causal"


def inner_model(model: nn.Module) -> nn.Module:
    """The model without its output head: ``model.model`` (``backbone`` for Mamba and
    Nemotron-H), whose call returns the final-norm hidden states."""
    inner = getattr(model, "model", None)
    return inner if inner is not None else model.backbone


def embedding(model: nn.Module) -> nn.Module:
    """The target's token embedding (``embed_tokens``, ``embeddings`` for Mamba)."""
    inner = inner_model(model)
    embed = getattr(inner, "embed_tokens", None)
    return embed if embed is not None else inner.embeddings


def compute_dtype(model: nn.Module) -> mx.Dtype:
    """Floating dtype of activations: the embedding's weight, or a quantized embedding's
    floating scales (affine), or else (microscaled formats keep uint8 scales) the first
    floating parameter, e.g. a norm's weight."""
    embed = embedding(model)
    for x in (getattr(embed, "scales", None), embed.weight):
        if x is not None and mx.issubdtype(x.dtype, mx.floating):
            return x.dtype
    for _, x in tree_flatten(model.parameters()):
        if mx.issubdtype(x.dtype, mx.floating):
            return x.dtype
    raise ValueError("the model has no floating-point parameters to take a dtype from")


def target_dims(model: nn.Module) -> tuple[int, int]:
    """``(hidden_size, vocab_size)`` of a loaded target model."""
    args = getattr(model, "args", None)
    hidden = getattr(args, "hidden_size", None)
    vocab = getattr(args, "vocab_size", None)
    if hidden is None or vocab is None:
        emb = embedding(model)
        vocab = vocab or emb.weight.shape[0]
        hidden = hidden or getattr(emb, "dims", None) or emb.weight.shape[1]
    return int(hidden), int(vocab)


@dataclass(frozen=True)
class AttentionSlot:
    """An attention layer's K/V: ``index`` among the cache's attention layers, ``window`` its
    sliding window ``(size, keep)`` (None: full attention)."""

    index: int
    window: tuple[int, int] | None = None


@dataclass(frozen=True)
class RecurrentSlot:
    """A recurrent layer's state: ``index`` among the cache's recurrent layers, ``size`` its
    number of state arrays (mlx-lm's ``ArraysCache(size)``)."""

    index: int
    size: int


def cache_layout(model: nn.Module) -> list:
    """What the model's ``make_cache`` gives each of its layers, as slots of our cache: an
    :class:`AttentionSlot`, a :class:`RecurrentSlot`, or a list of them (a ``CacheList``).
    A model without ``make_cache`` has one full-attention slot per layer. TypeError for a
    cache the verify forward cannot run (``io.checks`` names it in one line first)."""
    if not hasattr(model, "make_cache"):
        return [AttentionSlot(i) for i in range(len(inner_model(model).layers))]
    counts = {"attention": 0, "recurrent": 0}

    def slot(cache):
        if isinstance(cache, CacheList):
            return [slot(c) for c in cache.caches]
        if isinstance(cache, ArraysCache):
            counts["recurrent"] += 1
            return RecurrentSlot(counts["recurrent"] - 1, len(cache.cache))
        if type(cache) in (MlxKVCache, RotatingKVCache):
            counts["attention"] += 1
            window = (cache.max_size, cache.keep) if isinstance(cache, RotatingKVCache) else None
            return AttentionSlot(counts["attention"] - 1, window)
        raise TypeError(f"a layer cache the verify forward cannot run: {type(cache).__name__}")

    return [slot(c) for c in model.make_cache()]


def slot_counts(layout: list) -> tuple[int, int]:
    """``(attention, recurrent)`` slots in ``layout``."""
    flat = list(_flatten(layout))
    attention = sum(isinstance(s, AttentionSlot) for s in flat)
    return attention, len(flat) - attention


def _flatten(layout):
    for item in layout:
        if isinstance(item, list):
            yield from _flatten(item)
        else:
            yield item


def new_sequence(model: nn.Module) -> Sequence:
    """An empty sequence for ``model``: pre-allocating K/V for its attention layers (each
    shaped by its first write), recurrent state for its recurrent layers."""
    attention, recurrent = slot_counts(cache_layout(model))
    return Sequence(attention, compute_dtype(model), recurrent)


def structural_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s tree of modules holding the same arrays: changing the copy's
    modules (a wrapped RoPE, a re-pointed weight) leaves the original as it was, at no memory
    cost."""
    new = copy.copy(module)  # a new dict of the same entries, and the same plain attributes
    for name, child in module.items():
        if isinstance(child, nn.Module):
            new[name] = structural_copy(child)
        elif isinstance(child, list) and any(isinstance(x, nn.Module) for x in child):
            new[name] = [structural_copy(x) if isinstance(x, nn.Module) else x for x in child]
    return new


class Forward:
    """The target's verify forward (the generic path), built once per model.

    ``model`` is a structural copy of the caller's model with :class:`TokenRope` around each
    RoPE module (and each recurrent mixer wrapped to run trees); ``layout`` what each layer's
    cache is (:func:`cache_layout`: a ``RotatingKVCache`` marks a sliding-window layer, an
    ``ArraysCache`` a recurrent one).
    """

    def __init__(self, model: nn.Module, *, dispatch_every: int = 0):
        self.model = _with_token_rope(structural_copy(model))
        route_attention(inner_model(self.model))  # a joint forward attends per sequence
        self.layout = cache_layout(model)
        layers = inner_model(self.model).layers
        if slot_counts(self.layout)[1]:
            for layer in layers:
                wrap_mixers(layer)
        # the device starts on the first layer while Python builds the rest (a tree step's
        # graph is not known before the last step's read, so it cannot be pipelined whole)
        if dispatch_every > 0:
            for i in dispatched_layers(len(layers), dispatch_every):
                layers[i] = Dispatched(layers[i])
        self._view: View | JointView | None = None  # the running forward's (for its taps)

    def __call__(
        self,
        tokens: mx.array,
        positions: mx.array,
        mask: mx.array | str | None,
        sequence: Sequence,
        *,
        compiled: bool = True,
        tree: Tree | None = None,
        taps: dict[int, mx.array | None] | None = None,
    ) -> mx.array:
        """Run the target over ``tokens (T,)`` at ``positions (T,)`` -> final-norm hidden (T, H).

        ``mask (T, S + T)`` is boolean (True = may attend), ``None`` means attend to everything
        (one token), :data:`CAUSAL` a chain after the cache (a prompt). ``tree``: the packed
        tree the tokens are (recurrent layers follow its parents; None: a chain). K/V and
        recurrent states are written after ``sequence.offset`` and not committed.
        ``compiled=False`` asks a device's forward to keep this call uncompiled: prompts have
        arbitrary lengths, and each new T would compile new kernels (seconds of g++ on CPU,
        during which Ctrl-C is ignored). ``taps``: layer indices whose output ``(T, H)`` the
        forward fills in (what drafters reading several layers take; costs nothing unasked).
        """
        view = sequence.begin(positions.astype(mx.int32), mask, tree, taps=taps or ())
        hidden = self.run(tokens, view, compiled)
        if taps is not None:
            taps.update(view.hidden)
        return hidden

    def segment(self, segment: Segment, *, compiled: bool = True) -> mx.array:
        """:meth:`__call__` over one sequence's :class:`~redrafter_mlx.core.decode.joint.Segment`
        (its taps filled in) -> its final-norm hidden ``(T, H)``."""
        s = segment
        return self(
            s.tokens, s.positions, s.mask, s.sequence, compiled=compiled, tree=s.tree, taps=s.taps
        )

    def run(self, tokens: mx.array, view: View, compiled: bool) -> mx.array:
        """The forward itself, through ``view`` (what a device's plan replaces). The generic
        forward runs eagerly whatever ``compiled`` says: its shapes vary per call."""
        del compiled
        return self._layers(tokens, self._caches(view, TreeLayerCache, StateSlot), view)

    def joint(self, segments: list[Segment], *, compiled: bool = True) -> list[mx.array]:
        """One forward over several sequences' new tokens (:mod:`~redrafter_mlx.core.decode.joint`)
        -> each segment's final-norm hidden ``(T_i, H)``; each sequence's K/V (and taps)
        written as its own forward would."""
        if len(segments) == 1:
            return [self.segment(segments[0], compiled=compiled)]
        joint = JointView(segments)
        hidden = self.run_joint(mx.concatenate([s.tokens for s in segments]), joint, compiled)
        joint.finish()
        return joint.split(hidden)

    def run_joint(self, tokens: mx.array, joint: JointView, compiled: bool) -> mx.array:
        """The joint forward itself -> hidden ``(N, H)`` (what a device's plan replaces): the
        model's own modules over :class:`~redrafter_mlx.core.decode.joint.JointLayerCache`."""
        del compiled
        return self._layers(tokens, self._caches(joint, JointLayerCache, JointStateSlot), joint)

    def _caches(self, view, attention, recurrent) -> list:
        """Each layer's cache over ``view``: ``attention(view, index, window)`` for an
        attention layer, ``recurrent(view, index, size)`` for a recurrent one (a list of
        both for a layer with several)."""

        def layer_cache(slot):
            if isinstance(slot, list):
                return CacheList(*(layer_cache(s) for s in slot))
            if isinstance(slot, RecurrentSlot):
                return recurrent(view, slot.index, slot.size)
            return attention(view, slot.index, slot.window)

        return [layer_cache(slot) for slot in self.layout]

    def _layers(self, tokens: mx.array, caches: list, view) -> mx.array:
        """The model's layers over ``tokens (T,)`` with each layer's cache, its taps recorded
        into ``view`` -> final-norm hidden ``(T, H)``."""
        self._add_taps(view.taps)
        self._view = view
        try:
            return inner_model(self.model)(tokens[None], cache=caches)[0]
        finally:
            self._view = None

    def _add_taps(self, taps: frozenset[int]) -> None:
        """Wrap the layers in ``taps`` (once each) so their outputs reach the running view."""
        layers = inner_model(self.model).layers
        for i in taps:
            if not isinstance(layers[i], Tap):
                layers[i] = Tap(layers[i], i, self._record)

    def _record(self, layer: int, hidden: mx.array) -> None:
        if self._view is not None:
            self._view.record(layer, hidden)

    def lm_head(self, hidden: mx.array) -> mx.array:
        """:func:`lm_head` of this forward's model."""
        return lm_head(self.model, hidden)


def forward(model: nn.Module, tokens, positions, mask, sequence: Sequence) -> mx.array:
    """One generic :class:`Forward` call (builds the forward each time: for one-off uses)."""
    return Forward(model)(tokens, positions, mask, sequence)


def dispatched_layers(count: int, every: int) -> list[int]:
    """The layers of ``count`` whose output goes to the device as soon as it is built: the
    first (the device waits for no more than one layer's graph building) and every
    ``every``-th after it, but the last (the forward's caller hands it over)."""
    return sorted({0, *range(every - 1, count - 1, every)} - {count - 1})


class Wrapped(nn.Module):
    """A layer with something added around its call; every other attribute is the layer's."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.inner = layer

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.get("inner")  # absent while __init__ sets it
            if inner is None:
                raise
            return getattr(inner, name)


class Tap(Wrapped):
    """A layer whose output ``(1, T, H)`` is also handed to ``record(index, output)`` (of a
    layer returning more, its hidden states: Gemma 4's return ``(h, kvs, offset)``)."""

    def __init__(self, layer: nn.Module, index: int, record):
        super().__init__(layer)
        self._tap = (index, record)

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        index, record = self._tap
        record(index, out[0] if isinstance(out, tuple) else out)
        return out


class Dispatched(Wrapped):
    """A layer whose output is handed to the device as soon as its graph is built
    (``mx.async_eval``): the layers before it compute while the next ones are built."""

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        mx.async_eval(out)
        return out


class TokenRope(nn.Module):
    """A layer's RoPE module that rotates each token at its own position.

    mlx-lm's attention calls ``self.rope(x, offset=cache.offset)`` with ``x (1, heads, T, D)``;
    a :class:`TreeLayerCache`'s offset is the tokens' positions ``(T,)``. MLX's RoPE takes one
    offset per batch row, so the tokens go to the batch axis and back. Any other call (an int
    offset, mlx-lm's own caches) passes through unchanged.
    """

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.inner = rope

    def __call__(self, x: mx.array, offset=0, **kwargs) -> mx.array:
        per_token = (
            isinstance(offset, mx.array)
            and offset.ndim == 1
            and x.ndim == 4
            and x.shape[0] == 1
            and offset.shape[0] == x.shape[2] > 1
        )
        if not per_token:
            return self.inner(x, offset=offset, **kwargs)
        return self.inner(x.swapaxes(0, 2), offset=offset, **kwargs).swapaxes(0, 2)


ROPE_NAMES = ("rope", "rotary_emb")


def _with_token_rope(model: nn.Module) -> nn.Module:
    """``model`` (a copy) with every attention's RoPE wrapped in :class:`TokenRope`."""
    for _, module in inner_model(model).named_modules():
        for name in ROPE_NAMES:
            rope = module.get(name)
            if isinstance(rope, nn.Module) and not isinstance(rope, TokenRope):
                module[name] = TokenRope(rope)
    return model


class TreeLayerCache:
    """One layer's cache as mlx-lm's attention modules use it, over a forward's
    :class:`~redrafter_mlx.core.decode.sequence.View`.

    ``offset`` is the positions ``(T,)`` (for :class:`TokenRope`), ``update_and_fetch`` writes
    the layer's new K/V ``(1, K, T, D)`` and returns ``(1, K, S + T, D)``, ``make_mask`` returns
    the forward's mask ``(T, S + T)``, narrowed by position on sliding-window layers (a key
    ``k`` is seen from ``q`` when ``pos(q) - pos(k) < window``, or among the first ``keep``).
    Cached tokens sit at positions ``0 .. S - 1``.
    """

    def __init__(self, view: View, layer: int, window=None):
        self.view, self.layer = view, layer
        self.offset = view.positions
        self.mask, self.window = view.mask, window

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.view.write(self.layer, keys, values)

    @property
    def keys(self) -> mx.array | None:
        """The layer's key buffer: a pipeline stage of mlx-lm ties its send to the last layer's
        (``cache[-1].keys = mx.depends(cache[-1].keys, h)``), so the cache runs the send."""
        return self.view.keys(self.layer)

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self.view.tie_keys(self.layer, value)

    def make_mask(
        self, n: int, *, window_size: int | None = None, return_array: bool = False, **_
    ) -> mx.array | str | None:
        size, keep = (window_size, 0) if window_size else (self.window or (None, 0))
        mask, s = self.mask, self.view.offset
        if isinstance(mask, str) and (size is not None or return_array):
            mask = chain_mask(s, n)  # the model (or the window) needs it as an array
        if size is None:
            return mask
        key_positions = mx.concatenate([mx.arange(s, dtype=mx.int32), self.offset])
        seen = self.offset[:, None] - key_positions[None] < size
        if keep:
            seen = seen | (mx.arange(s + n) < keep)[None]
        return seen if mask is None else seen & mask


def head_linear(model: nn.Module, hidden: mx.array) -> mx.array:
    """Final-norm hidden (..., H) -> the output projection (..., V), before any logit
    transform (the LM head's own matrix, or the tied embedding's)."""
    for owner in (model, getattr(model, "language_model", None)):  # Qwen3.5 nests its head
        if hasattr(owner, "lm_head"):
            return owner.lm_head(hidden)
    return embedding(model).as_linear(hidden)


def lm_head(model: nn.Module, hidden: mx.array) -> mx.array:
    """Final-norm hidden (..., H) -> logits (..., V), as the model's own ``__call__`` ends:
    the output projection, then soft-capping (Gemma 2), a logit scale (Granite) or a tied
    head's multiplier (Falcon-H1) where the model has one."""
    logits = head_linear(model, hidden)
    args = getattr(model, "args", None)
    cap = getattr(args, "final_logit_softcapping", None)
    if cap:
        logits = mx.tanh(logits / cap) * cap
    scale = getattr(args, "logits_scaling", None)  # granite
    if scale:
        logits = logits / scale
    multiplier = getattr(args, "lm_head_multiplier", None)  # falcon_h1, tied heads only
    if multiplier is not None and getattr(args, "tie_word_embeddings", False):
        logits = logits * (multiplier / args.embedding_multiplier)
    return logits


def chain_mask(cached: int, new: int) -> mx.array:
    """Causal mask (new, cached + new) for a chain of ``new`` tokens after ``cached`` tokens."""
    rows = mx.arange(new)[:, None] + cached
    return mx.arange(cached + new)[None] <= rows
