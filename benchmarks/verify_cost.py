"""Verify-cost sweep: one target forward over T tokens relative to a one-token forward.

ReDrafter's speedup is bounded by tokens/step divided by this ratio (at the step's tree size).
Interleaved medians from ``measure.forward_cost_ratio``; run once with and once without OpenBLAS:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/verify_cost.py --out benchmarks/results/verify_cost.json
    .venv/bin/python benchmarks/verify_cost.py --out benchmarks/results/verify_cost_no_openblas.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from redrafter_mlx.io import runtime as rt
from redrafter_mlx.tuning.measure import environment, forward_cost_ratio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--sizes", default="2,3,4,6,8,12,16,24,32,64")
    p.add_argument("--context", type=int, default=128, help="cached tokens before the forward")
    p.add_argument("--repetitions", type=int, default=9)
    p.add_argument("--out", default="benchmarks/results/verify_cost.json")
    args = p.parse_args()
    runtime = rt.load_runtime(args.model, None, need_drafter=False)
    ratios = {}
    for size in (int(s) for s in args.sizes.split(",")):
        ratios[size] = forward_cost_ratio(
            runtime.decoder, size, context=args.context, repetitions=args.repetitions
        )
        print(f"T={size:3d}: {ratios[size]:.2f}x a one-token forward", flush=True)
    report = {
        "environment": environment(runtime),
        "context": args.context,
        "repetitions": args.repetitions,
        "ratio": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
