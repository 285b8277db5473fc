"""The generic verify path (the model's own mlx-lm modules with tree caches) against the
specialised Llama path (compiled fused halves, shared RoPE tables, grouped attention), in one
process, on this device.

It runs as the console script does (re-executed once with OpenBLAS and the small-row kernel
preloaded, where available). For each tree size T and context S, interleaved repetitions of
one forward + LM head on each path (order rotated per repetition, the first round warms up
and traces); medians in ms and the specialised/generic ratio:

    .venv/bin/python benchmarks/generic_vs_llama.py --out benchmarks/results/generic_vs_llama.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()  # before MLX loads: the BLAS the console script runs with

import mlx.core as mx  # noqa: E402

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN, make_forward, plan_for  # noqa: E402
from redrafter_mlx.core.decode import llm  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.tuning.measure import environment  # noqa: E402

PATHS = {"generic": GENERIC_PLAN, "llama": CPU_PLAN}


def _seconds(forward, cache, count: int) -> float:
    tokens = mx.zeros((count,), mx.int32)
    positions = mx.arange(cache.offset, cache.offset + count)
    mask = llm.chain_mask(cache.offset, count) if count > 1 else None
    tic = time.perf_counter()
    hidden = forward(tokens, positions, mask, cache)
    mx.eval(forward.lm_head(hidden))
    return time.perf_counter() - tic


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--contexts", default="128,512")
    p.add_argument("--repetitions", type=int, default=15)
    p.add_argument("--out", default="benchmarks/results/generic_vs_llama.json")
    args = p.parse_args()
    if plan_for() is not CPU_PLAN:
        p.error("this compares the CPU plan's specialisation: run it on the CPU backend")
    runtime = rt.load_runtime(args.model, None, need_drafter=False)
    model = runtime.model
    # each path's forward, built once (the runtime's own is the CPU plan's: no second copy)
    forwards = {
        name: runtime.decoder.forward if plan is runtime.plan else make_forward(model, plan)
        for name, plan in PATHS.items()
    }
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        cache = llm.new_sequence(model)
        tokens = mx.arange(context) % 100 + 10
        mask = llm.chain_mask(0, context)
        mx.eval(llm.forward(model, tokens, mx.arange(context), mask, cache))
        cache.commit(list(range(context)))
        for size in (int(s) for s in args.sizes.split(",")):
            runs = {name: [] for name in PATHS}
            names = list(PATHS)
            for rep in range(args.repetitions + 1):
                for name in names[rep % 2 :] + names[: rep % 2]:
                    seconds = _seconds(forwards[name], cache, size)
                    if rep:
                        runs[name].append(seconds)
            ms = {k: statistics.median(v) * 1e3 for k, v in runs.items()}
            rows.append({"context": context, "T": size, **ms, "ratio": ms["llama"] / ms["generic"]})
            print(
                f"S={context:4d} T={size:3d}: generic {ms['generic']:6.2f} ms  llama "
                f"{ms['llama']:6.2f} ms  ({ms['llama'] / ms['generic']:.2f}x)",
                flush=True,
            )
    report = {"environment": environment(runtime), "repetitions": args.repetitions, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
