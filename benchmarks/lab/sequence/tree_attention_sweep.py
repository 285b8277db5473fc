"""Run 111, first part: 30 layers' attention of a T-node chain after S cached keys (the embedded
model's heads: 9 query, 3 K/V, head dim 64; random float32), ``split_attention`` against one
grouped ``softmax_attention``, interleaved, medians in ms.

    PYTHONPATH=. .venv/bin/python benchmarks/lab/sequence/tree_attention_sweep.py \\
        64,256,512,1024,1536,2048,3000 2,3,4,8 7
"""

import statistics
import sys
import time

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()

import mlx.core as mx  # noqa: E402

from redrafter_mlx.backend.cpu import fused  # noqa: E402
from redrafter_mlx.core.decode.llm import chain_mask  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def seconds(attention, t: int, s: int, layers: int = 30) -> float:
    q = mx.random.normal((1, HEADS, t, HEAD_DIM))
    k, v = (mx.random.normal((1, KV_HEADS, s + t, HEAD_DIM)) for _ in range(2))
    mask = chain_mask(s, t)
    mx.eval(q, k, v, mask)
    start = time.perf_counter()
    x = q
    for i in range(layers):
        x = attention(x, k, v, 0.125, mask) + q
        if i % 2:
            mx.async_eval(x)
    mx.eval(x)
    return time.perf_counter() - start


def main() -> None:
    versions = {"split": fused.split_attention, "softmax": fused.softmax_attention}
    rounds = int(sys.argv[3])
    for s in (int(x) for x in sys.argv[1].split(",")):
        for t in (int(x) for x in sys.argv[2].split(",")):
            for f in versions.values():
                seconds(f, t, s)
            times = {name: [] for name in versions}
            for r in range(rounds):
                for name, f in versions.items():
                    times[name].append(seconds(f, t, s + r % 3))
            print(s, t, {n: round(statistics.median(v) * 1e3, 2) for n, v in times.items()})


if __name__ == "__main__":
    main()
