"""The teacher-forced drafter and the loss it is trained with.

Legend: B batch rows, P future positions, H target hidden size, D the drafter's last-layer
width (H for ``head == "target"``), K draft vocab.
"""

from __future__ import annotations

import mlx.core as mx

from redrafter_mlx.core.decode.accept import log_softmax


def unrolled_features(drafter, context: mx.array, embeds: mx.array) -> mx.array:
    """Teacher-forced drafter: ``context (B, H)`` (a layered drafter's: ``(B, n H + H)``, its
    tapped features then the final hidden, fused here), input embeddings ``(B, P, H)`` -> the
    last layer's output ``(B, P, D)`` (``Drafter.features``); the RNN runs over the P inputs
    and the head is one batched call."""
    b, p, h = embeds.shape
    if drafter.taps:
        context = drafter.fuse(context[:, -h:], context[:, :-h])
    state, states = mx.zeros((b, h), embeds.dtype), []
    for i in range(p):
        state = drafter.rnn_step(state, embeds[:, i])
        states.append(state)
    states = mx.stack(states, axis=1).reshape(b * p, h)
    ctx = mx.broadcast_to(context[:, None], (b, p, h)).reshape(b * p, h)
    return drafter.features(ctx, states).reshape(b, p, -1)


def unrolled_logits(drafter, context: mx.array, embeds: mx.array) -> mx.array:
    """Teacher-forced draft logits ``(B, P, K)``."""
    return drafter.score(unrolled_features(drafter, context, embeds))


def loss_fn(
    drafter,
    context: mx.array,
    embeds: mx.array,
    labels: mx.array,
    weights: mx.array,
    soft: mx.array | None,
    next_hidden: mx.array | None,
    soft_weight: float = 0.0,
    hidden_weight: float = 0.0,
    count: float | None = None,
) -> mx.array:
    """Mean loss over weighted steps: cross-entropy to the target's argmax ``labels (B, P)``
    (draft-vocab indices; ``weights (B, P)`` 0/1), optionally mixed (``soft_weight``) with
    cross-entropy to the target's distribution over the draft vocab ``soft (B, P, K)``
    (log-probs), plus, for ``head == "target"``, ``hidden_weight`` times a Huber regression of
    the predicted hidden state onto the target's own ``next_hidden (B, P, H)`` (feature
    distillation, as in EAGLE). ``count``: what the weighted sum is divided by instead of
    this batch's weight (a rank's slice of a batch: the whole batch's weight over the ranks,
    so the ranks' mean loss is the whole batch's)."""
    features = unrolled_features(drafter, context, embeds)
    logits = drafter.score(features).astype(mx.float32)
    logp = log_softmax(logits)
    loss = -mx.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    if soft is not None and soft_weight > 0:
        loss = (1 - soft_weight) * loss - soft_weight * (mx.exp(soft) * logp).sum(-1)
    if next_hidden is not None and hidden_weight > 0:
        err = mx.abs(features - next_hidden)
        huber = mx.where(err < 1, 0.5 * err * err, err - 0.5).mean(axis=-1)
        loss = loss + hidden_weight * huber
    if count is None:
        count = mx.maximum(weights.sum(), 1)
    return (loss * weights).sum() / count
