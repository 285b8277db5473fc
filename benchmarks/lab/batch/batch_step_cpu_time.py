"""Run 89 (#45): the process CPU time of one batch step of B sequences against B
single-sequence steps, in one process, interleaved per mode (ReDrafter W1 L2 K1 with the
shipped drafter, lookup alone, autoregressive), medians of 15 steps after 3 warm-up steps.
CPU time (``time.process_time``, all threads) rather than wall time: the machine's load
average was 13-16 on its 2 cores while it ran, which swings wall times 2x.

    PYTHONPATH=. .venv/bin/python benchmarks/lab/batch/batch_step_cpu_time.py 4
"""

import statistics
import sys
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


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    runtime = rt.load_runtime(None, None, need_drafter=True)
    decoder = runtime.decoder
    texts = [turns[0] for turns in load_prompts(None, batch, 1)]
    prompts = [rt.encode_chat(runtime, [{"role": "user", "content": t}]) for t in texts]
    modes = {
        "redrafter": Decoding(Mode.REDRAFTER, decoder.plan.default_shape, greedy),
        "lookup": Decoding(Mode.LOOKUP, BeamShape(1, 2, lookup=1), greedy),
        "autoregressive": Decoding(Mode.AUTOREGRESSIVE, decoder.plan.default_shape, greedy),
    }
    for decoding in modes.values():
        decoder.warm_up(decoding)
    warm_up(decoder)

    def members(decoding):
        return [Member(decoder.prefill(decoder.new_sequence(), p, decoding)[0]) for p in prompts]

    def cpu_ms(step, group) -> tuple[float, float]:
        """Median CPU ms of ``step(group)`` and the tokens it emitted per call (mean)."""
        for _ in range(3):
            step(group)
        times, tokens = [], 0
        for _ in range(15):
            tic = time.process_time()
            tokens += step(group)
            times.append(time.process_time() - tic)
        return statistics.median(times) * 1e3, tokens / 15

    def together(group) -> int:
        return sum(len(step.tokens) for step in batch_step(decoder, group))

    def one_by_one(group) -> int:
        return sum(len(batch_step(decoder, [member])[0].tokens) for member in group)

    for name, decoding in modes.items():
        batched, emitted = cpu_ms(together, members(decoding))
        alone, emitted_alone = cpu_ms(one_by_one, members(decoding))
        print(
            f"{name}: batch of {batch} {batched:.1f} ms ({emitted:.2f} tokens), {batch} single "
            f"steps {alone:.1f} ms ({emitted_alone:.2f} tokens), {alone / batched:.2f}x"
        )


if __name__ == "__main__":
    main()
