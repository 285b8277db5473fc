"""Target layers' outputs during extraction, from the same forward that gives the final hidden
state (no extra pass): what a layered drafter (``context_layers``) is trained on.

Legend: B rows, T tokens, H hidden size, n tapped layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.drafters.redrafter import tap_features


@contextmanager
def tapped(model, layers: tuple[int, ...]) -> Iterator[dict[int, list[mx.array]]]:
    """While the block runs, the outputs ``(B, T, H)`` of the target's ``layers`` are appended
    to ``got[layer]`` (one per forward); the layers are restored after it."""
    inner = llm.inner_model(model)
    got: dict[int, list[mx.array]] = {i: [] for i in layers}
    saved = {i: inner.layers[i] for i in layers}
    for i, layer in saved.items():
        inner.layers[i] = llm.Tap(layer, i, lambda j, out: got[j].append(out))
    try:
        yield got
    finally:
        for i, layer in saved.items():
            inner.layers[i] = layer


def features(got: dict[int, list[mx.array]], layers: tuple[int, ...]) -> mx.array:
    """What :func:`tapped` collected, forwards joined along T -> ``(B, T, n H)`` float16
    (:func:`~redrafter_mlx.core.drafters.redrafter.tap_features`, as decoding computes them)."""
    outputs = [mx.concatenate(got[i], axis=1) for i in layers]
    return tap_features(outputs).astype(mx.float16)
