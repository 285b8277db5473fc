"""A joint forward's attention as one ``joint_attention`` call per layer against one
``tree_attention`` call per member (the fallback path), in one process: a batch of 4 MT-Bench
first turns stepped 15 times per round, the two paths interleaved over 6 rounds; median ms per
batch step, tokens/s, and whether both emitted the same tokens. ``ROWS`` (argument): the plan's
batch row bound; 4 decodes the members plainly, 8 verifies 2-node trees.

    PYTHONPATH=. .venv/bin/python benchmarks/lab/kernels/joint_attention_ab.py 4
    PYTHONPATH=. .venv/bin/python benchmarks/lab/kernels/joint_attention_ab.py 8
"""

import dataclasses
import statistics
import sys
import time

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()

from redrafter_mlx.backend.cpu import fused  # noqa: E402
from redrafter_mlx.core.decode.accept import greedy  # noqa: E402
from redrafter_mlx.core.decode.mode import Mode  # noqa: E402
from redrafter_mlx.core.decode.step import Decoding  # noqa: E402
from redrafter_mlx.core.serving.batch import Member, batch_step  # noqa: E402
from redrafter_mlx.core.serving.scheduler import warm_up  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.io.prompts import load_prompts  # noqa: E402


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    runtime = rt.load_runtime(None, None, need_drafter=True)
    plan = dataclasses.replace(runtime.decoder.plan, batch_rows=rows)
    decoder = dataclasses.replace(runtime.decoder, plan=plan)
    mode = Mode.REDRAFTER if rows > 4 else Mode.AUTOREGRESSIVE
    decoding = Decoding(mode, plan.default_shape, greedy)
    decoder.warm_up(decoding)
    warm_up(decoder, [decoding], 4)
    texts = [turns[0] for turns in load_prompts(None, 4, 1)]
    prompts = [rt.encode_chat(runtime, [{"role": "user", "content": t}]) for t in texts]
    joint = fused._joint_kernel_fits
    paths = {"joint": joint, "per member": lambda *_: False}
    walls = {name: [] for name in paths}
    tokens = dict.fromkeys(paths, 0)
    emitted = {name: [] for name in paths}
    for r in range(6):
        for name in list(paths)[r % 2 :] + list(paths)[: r % 2]:
            fused._joint_kernel_fits = paths[name]
            members = [
                Member(decoder.prefill(decoder.new_sequence(), q, decoding)[0]) for q in prompts
            ]
            batch_step(decoder, members)
            batch_step(decoder, members)
            for _ in range(15):
                tic = time.perf_counter()
                steps = batch_step(decoder, members)
                walls[name].append(time.perf_counter() - tic)
                tokens[name] += sum(len(s.tokens) for s in steps)
                emitted[name].append([s.tokens for s in steps])
    fused._joint_kernel_fits = joint
    for name, w in walls.items():
        median = statistics.median(w) * 1e3
        print(f"{name}: median {median:.1f} ms/step, {tokens[name] / sum(w):.1f} tok/s")
    print("same tokens:", emitted["joint"] == emitted["per member"])


if __name__ == "__main__":
    main()
