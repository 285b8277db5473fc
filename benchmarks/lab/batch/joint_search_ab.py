"""Run 91 (#45): a batch step of 4 ReDrafter members (W1 L2 K1, shipped drafter) with the
members' drafter searches run as one search against one search per member (the batch step as
it was at 6d6c556), in one process, arms alternated 4 times; process CPU time and wall time
per batch step, medians of 10 steps per turn.

    PYTHONPATH=. .venv/bin/python benchmarks/lab/batch/joint_search_ab.py
"""

import statistics
import time

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()

from redrafter_mlx.core.decode.accept import greedy  # noqa: E402
from redrafter_mlx.core.decode.mode import Mode  # noqa: E402
from redrafter_mlx.core.decode.step import Decoding  # noqa: E402
from redrafter_mlx.core.serving import batch  # noqa: E402
from redrafter_mlx.core.serving.scheduler import warm_up  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.io.prompts import load_prompts  # noqa: E402


def main() -> None:
    runtime = rt.load_runtime(None, None, need_drafter=True)
    decoder = runtime.decoder
    texts = [turns[0] for turns in load_prompts(None, 4, 1)]
    prompts = [rt.encode_chat(runtime, [{"role": "user", "content": t}]) for t in texts]
    decoding = Decoding(Mode.REDRAFTER, decoder.plan.default_shape, greedy)
    decoder.warm_up(decoding)
    warm_up(decoder, [decoding], 4)
    joint = batch.search_group
    arms = {"one search": joint, "a search per member": lambda decoder, decoding: None}
    cpu, wall = {name: [] for name in arms}, {name: [] for name in arms}
    for _ in range(4):
        for name, group in arms.items():
            batch.search_group = group
            members = [
                batch.Member(decoder.prefill(decoder.new_sequence(), p, decoding)[0])
                for p in prompts
            ]
            for _ in range(3):
                batch.batch_step(decoder, members)
            for _ in range(10):
                tic, tac = time.process_time(), time.perf_counter()
                batch.batch_step(decoder, members)
                cpu[name].append(time.process_time() - tic)
                wall[name].append(time.perf_counter() - tac)
    batch.search_group = joint
    for name in arms:
        print(
            f"{name}: CPU {statistics.median(cpu[name]) * 1e3:.1f} ms, "
            f"wall {statistics.median(wall[name]) * 1e3:.1f} ms per batch step of 4"
        )


if __name__ == "__main__":
    main()
