"""Issue 45: what a batch step of B members costs per emitted token, by decoding (plain
decoding, and ReDrafter trees of a few shapes with the shipped drafter), in one process,
configurations interleaved round by round; per configuration the median ms per batch step
(wall and process CPU time) and the tokens it emitted, over MT-Bench first turns (the
held-out MT-Bench prompts; nothing here is tuned on them: it picks between shapes that all
give the same greedy answer).

    PYTHONPATH=. .venv/bin/python benchmarks/lab/batch/batch_shape_sweep.py \\
        --batches 1,2,4,8 --rounds 3 > benchmarks/results/batch/batch_shape_sweep.txt
"""

import argparse
import statistics
import time

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()

from redrafter_mlx.core.decode.accept import greedy  # noqa: E402
from redrafter_mlx.core.decode.mode import Mode  # noqa: E402
from redrafter_mlx.core.decode.shape import BeamShape  # noqa: E402
from redrafter_mlx.core.decode.step import Decoding  # noqa: E402
from redrafter_mlx.core.serving.batch import Member, batch_step  # noqa: E402
from redrafter_mlx.core.serving.scheduler import warm_up  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.io.prompts import load_prompts  # noqa: E402

SHAPES = {
    "plain": None,
    "W1L2K0": BeamShape(1, 2, lookup=0),
    "W1L2K1": BeamShape(1, 2, lookup=1),
    "W1L3K0": BeamShape(1, 3, lookup=0),
    "W2L2K0": BeamShape(2, 2, lookup=0),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="timed batch steps per round")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    runtime = rt.load_runtime(None, None, need_drafter=True)
    decoder = runtime.decoder
    texts = [turns[0] for turns in load_prompts(None, max(batches) * args.rounds, 1)]
    prompts = [rt.encode_chat(runtime, [{"role": "user", "content": t}]) for t in texts]
    decodings = {
        name: Decoding(Mode.AUTOREGRESSIVE, decoder.plan.default_shape, greedy)
        if shape is None
        else Decoding(Mode.REDRAFTER, shape, greedy)
        for name, shape in SHAPES.items()
    }
    for decoding in decodings.values():
        decoder.warm_up(decoding)
    warm_up(decoder, list(decodings.values()), max(batches))
    results: dict = {}
    for r in range(args.rounds):
        for b in batches:
            group_prompts = prompts[r * b : (r + 1) * b]
            names = list(decodings)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                decoding = decodings[name]
                members = [
                    Member(decoder.prefill(decoder.new_sequence(), q, decoding)[0])
                    for q in group_prompts
                ]
                batch_step(decoder, members)  # the first step after a prompt
                walls, cpus, tokens = [], [], 0
                for _ in range(args.steps):
                    w, c = time.perf_counter(), time.process_time()
                    steps = batch_step(decoder, members)
                    walls.append(time.perf_counter() - w)
                    cpus.append(time.process_time() - c)
                    tokens += sum(len(s.tokens) for s in steps)
                empty = {"wall": [], "cpu": [], "tokens": 0, "steps": 0}
                entry = results.setdefault((b, name), empty)
                entry["wall"] += walls
                entry["cpu"] += cpus
                entry["tokens"] += tokens
                entry["steps"] += args.steps
    print("batch | decoding | wall ms/step | cpu ms/step | tokens/step | wall ms/token | tok/s")
    for (b, name), e in sorted(results.items()):
        wall, cpu = statistics.median(e["wall"]) * 1e3, statistics.median(e["cpu"]) * 1e3
        per_step = e["tokens"] / e["steps"]
        print(
            f"{b} | {name} | {wall:.1f} | {cpu:.1f} | {per_step:.2f} | {wall / per_step:.2f}"
            f" | {1e3 * per_step / wall:.1f}"
        )


if __name__ == "__main__":
    main()
