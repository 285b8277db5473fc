"""Why long contexts cost: MLX's CPU ``exp`` runs ~10 ns per element here (NumPy's ~0.4), and
attention's softmax takes one exp per (query, head, cached token, layer). A prototype of the
lever: exp as a Cody-Waite range reduction + degree-6 polynomial in plain MLX arithmetic, fused
by ``mx.compile`` into one vectorisable CPU kernel. Prints microseconds per call on one
attention layer's scores for 6 tree nodes x 9 heads over 1,106 keys, and the max relative error.

    LD_PRELOAD="$(ls ~/.cache/redrafter-mlx/blas/smallrows-*.so) \\
        /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0" \\
        .venv/bin/python benchmarks/exp_cost.py
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

LOG2E = 1.4426950408889634
# 2^f on [0, 1): Taylor coefficients of exp(f ln 2)
COEFFS = (1.0, 0.6931471805599453, 0.24022650695910071, 0.05550410866482158,
          0.009618129107628477, 0.0013333558146428443, 0.00015403530393381606)  # fmt: skip


def poly_exp(x: mx.array) -> mx.array:
    """exp(x) for float32 ``x`` (inputs below ~-87 flush to 2^-126)."""
    y = mx.maximum(x * LOG2E, -126.0)
    n = mx.floor(y)
    f = y - n
    p = mx.full(f.shape, COEFFS[-1], f.dtype)
    for c in reversed(COEFFS[:-1]):
        p = p * f + c
    return p * mx.left_shift(n.astype(mx.int32) + 127, 23).view(mx.float32)


def median_us(fn, n: int = 200) -> float:
    for _ in range(5):
        mx.eval(fn())
    times = []
    for _ in range(n):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return sorted(times)[n // 2] * 1e6


def main() -> None:
    scores = mx.random.normal((6 * 9, 1106), key=mx.random.key(0)) * 4 - 8
    mx.eval(scores)
    fused = mx.compile(poly_exp)
    reference, approx = np.array(mx.exp(scores)), np.array(fused(scores))
    xn = np.array(scores)
    tic = time.perf_counter()
    for _ in range(100):
        np.exp(xn)
    numpy_us = (time.perf_counter() - tic) / 100 * 1e6
    print(f"elements {scores.size}")
    print(f"mx.exp {median_us(lambda: mx.exp(scores)):.0f} us")
    print(f"mx.softmax {median_us(lambda: mx.softmax(scores, axis=-1, precise=True)):.0f} us")
    print(f"compiled polynomial exp {median_us(lambda: fused(scores)):.0f} us")
    print(f"numpy exp {numpy_us:.0f} us")
    print(f"max relative error {float(np.max(np.abs(approx - reference) / reference)):.1e}")


if __name__ == "__main__":
    main()
