"""One drafter being trained: its optimizer and learning-rate schedule, a training step, and
the held-out agreement it is judged by.

Legend: N cached tokens, H target hidden size, V target vocab, K draft vocab, P future
positions, B batch rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from redrafter_mlx.core.decode.accept import log_softmax
from redrafter_mlx.core.decode.llm import embedding, target_dims
from redrafter_mlx.core.drafters.redrafter import lm_head_rows
from redrafter_mlx.core.errors import TrainError
from redrafter_mlx.training.drafter_init import initial_drafter
from redrafter_mlx.training.examples import Examples
from redrafter_mlx.training.loss import loss_fn, unrolled_logits
from redrafter_mlx.training.options import TrainOptions
from redrafter_mlx.training.ranks import ONE, Ranks


class WarmupCosine:
    """Learning rate at optimizer step ``step``: linear warm-up from 1 % of ``peak`` over
    ``WARMUP`` steps, then cosine decay to 5 % of it at step ``total``. ``total`` is a plain
    attribute: ``--max-minutes`` shortens it to what the measured step rate fits."""

    WARMUP = 100

    def __init__(self, peak: float, total: int):
        self.peak, self.total = peak, max(total, 1)

    def __call__(self, step):
        step = step.astype(mx.float32)
        warm = self.peak * (0.01 + 0.99 * mx.minimum(step / self.WARMUP, 1.0))
        span = max(self.total - self.WARMUP, 1)
        frac = mx.clip((step - self.WARMUP) / span, 0.0, 1.0)
        cosine = self.peak * (0.05 + 0.95 * 0.5 * (1 + mx.cos(math.pi * frac)))
        return mx.where(step < self.WARMUP, warm, cosine)


@dataclass
class Trainer:
    """Everything a training step needs: target pieces, drafter, vocab map, optimizer."""

    model: object
    drafter: object
    lookup: np.ndarray  # (V,) target id -> draft index, -1 when outside the draft vocab
    rows: mx.array | None  # (K, H) target LM-head rows (soft targets), or None
    optimizer: object
    schedule: WarmupCosine
    soft_weight: float = 0.0
    hidden_weight: float = 0.0
    own_drafts: float = 0.0  # share of rows trained on the drafter's own drafts (own_inputs)
    comm_seconds: float = 0.0  # averaging gradients over ranks (waiting for the slowest too)

    def tensors(self, ex: Examples, rows: np.ndarray, *, own: bool = False):
        """Numpy batch -> MLX ``(context (B, H) (a layered drafter's (B, n H + H): tapped
        features, then the final hidden), embeds (B, P, H), labels (B, P), weights (B, P),
        soft (B, P, K) | None, next_hidden (B, P, H) | None, batch)``; ``own``: inputs mixed
        with the drafter's own drafts (:meth:`own_inputs`)."""
        b = ex.batch(rows)
        draft = self.lookup[b["targets"]]
        weights = b["valid"] & (draft >= 0)  # out-of-vocab targets cannot be predicted
        context = mx.array(b["context"]).astype(mx.float32)
        if self.drafter.taps:
            if "taps" not in b:
                raise TrainError(
                    f"the drafter reads target layers {list(self.drafter.taps)}, but the "
                    "cache's records keep no tapped layers (extract with --context-layers)"
                )
            context = mx.concatenate([mx.array(b["taps"]).astype(mx.float32), context], axis=1)
        inputs = self.own_inputs(rows, context, b["inputs"]) if own else b["inputs"]
        embeds = embedding(self.model)(mx.array(inputs)).astype(mx.float32)
        soft = nxt = None
        if self.soft_weight > 0 or self.hidden_weight > 0:
            nxt = mx.array(ex.data["hidden"][b["idx"]]).astype(mx.float32)
        if self.soft_weight > 0 and self.rows is not None:
            logits = nxt @ self.rows.T
            soft = log_softmax(logits)
        if self.drafter.args.head != "target":  # only a target-head drafter predicts hiddens
            nxt = None
        labels = mx.array(np.maximum(draft, 0).astype(np.int32))
        return context, embeds, labels, mx.array(weights.astype(np.float32)), soft, nxt, b

    def own_inputs(self, rows: np.ndarray, context: mx.array, inputs: np.ndarray) -> np.ndarray:
        """Training-time test: for the ``own_drafts`` share of ``rows (B,)`` (chosen per row
        and step, so any split of a batch over ranks chooses the same), the inputs after the
        first ``(B, P)`` become the drafter's own greedy drafts at the previous position (as
        beam search feeds them), teacher forcing elsewhere; the labels stay the target's."""
        salt = int(self.optimizer.step.item()) if hasattr(self.optimizer, "step") else 0
        hashed = (rows.astype(np.uint64) * 2654435761 + salt * 40503) % 2**32
        chosen = hashed / 2**32 < self.own_drafts
        if not chosen.any() or inputs.shape[1] < 2:
            return inputs
        embeds = embedding(self.model)(mx.array(inputs)).astype(mx.float32)
        logits = unrolled_logits(self.drafter, context, embeds)
        drafts = np.array(self.drafter.draft_ids(mx.argmax(logits, axis=-1)))  # (B, P)
        mixed = inputs.copy()
        mixed[chosen, 1:] = drafts[chosen, :-1]
        return mixed

    def step(self, ex: Examples, rows: np.ndarray, ranks: Ranks = ONE) -> float:
        """One optimizer step on the examples at ``rows (B,)``; the batch's loss. On several
        ``ranks`` each takes its slice of the rows and the gradients are averaged: each
        slice's loss is divided by the whole batch's weight over N, so the mean over ranks
        is the loss (and the gradient) of the whole batch."""
        count = None
        if ranks.size > 1:
            count = max(self.weight(ex, rows), 1) / ranks.size
            rows = ranks.mine(rows)
        *inputs, _ = self.tensors(ex, rows, own=self.own_drafts > 0)
        grad_fn = nn.value_and_grad(self.drafter, loss_fn)
        loss, grads = grad_fn(self.drafter, *inputs, self.soft_weight, self.hidden_weight, count)
        if ranks.size > 1:
            loss, grads = self._average(loss, grads, ranks)
        self.optimizer.update(self.drafter, grads)
        mx.eval(loss, self.drafter.parameters(), self.optimizer.state)
        return loss.item()

    def weight(self, ex: Examples, rows: np.ndarray) -> int:
        """How many predictions of the examples at ``rows (B,)`` the loss counts."""
        targets = ex.data["argmax"][ex.future(rows)]
        return int((ex.valid[rows] & (self.lookup[targets] >= 0)).sum())

    def _average(self, loss: mx.array, grads, ranks: Ranks):
        """``(loss, gradients)`` averaged over the ranks, in one exchange (grouped by
        ``nn.average_gradients``); its time (waiting for the slowest rank included) is added
        to ``comm_seconds``."""
        mx.eval(loss, grads)  # this rank's slice first, so the time below is the exchange's
        start = time.perf_counter()
        mean = nn.average_gradients({"loss": loss, "grads": grads}, group=ranks.group)
        mx.eval(mean)
        self.comm_seconds += time.perf_counter() - start
        return mean["loss"], mean["grads"]

    def agreement(self, ex: Examples, limit: int = 20000, ranks: Ranks = ONE) -> dict:
        """Held-out top-1 agreement with the target per future position (out-of-vocab targets
        count as misses), and the mean count of leading agreements (teacher forced), overall
        and where all P inputs lie on the target's greedy path (as when decoding). On several
        ``ranks`` each evaluates every N-th chunk of positions and the counts are summed."""
        starts = _sample(ex.starts, limit)
        p = ex.valid.shape[1]
        tally = np.zeros(2 * p + 4, np.int64)  # hits (P), counts (P), leading sums and counts
        for i in range(ranks.rank * 1024, len(starts), ranks.size * 1024):
            tally += self._agreement_counts(ex, starts[i : i + 1024])
        tally = ranks.sum(tally)
        hits, counts = tally[:p], tally[p : 2 * p]
        lead_sum, lead_n, path_sum, path_n = (int(x) for x in tally[2 * p :])
        per = (hits / np.maximum(counts, 1)).round(4).tolist()
        return {
            "agreement": per,
            "mean_agreement": float(np.mean(per)),
            "leading": lead_sum / lead_n if lead_n else 0.0,
            "leading_on_path": path_sum / path_n if path_n else 0.0,
            "on_path": path_n,
            "positions": int(len(starts)),
        }

    def _agreement_counts(self, ex: Examples, rows: np.ndarray) -> np.ndarray:
        """``agreement``'s counts over the examples at ``rows``: hits (P), counts (P), then
        the sum and count of leading agreements, overall and on the target's greedy path."""
        context, embeds, _, _, _, _, b = self.tensors(ex, rows)
        index = mx.argmax(unrolled_logits(self.drafter, context, embeds), axis=-1)
        agree = (np.array(self.drafter.draft_ids(index)) == b["targets"]) & b["valid"]
        full = b["valid"].all(axis=1)
        # on the target's greedy path: every input is the target's own previous choice
        prev = ex.data["argmax"][b["idx"] - 1]
        path = full & (b["inputs"] == prev).all(axis=1)
        lead = np.cumprod(agree, axis=1).sum(axis=1)
        leading = [lead[full].sum(), full.sum(), lead[path].sum(), path.sum()]
        return np.concatenate([agree.sum(0), b["valid"].sum(0), leading]).astype(np.int64)


