"""In-process A/B: sampling with ``accept.choose`` drawing from raw logits (new,
``reads_logits``) vs from log-probs (old: a log-softmax over every verified row first).
Interleaved per prompt and repetition, the same seed per prompt; prints each method's median
tokens/s and the per-prompt new/old ratios.

    LD_PRELOAD="$(ls ~/.cache/redrafter-mlx/blas/smallrows-*.so) \\
        /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0" \\
        .venv/bin/python benchmarks/sampling_ab.py \\
        --prompts runs/cache-self-all/heldout_prompts.jsonl
"""

from __future__ import annotations

import argparse
import statistics

from redrafter_mlx.core.decode import accept
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.io.prompts import load_prompts
from redrafter_mlx.tuning.measure import AUTOREGRESSIVE, REDRAFTER, Method, measure, warm_up

METHODS = [
    Method(AUTOREGRESSIVE),
    Method(REDRAFTER, BeamShape(1, 2)),
    Method(REDRAFTER, BeamShape(2, 2, 0.3)),
]


def log_softmax_first(temp: float = 0.0, top_p: float = 0.0, top_k: int = 0):
    """The sampler as before ``reads_logits``: choose() normalises every row first."""
    sampler = accept.make_sampler(temp, top_p, top_k)
    if sampler is not accept.greedy:
        sampler.reads_logits = False
    return sampler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", help="JSONL prompts (default: MT-Bench)")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--temp", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    runtime = rt.load_runtime(None, None, need_drafter=True)
    convs = load_prompts(args.prompts, args.num_prompts, 1)
    prompts = [rt.encode_chat(runtime, [{"role": "user", "content": c[0]}]) for c in convs]
    warm_up(runtime, METHODS, prompts[0], temp=args.temp)
    samplers = {"new": accept.make_sampler, "old": log_softmax_first}
    tps: dict[tuple[str, str], dict[int, list[float]]] = {}
    for rep in range(args.repetitions):
        for case, prompt in enumerate(prompts):
            order = ("new", "old") if (rep + case) % 2 == 0 else ("old", "new")
            for variant in order:
                rt.make_sampler = samplers[variant]  # what rt.decoding builds with
                for m in METHODS:
                    run = measure(
                        runtime, m, prompt, max_tokens=args.max_tokens, temp=args.temp, seed=case
                    )
                    tps.setdefault((m.name, variant), {}).setdefault(case, []).append(
                        run.generation_tps
                    )
    for m in METHODS:
        new, old = tps[(m.name, "new")], tps[(m.name, "old")]
        ratios = [statistics.median(new[c]) / statistics.median(old[c]) for c in new]
        print(
            f"{m.name:15s} old {statistics.median(map(statistics.median, old.values())):6.2f} "
            f"new {statistics.median(map(statistics.median, new.values())):6.2f} tok/s, "
            f"per-prompt new/old {[round(r, 3) for r in ratios]}"
        )


if __name__ == "__main__":
    main()
