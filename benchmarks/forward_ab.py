"""Compiled decode forward against running mlx-lm's modules directly, in one process.

For each T, interleaved repetitions of: the module forward at T = 1 (what an uncompiled
autoregressive step costs: mlx-lm's modules between attentions), the module forward at T, and
this package's forward at T (per-layer compiled halves, q/k/v and gate/up stacked, ``W @ x.T``
projections at 2-3 rows on the CPU). Both use the CPU's grouped attention. Reports medians
relative to the module T = 1 forward, each including the LM head:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/forward_ab.py --out benchmarks/results/forward_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import mlx.core as mx

from redrafter_mlx.core.decode import llm
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.tuning.measure import environment, forward_seconds


def _timed(forward, cache, count: int, compiled: bool) -> float:
    """One forward + LM head over ``count`` tokens, compiled or through the modules."""
    return forward_seconds(forward, cache, count, compiled=compiled)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--sizes", default="1,2,3,4,6,8,16")
    p.add_argument("--context", type=int, default=128, help="cached tokens before the forward")
    p.add_argument("--repetitions", type=int, default=15)
    p.add_argument("--out", default="benchmarks/results/forward_ab.json")
    args = p.parse_args()
    runtime = rt.load_runtime(args.model, None, need_drafter=False)
    forward = runtime.decoder.forward  # the device plan's forward (compiled halves on the CPU)
    cache = runtime.decoder.new_sequence()
    tokens = mx.arange(args.context) % 100 + 10
    prefix = llm.chain_mask(0, args.context)
    mx.eval(llm.forward(runtime.model, tokens, mx.arange(args.context), prefix, cache))
    cache.commit(list(range(args.context)))
    rows = {}
    for size in (int(s) for s in args.sizes.split(",")):
        runs = {"modules_1": [], "modules": [], "compiled": []}
        for rep in range(args.repetitions + 1):
            pairs = [("modules_1", 1, False), ("modules", size, False), ("compiled", size, True)]
            for name, count, compiled in pairs[rep % 3 :] + pairs[: rep % 3]:
                seconds = _timed(forward, cache, count, compiled)
                if rep:  # the first round is warm-up (and traces the compiled blocks)
                    runs[name].append(seconds)
        base = statistics.median(runs["modules_1"])
        rows[size] = {k: statistics.median(v) / base for k, v in runs.items() if k != "modules_1"}
        rows[size]["modules_1_ms"] = base * 1e3
        print(
            f"T={size:3d}: modules {rows[size]['modules']:.2f}x  compiled "
            f"{rows[size]['compiled']:.2f}x  (of a {base * 1e3:.1f} ms module T=1 forward)",
            flush=True,
        )
    report = {
        "environment": environment(runtime),
        "context": args.context,
        "repetitions": args.repetitions,
        "relative_to_module_forward_at_T1": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
