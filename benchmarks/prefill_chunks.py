"""Prefill tokens/s against the prompt chunk size, at a long prompt, on the CPU plan (and the
generic plan with ``--plans cpu,generic``): each chunk size's decoder feeds the same prompt
into a fresh cache, interleaved rounds, medians:

    PYTHONPATH=. .venv/bin/python benchmarks/prefill_chunks.py --tokens 4096 \\
        --out benchmarks/results/prefill_chunks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

if __name__ == "__main__":
    reexec_with_blas()  # before MLX loads: the BLAS the console script runs with

import mlx.core as mx  # noqa: E402

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN, build_decoder  # noqa: E402
from redrafter_mlx.core.decode.accept import greedy  # noqa: E402
from redrafter_mlx.core.decode.mode import Mode  # noqa: E402
from redrafter_mlx.core.decode.step import Decoding  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.tuning.measure import environment  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunks", default="256,512,1024,2048")
    p.add_argument("--plans", default="cpu")
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    runtime = rt.load_runtime(None, None, need_drafter=False)
    prompt = [10 + i % 5000 for i in range(args.tokens)]
    plans = {"cpu": CPU_PLAN, "generic": GENERIC_PLAN}
    decoders = {}
    for name in args.plans.split(","):
        base = build_decoder(runtime.model, plan=plans[name])  # one forward per plan
        for chunk in (int(c) for c in args.chunks.split(",")):
            decoders[name, chunk] = replace(base, plan=replace(plans[name], prefill_chunk=chunk))
    decoding = Decoding(Mode.AUTOREGRESSIVE, CPU_PLAN.default_shape, greedy)
    seconds = {key: [] for key in decoders}
    for _ in range(args.repetitions):
        for key, decoder in decoders.items():
            sequence = decoder.new_sequence()
            tic = time.perf_counter()
            state, _ = decoder.prefill(sequence, prompt, decoding)
            mx.eval(state.pending)
            seconds[key].append(time.perf_counter() - tic)
            print(f"{key}: {args.tokens / seconds[key][-1]:.1f} tok/s", flush=True)
            del sequence, state
            mx.clear_cache()
    rows = {
        f"{name} chunk={chunk}": args.tokens / statistics.median(s)
        for (name, chunk), s in seconds.items()
    }
    for key, tps in rows.items():
        print(f"{key}: median {tps:.1f} prompt tokens/s")
    if args.out:
        report = {"environment": environment(runtime), "tokens": args.tokens, "prefill_tps": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
