"""Issue 45, item 3: a batch step of B members on a hybrid target, its recurrent layers run as
one batch across the members (``JointStateSlot``) against one whole forward per member (the
fallback before), in one process, alternated, medians of ms per batch step.

The target is ``benchmarks/hybrid_verify_cost.py``'s Qwen3.5-style stand-in (Gated DeltaNet in
3 of 4 layers, hidden 1024, 8 layers, random weights, float32); members decode with lookup
beams (W1 L3 K2: trees of up to 5 nodes) or plainly, alternately; prompts of random ids.

    PYTHONPATH=. .venv/bin/python benchmarks/lab/batch/hybrid_joint_ab.py --members 4
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()

import mlx.core as mx  # noqa: E402

from redrafter_mlx.backend.plan import build_decoder  # noqa: E402
from redrafter_mlx.core.decode import llm  # noqa: E402
from redrafter_mlx.core.decode.accept import greedy  # noqa: E402
from redrafter_mlx.core.decode.mode import Mode  # noqa: E402
from redrafter_mlx.core.decode.shape import BeamShape  # noqa: E402
from redrafter_mlx.core.decode.step import Decoding  # noqa: E402
from redrafter_mlx.core.serving.batch import Member, batch_step  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hybrid_verify_cost import SIZE, STAND_INS, build_config  # noqa: E402


def per_member(forward, segments, *, compiled=True):
    """The joint forward before: one whole forward per member on a recurrent target."""
    return [forward.segment(s, compiled=compiled) for s in segments]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    model = build_config({**SIZE, **STAND_INS["qwen3_5 (Gated DeltaNet 3:1)"]})
    decoder = build_decoder(model, None)
    mx.random.seed(0)
    decodings = [
        Decoding(Mode.LOOKUP, BeamShape(1, 3, lookup=2), greedy),
        Decoding(Mode.AUTOREGRESSIVE, BeamShape(1, 2), greedy),
    ]
    for d in decodings:
        decoder.warm_up(d)
    joint = llm.Forward.joint
    arms = {"joint": joint, "per member": per_member}
    times = {name: [] for name in arms}
    for r in range(args.rounds):
        for name in list(arms)[r % 2 :] + list(arms)[: r % 2]:
            llm.Forward.joint = arms[name]
            members = []
            for i in range(args.members):
                prompt = mx.random.randint(3, 1000, (48,)).tolist()
                prompt = prompt + prompt[:16]  # something for the lookup beams to find
                state, _ = decoder.prefill(decoder.new_sequence(), prompt, decodings[i % 2])
                members.append(Member(state))
            batch_step(decoder, members)
            for _ in range(args.steps):
                tic = time.perf_counter()
                batch_step(decoder, members)
                times[name].append(time.perf_counter() - tic)
    llm.Forward.joint = joint
    for name, ts in times.items():
        print(
            f"{args.members} members, {name}: {statistics.median(ts) * 1e3:.1f} ms per batch step"
        )


if __name__ == "__main__":
    main()
