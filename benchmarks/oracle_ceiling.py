"""Speed at a known acceptance rate: an oracle drafter that knows the target's continuation.

The oracle wraps the real drafter: it runs the real beam search (so drafting costs what it
costs), then replaces the beam (W = 1) with the target's own greedy continuation in which only
the first ``k`` drafted tokens are right and the rest deliberately wrong. Greedy ReDrafter then
accepts exactly ``k`` drafts per step (``k + 1`` tokens/step) and verifies a chain of ``L``
tokens, so the run shows what this machine delivers at a given tokens/step: the ceiling a
trained drafter of that quality would reach. Output stays exact (checked).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/oracle_ceiling.py --drafter /tmp/rd/drafter
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import mlx.core as mx

from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.io.prompts import load_prompts
from redrafter_mlx.tuning.measure import (
    AUTOREGRESSIVE,
    MLX_LM,
    REDRAFTER,
    Method,
    Record,
    environment,
    measure,
    per_case_median,
    speedups,
)

CONFIGS = ((2, 1), (3, 2), (4, 0), (4, 1), (4, 2), (4, 3), (5, 2), (5, 4), (6, 5))  # (L, k)


class OracleDrafter:
    """Beam (1, L) = the reference continuation from the pending token, first ``correct``
    drafts right. Tracks its position on the host: each step advances by ``correct + 1``."""

    def __init__(self, real, reference: list[int], correct: int, vocab: int):
        self.real, self.reference, self.correct, self.vocab = real, reference, correct, vocab
        self.pos = 0

    def _token(self, i: int) -> int:
        return self.reference[i] if i < len(self.reference) else 0

    def search(self, context, pending, *, width: int, length: int, **options):
        """The real search (its cost and host reads), its beams replaced (the decoder's
        drafter call: ``BeamDrafter.search``)."""
        beams, logprobs, syncs = self.real.search(
            context, pending, width=width, length=length, **options
        )
        k = min(self.correct, length - 1)
        row = [self._token(self.pos + i) for i in range(length)]
        row[k + 1 :] = [(t + 1) % self.vocab for t in row[k + 1 :]]  # wrong on purpose
        self.pos += k + 1
        oracle = mx.array([row] * width, dtype=mx.int32)
        return oracle + 0 * beams, logprobs, syncs  # keeps the real search in the graph

    def __call__(self, context, pending, **options):
        beams, logprobs, _ = self.search(context, pending, **options)
        return beams, logprobs

    def warm_up(self, context, pending, **options) -> None:
        self.real.warm_up(context, pending, **options)


def name(length: int, correct: int) -> str:
    return f"W1L{length}k{correct}"


def run_case(runtime, prompt, case, rep, reference, args) -> list[Record]:
    """Baselines and every oracle config once on one prompt, in a rotated order."""
    jobs = [MLX_LM, AUTOREGRESSIVE, *CONFIGS]
    k = (rep + case) % len(jobs)
    records = []
    for job in jobs[k:] + jobs[:k]:
        if isinstance(job, str):
            run = measure(runtime, Method(job), prompt, max_tokens=args.max_tokens)
            records.append(Record(job, case, rep, run))
            continue
        length, correct = job
        vocab = runtime.model.args.vocab_size
        oracle = OracleDrafter(runtime.drafter, reference, correct, vocab)
        decoder = dataclasses.replace(runtime.decoder, drafter=oracle)  # the same forward
        rt_oracle = dataclasses.replace(runtime, drafter=oracle, decoder=decoder)
        method = Method(REDRAFTER, BeamShape(1, length))
        run = measure(rt_oracle, method, prompt, max_tokens=args.max_tokens)
        records.append(Record(name(length, correct), case, rep, run))
    return records


def summary(records: list[Record], references: dict[int, list[int]]) -> list[dict]:
    rows = []
    for method in [MLX_LM, AUTOREGRESSIVE, *(name(n, k) for n, k in CONFIGS)]:
        mine = [r for r in records if r.method == method]
        steps = sum(r.run.steps for r in mine)
        emitted = sum(sum(k * v for k, v in r.run.accept_histogram.items()) for r in mine)
        tps = list(per_case_median(records, method).values())
        rows.append(
            {
                "method": method,
                "generation_tps": statistics.median(tps),
                "tokens_per_step": emitted / max(steps, 1),
                "speedup_vs_mlx-lm": speedups(records, method, MLX_LM)["ratio_of_medians"],
                "speedup_vs_autoregressive": speedups(records, method, AUTOREGRESSIVE)[
                    "ratio_of_medians"
                ],
                "exact": all(r.run.tokens == references[r.case] for r in mine),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--drafter")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results/oracle_ceiling.json")
    args = p.parse_args()
    runtime = rt.load_runtime(args.model, args.drafter, need_drafter=True)
    convs = load_prompts(None, args.num_prompts, 1)
    prompts = [rt.encode_chat(runtime, [{"role": "user", "content": c[0]}]) for c in convs]
    references = {}
    for case, prompt in enumerate(prompts):  # the reference doubles as a warm-up
        ar = measure(runtime, Method(AUTOREGRESSIVE), prompt, max_tokens=args.max_tokens)
        references[case] = ar.tokens
    measure(runtime, Method(MLX_LM), prompts[0], max_tokens=8)
    records = []
    for rep in range(args.repetitions):
        for case, prompt in enumerate(prompts):
            records += run_case(runtime, prompt, case, rep, references[case], args)
            print(f"rep {rep} prompt {case} done", flush=True)
    rows = summary(records, references)
    for row in rows:
        print(
            f"{row['method']:>15}  {row['generation_tps']:6.2f} tok/s  "
            f"{row['tokens_per_step']:.2f} tok/step  x mlx-lm {row['speedup_vs_mlx-lm']:.2f}  "
            f"x AR {row['speedup_vs_autoregressive']:.2f}  exact {row['exact']}"
        )
    report = {"environment": environment(runtime), "settings": vars(args), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
