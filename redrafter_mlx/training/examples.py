"""Training examples over a cached token stream, and the draft vocabulary chosen from it.

Legend: N tokens of the stream, H target hidden size, P future positions, B batch rows,
M example positions.

At position t the drafter gets ``h_t`` and, for future step i = 1..P, the tokens
``x_{t+1..t+i}`` (teacher forcing; ``x_{t+1}`` plays ``pending``) and is trained against the
target's prediction for token ``t+i+1`` (the stored argmax at ``t+i``). Only predictions of
assistant tokens of the same conversation count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Examples:
    """Training examples over one split's token stream.

    ``starts (M,)`` are positions t with at least one valid future step; ``valid (N, P)`` says
    whether step i + 1 at position t predicts an assistant token of the same conversation.
    """

    data: dict[str, np.ndarray]
    valid: np.ndarray
    starts: np.ndarray

    @classmethod
    def build(cls, data: dict[str, np.ndarray], positions: int) -> Examples:
        n = data["tokens"].shape[0]
        doc, mask = data["doc"], data["mask"]
        valid = np.zeros((n, positions), bool)
        for i in range(1, positions + 1):
            j = np.arange(n) + i + 1
            ok = j < n
            jj = np.minimum(j, n - 1)
            valid[:, i - 1] = ok & (doc[jj] == doc) & mask[jj]
        return cls(data, valid, np.nonzero(valid.any(axis=1))[0])

    def batch(self, t: np.ndarray) -> dict[str, np.ndarray]:
        """Rows ``t (B,)`` -> context (B, H) (and ``taps (B, n H)`` when the stream has them),
        inputs / targets / valid (B, P), and ``idx`` (B, P): the rows ``t + i`` whose target
        hidden made each target prediction (the caller gathers those hidden states where it
        needs them)."""
        idx = self.future(t)
        batch = {
            "context": self.data["hidden"][t],
            "inputs": self.data["tokens"][idx],
            "targets": self.data["argmax"][idx],
            "valid": self.valid[t],
            "idx": idx,
        }
        if "taps" in self.data:  # a layered drafter's features of the context row (B, n H)
            batch["taps"] = self.data["taps"][t]
        return batch

    def future(self, t: np.ndarray) -> np.ndarray:
        """``(B, P)``: the rows ``t + i``, i = 1..P, of rows ``t (B,)`` (the stream's last row
        past its end; ``valid`` is False there)."""
        n, p = self.data["tokens"].shape[0], self.valid.shape[1]
        return np.minimum(t[:, None] + np.arange(1, p + 1)[None], n - 1)


def frequent_tokens(data: dict[str, np.ndarray], k: int) -> np.ndarray:
    """The ``k`` target-predicted tokens most frequent at assistant positions, by frequency:
    ``(K,)`` with K <= k (fewer when the target predicts fewer distinct tokens there)."""
    n = data["tokens"].shape[0]
    nxt = np.minimum(np.arange(n) + 1, n - 1)
    use = data["mask"][nxt] & (data["doc"][nxt] == data["doc"])
    counts = np.bincount(data["argmax"][use], minlength=1)
    order = np.argsort(-counts, kind="stable")[:k]
    return order[counts[order] > 0].astype(np.int32)
