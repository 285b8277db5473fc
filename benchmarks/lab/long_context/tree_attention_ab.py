"""Run 88's scratch A/B (issue 46, commit 7bf21d0's fused.py): 30 layers' attention of a
T-node chain after S cached tokens (9 query heads, 3 K/V heads of 64, SmolLM2-135M's), the
CPU plan's as it is ("now": products of at most 8 rows, per query head for T >= 3) against
one product per K/V head ("per-head": its whole query group, OpenBLAS) with the cached block
split off; a one-token step's (``softmax_attention``) for scale. Medians of interleaved
rounds, in ms. Not shipped: the verify forward with "per-head" measured no consistent gain
at load 14 (benchmarks/HISTORY.md, run 88).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 PYTHONPATH=. \\
        .venv/bin/python benchmarks/lab/long_context/tree_attention_ab.py 5 256,1024,8000
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from functools import partial

import mlx.core as mx
import numpy as np

from redrafter_mlx.backend.cpu import fused
from redrafter_mlx.core.decode.tree import pack_beams, tree_mask


def per_head(queries, keys, values, scale: float, mask) -> mx.array:
    """``fused.split_attention`` with one product per K/V head and the cached block always
    split off (unmasked)."""
    _, heads, t, d = queries.shape
    kv_heads, cached = keys.shape[1], keys.shape[2] - t
    grouped = (queries * (scale * fused.LOG2_E)).reshape(1, kv_heads, heads // kv_heads * t, d)
    product = partial(fused._grouped_product, rows=None)
    blocks = [(0, cached, None), (cached, None, mask[:, cached:])]
    scores = []
    for start, stop, visible in blocks:
        block = product(grouped, keys[..., start:stop, :].swapaxes(-1, -2))
        scores.append(block if visible is None else fused._masked(block, visible, -mx.inf))
    peak = functools.reduce(mx.maximum, [x.max(axis=-1, keepdims=True) for x in scores])
    total, out = 0.0, 0.0
    for (start, stop, visible), block in zip(blocks, scores, strict=True):
        probs = fused.exp2(block - peak)
        probs = probs if visible is None else fused._masked(probs, visible, 0.0)
        total = total + probs.sum(axis=-1, keepdims=True)
        out = out + product(probs, values[..., start:stop, :])
    return (out / total).reshape(1, heads, t, d)


VARIANTS = {
    "now": lambda q, k, v, m: fused.attention(q, k, v, 0.125, m, True),
    "per-head": lambda q, k, v, m: per_head(q, k, v, 0.125, m),
}


def inputs(cached: int, t: int):
    q = mx.random.normal((1, 9, t, 64))
    k, v = (mx.random.normal((1, 3, cached + t, 64)) for _ in range(2))
    mask = tree_mask(pack_beams(np.arange(t)[None]), cached) if t > 1 else None
    mx.eval(q, k, v)
    return q, k, v, mask


def main() -> None:
    reps, contexts = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")]
    for cached in contexts:
        data = {t: inputs(cached, t) for t in (1, 3, 4, 8)}
        times: dict[tuple[str, int], list[float]] = {}
        for rep in range(reps + 1):  # round 0 warms up
            for t, (q, k, v, mask) in data.items():
                one = {"T1": lambda q, k, v, m: fused.softmax_attention(q, k, v, 0.125, None)}
                for name, f in (one if t == 1 else VARIANTS).items():
                    tic = time.perf_counter()
                    mx.eval([f(q, k, v, mask) for _ in range(30)])
                    if rep:
                        times.setdefault((name, t), []).append(time.perf_counter() - tic)
        row = {f"{n} T={t}": round(1e3 * statistics.median(x), 1) for (n, t), x in times.items()}
        print(cached, row, flush=True)


if __name__ == "__main__":
    main()
