"""Issue 45: the CPU plan's batch row bound (``Plan.batch_rows``) at 2, 4 and 8 members: the
default decoding (W1 L2 plus one lookup beam, fitted to the bound's share per member) under
bounds of 8 and 4 rows, against plain batched decoding, in one process, configurations
interleaved round by round (each round its own MT-Bench first turns: held-out prompts;
nothing here is tuned on them, every configuration gives the same greedy answers). Per
configuration: tokens per second over all timed batch steps, median ms per step, tokens/step.

    PYTHONPATH=. .venv/bin/python benchmarks/lab/batch/batch_rows_ab.py \\
        --batches 2,4,8 --rounds 6 > benchmarks/results/batch/batch_rows_ab.txt
"""

import argparse
import dataclasses
import statistics
import time

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()

from redrafter_mlx.core.decode.accept import greedy  # noqa: E402
from redrafter_mlx.core.decode.mode import Mode  # noqa: E402
from redrafter_mlx.core.decode.step import Decoding  # noqa: E402
from redrafter_mlx.core.serving.batch import Member, batch_step  # noqa: E402
from redrafter_mlx.core.serving.scheduler import warm_up  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.io.prompts import load_prompts  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="2,4,8")
    p.add_argument("--rows", default="8,4", help="batch_rows bounds to compare")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=12, help="timed batch steps per round")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    bounds = [int(r) for r in args.rows.split(",")]
    runtime = rt.load_runtime(None, None, need_drafter=True)
    base = runtime.decoder.plan
    decoders = {  # one forward, each bound to a plan
        r: dataclasses.replace(runtime.decoder, plan=dataclasses.replace(base, batch_rows=r))
        for r in [*bounds, base.batch_rows]
    }
    texts = [turns[0] for turns in load_prompts(None, max(batches) * args.rounds, 1)]
    prompts = [rt.encode_chat(runtime, [{"role": "user", "content": t}]) for t in texts]
    tree = Decoding(Mode.REDRAFTER, base.default_shape, greedy)
    plain = Decoding(Mode.AUTOREGRESSIVE, base.default_shape, greedy)
    configs = [("plain", None, plain)] + [(f"tree rows {r}", r, tree) for r in bounds]
    for _, rows, decoding in configs:
        decoder = decoders[rows or base.batch_rows]
        decoder.warm_up(decoding)
        warm_up(decoder, [decoding], max(batches))
    results: dict = {}
    for r in range(args.rounds):
        for b in batches:
            group = prompts[r * b : (r + 1) * b]
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for name, rows, decoding in order:
                decoder = decoders[rows or base.batch_rows]
                members = [
                    Member(decoder.prefill(decoder.new_sequence(), q, decoding)[0]) for q in group
                ]
                batch_step(decoder, members)  # the first step after a prompt
                entry = results.setdefault((b, name), {"walls": [], "tokens": 0})
                for _ in range(args.steps):
                    start = time.perf_counter()
                    steps = batch_step(decoder, members)
                    entry["walls"].append(time.perf_counter() - start)
                    entry["tokens"] += sum(len(s.tokens) for s in steps)
    print("batch | decoding | tok/s | median ms/step | tokens/step")
    for (b, name), e in sorted(results.items()):
        walls = e["walls"]
        print(
            f"{b} | {name} | {e['tokens'] / sum(walls):.1f} | "
            f"{statistics.median(walls) * 1e3:.1f} | {e['tokens'] / len(walls):.2f}"
        )


if __name__ == "__main__":
    main()
