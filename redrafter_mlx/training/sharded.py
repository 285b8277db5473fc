"""Extraction on several ranks: the conversations are cut into units (a generation window of
``--source self``, a few conversations of ``--source data``), handed out in turn, unit
``k`` to rank ``k mod N``, one unit per rank per round.

Legend: N ranks, U conversations per unit (at most U records).

After each round the ranks gather what each unit holds (tokens, resumable boundaries, bytes)
and every rank walks the round's units in order as one process would walk its records: the
split stops at the first boundary where the budget is reached, or after the first unit that
fills ``--cache-max-gb``; records past that point are dropped. So the cache holds the
records a single process would have made, in the same order. Each rank writes its unit as a
shard of its own, rank 0 lists the round's shards in the manifest, in unit order; an
interrupted run loses only the round in flight, and a rerun, on any number of ranks, goes on
from the manifest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from redrafter_mlx.training.cache import Cache
from redrafter_mlx.training.ranks import Ranks

Record = dict[str, np.ndarray]
# conversations [a, b) -> their records, each (next conversation, record, resumable boundary)
Produce = Callable[[int, int], list[tuple[int, Record, bool]]]
Show = Callable[[int, str], None]  # (tokens in the split, throughput text)

TOKENS, NEXT, BOUNDARY, BYTES = range(4)  # the columns of a unit's record table


@dataclass(frozen=True)
class Span:
    """The conversations one split's extraction runs over: ``[first, end)`` in units of
    ``unit``."""

    first: int
    end: int
    unit: int


def extract_sharded(
    produce: Produce,
    cache: Cache,
    split: str,
    span: Span,
    *,
    budget: int,
    limit: float,
    ranks: Ranks,
    show: Show,
) -> None:
    """Extract ``split`` over ``span`` round by round until ``budget`` tokens or ``limit``
    bytes (``cache`` re-read under rank 0's lock by the caller)."""
    have, start, begun = cache.tokens(split), span.first, time.perf_counter()
    made = 0
    while start < span.end:
        a = start + ranks.rank * span.unit
        b = min(a + span.unit, span.end)
        records = produce(a, b) if a < span.end else []
        units = ranks.gather(_table(records, span.unit))  # (N, U, 4)
        ends = [min(start + (r + 1) * span.unit, span.end) for r in range(ranks.size)]
        keep, stop, next_conv = cut(
            units, ends, have=have, budget=budget, nbytes=cache.nbytes(), limit=limit
        )
        entries = _write(cache, split, a, records[: keep[ranks.rank]], ranks)
        cache.append(entries, split, next_conv, save=ranks.lead)
        added = int(sum(units[r, : keep[r], TOKENS].sum() for r in range(ranks.size)))
        have, made = have + added, made + added
        show(have, f"{made / (time.perf_counter() - begun):.0f} tok/s on {ranks.size} ranks")
        if stop:
            break
        start = ends[-1]
    ranks.sum(np.zeros(1, np.int64))  # rank 0's manifest is on disk before any rank goes on


def _table(records: list, unit: int) -> np.ndarray:
    """``(U, 4)`` int64: per record its tokens, next conversation, boundary flag and bytes
    (rows past the unit's records are zero)."""
    table = np.zeros((unit, 4), np.int64)
    for k, (next_conv, arrays, boundary) in enumerate(records):
        nbytes = sum(v.nbytes for v in arrays.values())
        table[k] = (len(arrays["tokens"]), next_conv, boundary, nbytes)
    return table


def cut(
    units: np.ndarray, ends: list[int], *, have: int, budget: int, nbytes: int, limit: float
) -> tuple[list[int], bool, int]:
    """Walk a round's ``units (N, U, 4)`` (unit r ends before conversation ``ends[r]``) in
    order as one process walks its records -> ``(records kept per unit, whether the split
    stops, the conversation a resumed run starts at)``. It stops at the first boundary that
    reaches ``budget`` tokens (``have`` before the round), or after the first unit whose
    (estimated) bytes bring the cache to ``limit``; a unit ends on a boundary, so every
    record of a unit walked through is kept."""
    keep = [0] * len(units)
    for r, table in enumerate(units):
        count = int((table[:, TOKENS] > 0).sum())  # a record has tokens; padding has none
        for k in range(count):
            have += int(table[k, TOKENS])
            if table[k, BOUNDARY]:
                keep[r] = k + 1
                if have >= budget:
                    return keep, True, int(table[k, NEXT])
        nbytes += int(table[:count, BYTES].sum())
        if nbytes >= limit:
            return keep, True, ends[r]
    return keep, False, ends[-1]


def _write(cache: Cache, split: str, a: int, records: list, ranks: Ranks) -> list[dict]:
    """Write this rank's kept records of the unit starting at conversation ``a`` as one
    shard; every rank's manifest entries, in unit order (all ranks learn each shard's size)."""
    entry = None
    if records:
        arrays = [
            dict(r, doc=np.full(len(r["tokens"]), k, np.int32))
            for k, (_, r, _) in enumerate(records)
        ]
        joined = {key: np.concatenate([x[key] for x in arrays]) for key in arrays[0]}
        entry = cache.write_shard(f"{split}-c{a:07d}.npz", split, joined)
    mine = np.zeros((ranks.size, 3), np.int64)
    if entry:
        mine[ranks.rank] = (a, entry["tokens"], entry["bytes"])
    every = ranks.sum(mine)  # written, on every rank, before rank 0 lists them
    return [
        {"file": f"{split}-c{a:07d}.npz", "split": split, "tokens": int(t), "bytes": int(n)}
        for a, t, n in every
        if t > 0
    ]
