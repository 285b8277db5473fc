"""The tree-attention kernel alone: 30 calls (a forward's layers; 9 query heads over 3 K/V heads,
D 64) after S keys at T = 1, 3, 4 and 8, interleaved, medians of 20 rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/lab/kernels/tree_attention_micro.py 8000 1

The second argument 1 gives each call its own K/V (read from memory, as a forward's layers
are), 0 one K/V for all 30 (cache-resident: the kernel's arithmetic alone).
"""

import statistics
import sys
import time

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()  # before MLX loads

import mlx.core as mx  # noqa: E402

from redrafter_mlx.backend.cpu.kernels import cpu_kernels  # noqa: E402

LAYERS, HEADS, KV_HEADS, D = 30, 9, 3, 64
SIZES = (1, 3, 4, 8)


def calls(context: int, size: int, distinct: bool):
    """30 (queries, keys, values) and the tree's visibility."""
    n = LAYERS if distinct else 1
    made = [
        (
            mx.random.normal((1, HEADS, size, D)),
            mx.random.normal((1, KV_HEADS, context + size, D)),
            mx.random.normal((1, KV_HEADS, context + size, D)),
        )
        for _ in range(n)
    ]
    mx.eval(made)
    visible = mx.tril(mx.ones((size, size), mx.bool_)) if size > 1 else None
    return [made[i % n] for i in range(LAYERS)], visible


def seconds(kernels, work) -> float:
    layers, visible = work
    tic = time.perf_counter()
    mx.eval([kernels.tree_attention(q, k, v, 0.125, visible) for q, k, v in layers])
    return time.perf_counter() - tic


def main() -> None:
    context, distinct = int(sys.argv[1]), sys.argv[2] == "1"
    kernels = cpu_kernels()
    work = {size: calls(context, size, distinct) for size in SIZES}
    times = {size: [] for size in SIZES}
    for _ in range(20):
        for size in SIZES:
            times[size].append(seconds(kernels, work[size]))
    cells = []
    for size in SIZES:
        median = statistics.median(times[size])
        key_rows = HEADS * size * (context + size) * LAYERS
        cells.append(f"T={size} {1000 * median:.2f} ms ({1e9 * median / key_rows:.2f} ns/key-row)")
    print(f"S={context} distinct={distinct}:", ", ".join(cells))


if __name__ == "__main__":
    main()
