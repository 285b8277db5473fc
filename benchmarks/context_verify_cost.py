"""Verify cost against context length: one target forward over a T-node tree after S cached
tokens, against a one-token forward at the same S, on the CPU plan and the generic plan.

The cache holds S zero keys/values (timing does not depend on their values), so no prefill is
needed. Interleaved rounds, medians; also the attention call alone (one layer's shapes) to
show where the S-dependent cost sits:

    PYTHONPATH=. .venv/bin/python benchmarks/context_verify_cost.py \\
        --out benchmarks/results/context_verify_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from redrafter_mlx.backend.blas import reexec_with_blas

if __name__ == "__main__":
    reexec_with_blas()  # before MLX loads: the BLAS the console script runs with

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from redrafter_mlx.backend import fused  # noqa: E402
from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN  # noqa: E402
from redrafter_mlx.core.tree import pack_beams, tree_mask  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.tuning.measure import environment  # noqa: E402


def filled_cache(verifier, context: int):
    """A cache holding ``context`` committed (zero) tokens' K/V."""
    cache = verifier.new_cache()
    cache.reserve(context + 64)
    mx.eval(verifier.forward(mx.zeros((1,), mx.int32), mx.zeros((1,), mx.int32), None, cache))
    mx.eval(cache.state())
    cache.commit([0] * context)
    return cache


def chain_tree(size: int):
    return pack_beams(np.arange(size)[None])


def forward_seconds(verifier, cache, size: int) -> float:
    tree = chain_tree(size)
    mask = tree_mask(tree, cache.offset) if size > 1 else None
    positions = mx.array(cache.offset + tree.depths)
    tic = time.perf_counter()
    hidden = verifier.forward(mx.array(tree.tokens), positions, mask, cache, tree=tree)
    mx.eval(verifier.forward.lm_head(hidden))
    return time.perf_counter() - tic


def attention_seconds(context: int, size: int, grouped: bool, reps: int = 5) -> float:
    """One layer's attention (9 query heads, 3 K/V heads, D 64) over the cache, 30 times."""
    q = mx.random.normal((1, 9, size, 64))
    k = mx.random.normal((1, 3, context + 64, 64))[..., : context + size, :]
    v = mx.random.normal((1, 3, context + 64, 64))[..., : context + size, :]
    mask = tree_mask(chain_tree(size), context) if size > 1 else None
    mx.eval(q, k, v)
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        outs = [fused.attention(q, k, v, 0.125, mask, grouped) for _ in range(30)]
        mx.eval(outs)
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="512,2048,4096,8000")
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--plans", default="cpu,generic")
    p.add_argument("--out")
    args = p.parse_args()
    contexts = [int(s) for s in args.contexts.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    plans = {"cpu": CPU_PLAN, "generic": GENERIC_PLAN}
    report = {"forward_ms": {}, "attention_ms": {}}
    for name in args.plans.split(","):
        runtime = rt.load_runtime(None, None, need_drafter=False, plan=plans[name])
        verifier = runtime.verifier
        report["environment"] = environment(runtime)
        for context in contexts:
            cache = filled_cache(verifier, context)
            for size in sizes:  # warm-up (traces each size once)
                forward_seconds(verifier, cache, size)
            times = {size: [] for size in sizes}
            for _ in range(args.repetitions):
                for size in sizes:
                    times[size].append(forward_seconds(verifier, cache, size))
            ms = {s: 1000 * statistics.median(t) for s, t in times.items()}
            report["forward_ms"][f"{name} S={context}"] = ms
            row = " ".join(f"T={s}: {v:6.1f} ms ({v / ms[sizes[0]]:.2f}x)" for s, v in ms.items())
            print(f"{name:7s} S={context:5d} forward  {row}", flush=True)
            grouped = plans[name].grouped_attention
            att = {s: 1000 * attention_seconds(context, s, grouped) for s in sizes}
            report["attention_ms"][f"{name} S={context}"] = att
            row = " ".join(f"T={s}: {v:6.1f} ms" for s, v in att.items())
            print(f"{name:7s} S={context:5d} 30x attn {row}", flush=True)
            del cache
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
