"""Autotune (successive halving) against the exhaustive W x L grid, in one session.

Both use the same runtime, held-out prompts, token budget and timer (``bench.measure`` via
``search.make_measure``); every shape is compiled once before either is timed. Reports the
grid's own tokens/s of the shape autotune chose relative to the grid's best, and the ratio of
wall times.

``--synthetic-acceptance P`` replaces what the drafter proposes (not what it costs: the real
beam search still runs) with the target's own greedy continuation, each drafted token right
with probability ``P * 0.7**rank`` for the beam of that rank (seeded per prompt position, so
every shape sees the same draws). Acceptance then grows with W and L while the verify cost grows
with the tree: a search problem with a real trade-off, on real timings, before a trained
drafter exists.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/autotune_vs_grid.py --drafter DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.tuning import search
from redrafter_mlx.tuning.measure import REDRAFTER, Method, environment, warm_up


class SyntheticDrafter:
    """Beams (W, L) from the reference continuation; beam b's drafts are right while seeded
    draws stay under ``p * decay**b``, then wrong (distinct per beam). The host tracks the
    position: a step advances it by the longest right prefix + 1 (what greedy accepts)."""

    def __init__(self, real, reference: list[int], p: float, vocab: int, *, decay: float = 0.7):
        self.real, self.reference, self.p, self.vocab, self.decay = real, reference, p, vocab, decay
        self.pos = 0

    def _right(self, pos: int, beam: int, length: int) -> int:
        draws = np.random.default_rng([pos, beam]).random(length - 1)
        wrong = np.nonzero(draws >= self.p * self.decay**beam)[0]
        return int(wrong[0]) if len(wrong) else length - 1

    def search(self, context, pending, *, width: int, length: int, **options):
        """The real search (its cost and host reads), its beams replaced (the decoder's
        drafter call: ``BeamDrafter.search``)."""
        beams, logprobs, syncs = self.real.search(
            context, pending, width=width, length=length, **options
        )
        ref = [
            self.reference[i] if i < len(self.reference) else 0
            for i in range(self.pos, self.pos + length)
        ]
        rows, best = [], 0
        for b in range(width):
            right = self._right(self.pos, b, length)
            best = max(best, right)
            rows.append(ref[: right + 1] + [(t + 1 + b) % self.vocab for t in ref[right + 1 :]])
        self.pos += best + 1
        return mx.array(rows, dtype=mx.int32) + 0 * beams, logprobs, syncs

    def __call__(self, context, pending, **options):
        beams, logprobs, _ = self.search(context, pending, **options)
        return beams, logprobs

    def warm_up(self, context, pending, **options) -> None:
        self.real.warm_up(context, pending, **options)


def synthetic_measure(runtime, prompts, references, p: float, max_tokens: int):
    """A ``Measure`` that runs each generation with a fresh ``SyntheticDrafter``."""
    vocab = runtime.model.args.vocab_size

    def measure(shape, prompt):
        drafter = SyntheticDrafter(runtime.drafter, references[prompt], p, vocab)
        decoder = dataclasses.replace(runtime.decoder, drafter=drafter)  # the same forward
        fresh = dataclasses.replace(runtime, drafter=drafter, decoder=decoder)
        return search.make_measure(fresh, prompts, max_tokens=max_tokens)(shape, prompt)

    return measure


def references_for(runtime, prompts, max_tokens: int) -> list[list[int]]:
    from redrafter_mlx.tuning.measure import AUTOREGRESSIVE, Method, measure

    return [
        measure(runtime, Method(AUTOREGRESSIVE), p, max_tokens=max_tokens).tokens for p in prompts
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--drafter")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--repetitions", type=int, default=2, help="grid runs per prompt")
    p.add_argument("--widths", default="1,2,3,4,5,6,7,8")
    p.add_argument("--lengths", default="2,3,4,5,6")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--synthetic-acceptance", type=float, help="P: see the module docstring")
    p.add_argument("--out", default="benchmarks/results/autotune_vs_grid.json")
    args = p.parse_args()
    runtime = rt.load_runtime(args.model, args.drafter, need_drafter=True)
    shapes = [
        BeamShape(int(w), int(n)) for w in args.widths.split(",") for n in args.lengths.split(",")
    ]
    prompts = search.heldout_prompt_ids(runtime, args.num_prompts)
    if args.synthetic_acceptance is None:
        measure = search.make_measure(runtime, prompts, max_tokens=args.max_tokens)
    else:
        refs = references_for(runtime, prompts, args.max_tokens)
        measure = synthetic_measure(
            runtime, prompts, refs, args.synthetic_acceptance, args.max_tokens
        )
    tic = time.perf_counter()
    warm_up(runtime, [Method(REDRAFTER, s) for s in shapes], prompts[0])
    warm = time.perf_counter() - tic
    log = lambda s: print(f"  W{s.width}L{s.length}", end="", flush=True, file=sys.stderr)
    print(f"warm-up {warm:.0f} s; autotune:", file=sys.stderr)
    tic = time.perf_counter()
    tuned = search.successive_halving(
        shapes, measure, num_prompts=len(prompts), seed=args.seed, on_run=log
    )
    tuned_s = time.perf_counter() - tic
    print(
        f"\nautotune {tuned_s:.0f} s -> W{tuned.best.width}L{tuned.best.length}; grid:",
        file=sys.stderr,
    )
    tic = time.perf_counter()
    grid = search.full_grid(
        shapes,
        measure,
        num_prompts=len(prompts),
        repetitions=args.repetitions,
        seed=args.seed,
        on_run=log,
    )
    grid_s = time.perf_counter() - tic
    chosen_tps, best_tps = grid.estimates[tuned.best], grid.estimates[grid.best]
    report = {
        "environment": environment(runtime),
        "settings": vars(args),
        "warm_up_seconds": warm,
        "autotune": {
            "shape": [tuned.best.width, tuned.best.length],
            "seconds": tuned_s,
            "runs": len(tuned.observations),
            "table": search.table(tuned),
        },
        "grid": {
            "shape": [grid.best.width, grid.best.length],
            "seconds": grid_s,
            "runs": len(grid.observations),
            "table": search.table(grid),
        },
        "grid_tps_of_autotune_choice": chosen_tps,
        "grid_best_tps": best_tps,
        "choice_vs_grid_best": chosen_tps / best_tps,
        "time_ratio": tuned_s / grid_s,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(
        f"\nautotune W{tuned.best.width}L{tuned.best.length}: {chosen_tps:.2f} tok/s in the "
        f"grid = {chosen_tps / best_tps:.1%} of the grid best W{grid.best.width}"
        f"L{grid.best.length} ({best_tps:.2f}); time {tuned_s:.0f} s vs {grid_s:.0f} s "
        f"({tuned_s / grid_s:.0%})"
    )


if __name__ == "__main__":
    main()
