"""The MLP gate's CPU kernel (``swiglu`` in ``backend/cpu/csrc/primitives.cpp``) against MLX's
``silu(gate) * up``, in one process: two decoders on the embedded model, one whose fused
forward runs the kernel and one built with it withheld, interleaved round by round on MT-Bench
first turns (the same greedy answers either way). Per decoder: prompt prefill tokens/s, a
single sequence's default (tree) decode tok/s, a 4-member batch's plain decode tok/s.

    PYTHONPATH=. .venv/bin/python benchmarks/lab/kernels/swiglu_ab.py --rounds 4
"""

import argparse
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


def load(with_kernel: bool):
    own = fused.cpu_kernels
    if not with_kernel:
        fused.cpu_kernels = lambda: own()._replace(swiglu=None)
    try:
        return rt.load_runtime(None, None, need_drafter=True)
    finally:
        fused.cpu_kernels = own


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    runtimes = {"kernel": load(True), "mlx ops": load(False)}
    plan = runtimes["kernel"].decoder.plan
    tree = Decoding(Mode.REDRAFTER, plan.default_shape, greedy)
    plain = Decoding(Mode.AUTOREGRESSIVE, plan.default_shape, greedy)
    texts = [turns[0] for turns in load_prompts(None, 4 * args.rounds, 1)]
    some = runtimes["kernel"]
    prompts = [rt.encode_chat(some, [{"role": "user", "content": t}]) for t in texts]
    for runtime in runtimes.values():
        for decoding in (tree, plain):
            runtime.decoder.warm_up(decoding)
        warm_up(runtime.decoder, [plain], 4)
    figures = {(n, k): [0.0, 0] for n in runtimes for k in ("prefill", "tree 1", "plain 4")}
    for r in range(args.rounds):
        group = prompts[4 * r : 4 * r + 4]
        names = list(runtimes)[r % 2 :] + list(runtimes)[: r % 2]
        for name in names:
            decoder = runtimes[name].decoder
            members = []
            for q in group:
                tic = time.perf_counter()
                state = decoder.prefill(decoder.new_sequence(), q, plain)[0]
                figures[name, "prefill"][0] += time.perf_counter() - tic
                figures[name, "prefill"][1] += len(q)
                members.append(Member(state))
            run(decoder, members, args.steps, figures[name, "plain 4"])
            alone = [Member(decoder.prefill(decoder.new_sequence(), group[0], tree)[0])]
            run(decoder, alone, args.steps, figures[name, "tree 1"])
    print("decoder | prefill tok/s | tree alone tok/s | 4 plain tok/s")
    for name in runtimes:
        row = [figures[name, k][1] / figures[name, k][0] for k in ("prefill", "tree 1", "plain 4")]
        print(f"{name} | " + " | ".join(f"{x:.1f}" for x in row))


def run(decoder, members, steps, figure) -> None:
    batch_step(decoder, members)  # the first step after a prompt
    for _ in range(steps):
        tic = time.perf_counter()
        emitted = batch_step(decoder, members)
        figure[0] += time.perf_counter() - tic
        figure[1] += sum(len(s.tokens) for s in emitted)


if __name__ == "__main__":
    main()
