"""Run 111: the CPU plan's tree attention at an earlier commit (``split_attention`` from
``OLD``'s source) against now, interleaved in one process: a speculative step of the embedded
model (v5 drafter) over a one-token step (``tuning.measure.time_steps``) after a prompt of each
length cut from README.md, W1 L2 K1 and W2 L3, medians of the ratio over rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/lab/sequence/small_tree_attention_ab.py \\
        128,512,1024 10 380ef30
"""

import statistics
import subprocess
import sys

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()

from redrafter_mlx.backend.cpu import fused  # noqa: E402
from redrafter_mlx.core.decode.accept import greedy  # noqa: E402
from redrafter_mlx.core.decode.mode import Mode  # noqa: E402
from redrafter_mlx.core.decode.shape import BeamShape  # noqa: E402
from redrafter_mlx.core.decode.step import Decoding  # noqa: E402
from redrafter_mlx.core.serving.session import Session  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.tuning.measure import time_steps  # noqa: E402


def old_split_attention(rev: str):
    """``split_attention`` as commit ``rev`` wrote it, over this checkout's helpers."""
    show = ["git", "show", f"{rev}:redrafter_mlx/backend/cpu/fused.py"]
    src = subprocess.run(show, capture_output=True, text=True, check=True).stdout
    namespace = dict(vars(fused))
    exec(src[src.index("def split_attention(") : src.index("def softmax_attention(")], namespace)
    return namespace["split_attention"]


def main() -> None:
    lengths, rounds, rev = [int(x) for x in sys.argv[1].split(",")], int(sys.argv[2]), sys.argv[3]
    versions = {"old": old_split_attention(rev), "new": fused.split_attention}
    runtime = rt.load_runtime(None, None, need_drafter=True)
    ids = runtime.tokenizer.encode(open("README.md").read())
    for length in lengths:
        for shape in (BeamShape(1, 2, lookup=1), BeamShape(2, 3, lookup=0)):
            session = Session(runtime.decoder, None, Decoding(Mode.REDRAFTER, shape, greedy))
            next(session.steps(ids[:length]))
            ratios = {name: [] for name in versions}
            for r in range(rounds):
                for name in list(versions)[:: 1 if r % 2 else -1]:
                    fused.split_attention = versions[name]
                    one, speculative = time_steps(session, 6)
                    ratios[name].append(speculative / one)
            fused.split_attention = versions["new"]
            medians = {k: round(statistics.median(v), 3) for k, v in ratios.items()}
            print(length, f"W{shape.width}L{shape.length}K{shape.lookup}", medians, flush=True)


if __name__ == "__main__":
    main()
