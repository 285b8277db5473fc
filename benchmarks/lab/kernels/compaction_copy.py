"""What compacting a tree's accepted path costs after 30 layers' 3-node forward writes and
attends (run 126): gathered from the buffer itself (as before), from the forward's own new
K/V (as now), or not at all, after S = 512 and 8,000 cached keys; medians of 12, ms.

    PYTHONPATH=. .venv/bin/python benchmarks/lab/kernels/compaction_copy.py
"""

import statistics
import time

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()  # before MLX loads

import mlx.core as mx  # noqa: E402

from redrafter_mlx.backend.cpu.kernels import cpu_kernels  # noqa: E402

LAYERS = 30


def step(kernels, keys, values, context: int, mode: str) -> float:
    """One forward's writes and attention, then the path's move (``mode``), evaluated."""
    visible = mx.tril(mx.ones((3, 3), mx.bool_))
    tic = time.perf_counter()
    outs, new = [], []
    for i in range(LAYERS):
        k, v = mx.random.normal((1, 3, 3, 64)), mx.random.normal((1, 3, 3, 64))
        keys[i][..., context : context + 3, :] = k
        values[i][..., context : context + 3, :] = v
        q = mx.random.normal((1, 9, 3, 64))
        end = context + 3
        outs.append(
            kernels.tree_attention(
                q, keys[i][..., :end, :], values[i][..., :end, :], 0.125, visible
            )
        )
        new.append((k, v))
    path = (mx.sum(mx.stack(outs)) > 1e9).astype(mx.int32) + mx.array([0, 2])  # after the forward
    for i in range(LAYERS):
        if mode == "from the buffer":
            keys[i][..., context : context + 2, :] = mx.take(keys[i], context + path, axis=2)
            values[i][..., context : context + 2, :] = mx.take(values[i], context + path, axis=2)
        elif mode == "from the new K/V":
            keys[i][..., context : context + 2, :] = mx.take(new[i][0], path, axis=2)
            values[i][..., context : context + 2, :] = mx.take(new[i][1], path, axis=2)
    del outs, new
    mx.eval(keys, values, path)
    return time.perf_counter() - tic


def main() -> None:
    kernels = cpu_kernels()
    modes = ("none", "from the buffer", "from the new K/V")
    for context in (512, 8000):
        keys = [mx.random.normal((1, 3, context + 256, 64)) for _ in range(LAYERS)]
        values = [mx.random.normal((1, 3, context + 256, 64)) for _ in range(LAYERS)]
        mx.eval(keys, values)
        times = {mode: [] for mode in modes}
        for _ in range(12):
            for mode in modes:
                times[mode].append(step(kernels, keys, values, context, mode))
        cells = [f"{mode} {1000 * statistics.median(times[mode]):.1f} ms" for mode in modes]
        print(f"S={context}:", ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
