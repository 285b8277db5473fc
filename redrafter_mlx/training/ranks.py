"""The processes one distillation runs on: ``mx.distributed``'s group as ``mlx.launch`` starts
it (rank r of N, on one machine or several), and the few collectives the phases need.

Legend: N ranks, B rows of a global batch.

A single process is ``ONE`` (N = 1): every collective returns its input unchanged, so the
phases call them without asking how many ranks there are. Every rank runs the same steps in
the same order (the collectives must match); rank 0 (the *lead*) alone writes the manifest,
the checkpoints and the log and shows progress.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from redrafter_mlx.core.errors import TrainError


class PeerFailed(TrainError):
    """Another rank failed at a point where all ranks meet; it says why itself."""


@dataclass(frozen=True)
class Ranks:
    """The ranks of a run: ``group`` from ``mx.distributed.init()``, None for one process."""

    group: mx.distributed.Group | None = None

    @classmethod
    def launched(cls) -> Ranks:
        """The ranks this process was launched with (``mlx.launch``, ``mpirun``); ``ONE``
        when it was started alone."""
        group = mx.distributed.init()
        return cls(group) if group.size() > 1 else ONE

    @property
    def rank(self) -> int:
        return self.group.rank() if self.group else 0

    @property
    def size(self) -> int:
        return self.group.size() if self.group else 1

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def mine(self, rows: np.ndarray) -> np.ndarray:
        """This rank's equal, contiguous slice of a global batch ``rows (B,)`` (B divisible
        by N: ``check_split``)."""
        share = len(rows) // self.size
        return rows[self.rank * share : (self.rank + 1) * share]

    def sum(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum over ranks of a small host array (integers or float64: exact)."""
        if self.group is None:
            return values
        with mx.stream(mx.cpu):  # float64 and int64 are CPU types on every backend
            return np.array(mx.distributed.all_sum(mx.array(values), group=self.group))

    def gather(self, values: np.ndarray) -> np.ndarray:
        """Every rank's ``values`` (the same shape on each), stacked by rank: ``(N, ...)``."""
        if self.group is None:
            return values[None]
        with mx.stream(mx.cpu):
            stacked = mx.distributed.all_gather(mx.array(values)[None], group=self.group)
            return np.array(stacked)

    def share(self, values: np.ndarray) -> np.ndarray:
        """Rank 0's ``values`` on every rank (the same shape and dtype on each)."""
        return self.sum(values if self.lead else np.zeros_like(values))

    def lead_says(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (a decision all must take alike)."""
        return bool(self.share(np.array([flag], np.int64))[0])

    def share_json(self, value):
        """Rank 0's JSON value (a loop state) on every rank."""
        if self.group is None:
            return value
        data = np.frombuffer(json.dumps(value).encode(), np.uint8) if self.lead else None
        size = int(self.share(np.array([0 if data is None else len(data)], np.int64))[0])
        return json.loads(self.share(data if self.lead else np.zeros(size, np.uint8)).tobytes())

    def share_tree(self, tree):
        """Rank 0's arrays (parameters, optimizer state: the same structure on each rank) on
        every rank."""
        if self.group is None:
            return tree
        flat = sorted(tree_flatten(tree), key=lambda kv: kv[0])  # a loaded state's order differs
        shared = [
            (k, mx.distributed.all_sum(v if self.lead else mx.zeros_like(v), group=self.group))
            for k, v in flat
        ]
        mx.eval([v for _, v in shared])
        return tree_unflatten(shared)

    def check(self, error: TrainError | None) -> None:
        """A point where all ranks meet: raise ``error`` on the rank that has one, and
        ``PeerFailed`` on the others when any rank has one (so none waits for the failed)."""
        failed = int(self.sum(np.array([error is not None], np.int64))[0])
        if error is not None:
            raise error
        if failed:
            raise PeerFailed("another rank failed")

    def check_same(self, data: bytes, what: str) -> None:
        """Every rank must hold the same ``data`` (the training tokens) as rank 0; the others
        fail naming ``what``."""
        digest = np.frombuffer(hashlib.sha256(data).digest(), np.uint8)
        same = np.array_equal(self.share(digest), digest)
        self.check(None if same else TrainError(f"{what}: not the same as rank 0's"))

    def check_shared(self, folder: Path, flag: str) -> None:
        """Every rank must see the folder rank 0 writes (one machine, or a folder shared
        between the machines at the same path): rank 0 leaves a mark there that the others
        look for."""
        if self.group is None:
            return
        nonce = int(self.share(np.array([secrets.randbits(62) if self.lead else 0]))[0])
        mark = folder / f".rank0-{nonce}"
        if self.lead:
            mark.write_text("")
        self.sum(np.zeros(1, np.int64))  # written before the others look
        seen = mark.exists()
        self.sum(np.zeros(1, np.int64))  # looked before it goes
        if self.lead:
            mark.unlink()
        error = None
        if not seen:
            error = TrainError(
                f"{flag} {folder} is not the folder rank 0 writes: every rank needs the "
                "same folder (ranks on one machine, or a folder shared between the machines "
                "at the same path)"
            )
        self.check(error)


ONE = Ranks()


def check_split(batch_size: int, ranks: Ranks) -> None:
    """Each rank takes an equal slice of every batch: ``batch_size`` must divide by N."""
    if batch_size % ranks.size:
        raise TrainError(
            f"--batch-size {batch_size} does not split over {ranks.size} ranks: use a "
            f"multiple of {ranks.size}"
        )