def _sample(starts: np.ndarray, limit: int) -> np.ndarray:
    """At most ``limit`` of ``starts``, in order, the same ones every evaluation (seed 0)."""
    if len(starts) <= limit:
        return starts
    return np.sort(np.random.default_rng(0).choice(starts, limit, replace=False))


def build_trainer(model, vocab: np.ndarray | None, opts: TrainOptions, total_steps: int) -> Trainer:
    """A Trainer for a drafter over draft vocabulary ``vocab (K,)`` (None: full; ignored with
    ``opts.init``, whose own vocabulary is kept) whose schedule ends at ``total_steps``."""
    drafter, vocab = initial_drafter(model, vocab, opts)
    if drafter.args.draft_vocab_size:
        drafter.freeze(keys=["draft_vocab"], strict=False)  # an id map, not a weight
    size = target_dims(model)[1]
    lookup = np.full(size, -1, np.int64)
    ids = vocab if vocab is not None else np.arange(size)
    lookup[ids] = np.arange(len(ids))
    rows = lm_head_rows(model, mx.array(ids)) if opts.soft_weight > 0 else None
    schedule = WarmupCosine(opts.lr, total_steps)
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=opts.weight_decay)
    return Trainer(
        model,
        drafter,
        lookup,
        rows,
        optimizer,
        schedule,
        opts.soft_weight,
        opts.hidden_weight,
        opts.own_drafts,
    )
