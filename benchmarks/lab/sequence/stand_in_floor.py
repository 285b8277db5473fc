"""Run 114 (#41): on `step_overhead.py`'s stand-in (32 layers, hidden 64, 64 cached tokens,
generic plan), what a W2 L4 step costs against a one-token step, next to what mlx-lm's own
model costs for a forward of the tree's size against one token (the floor no verify step goes
below) and our verify forward alone; interleaved, medians in ms over 30 rounds of 5.

    REDRAFTER_CPU_TUNING=0 PYTHONPATH=. .venv/bin/python \\
        benchmarks/lab/sequence/stand_in_floor.py
    # and with OpenBLAS preloaded (MLX's bundled BLAS multiplies otherwise):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        REDRAFTER_CPU_TUNING=0 PYTHONPATH=. .venv/bin/python \\
        benchmarks/lab/sequence/stand_in_floor.py
"""

import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from step_overhead import PROMPT, stand_in  # noqa: E402

from redrafter_mlx.backend.plan import build_decoder  # noqa: E402
from redrafter_mlx.core.decode import speculative  # noqa: E402
from redrafter_mlx.core.decode.mode import Mode  # noqa: E402
from redrafter_mlx.core.decode.shape import BeamShape  # noqa: E402
from redrafter_mlx.core.decode.step import Decoding  # noqa: E402
from redrafter_mlx.core.drafters.beam_search import BeamDrafter  # noqa: E402
from redrafter_mlx.core.drafters.redrafter import random_drafter  # noqa: E402
from redrafter_mlx.core.serving.session import Session  # noqa: E402
from redrafter_mlx.tuning.measure import probe  # noqa: E402


def main() -> None:
    model = stand_in(32, 64, 256)
    drafter = BeamDrafter(random_drafter(64, 256, seed=1), model.model.embed_tokens)
    decoding = Decoding(Mode.REDRAFTER, BeamShape(2, 4))
    session = Session(build_decoder(model, drafter), None, decoding)
    next(session.steps(PROMPT))
    decoder, sequence = session.decoder, session.sequence
    mark = sequence.mark()
    state = probe(decoder, sequence, decoding)
    planned = speculative.plan_tree(decoder, state)
    size = planned.tree.size
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))

    def mlx_lm(t: int):
        def forward() -> None:
            mx.eval(model(mx.zeros((1, t), mx.int32), cache=cache))
            for layer in cache:
                layer.trim(t)

        return forward

    def one_token_step() -> None:
        choice, _, _ = decoder.next_token(sequence, mx.array([1]), decoding.sampler)
        np.array(choice)

    def verify_forward() -> None:
        hidden = decoder.forward.segment(planned.segment(sequence, {}))
        mx.eval(decoder.forward.lm_head(hidden))

    def tree_step() -> None:
        decoder.step(state)
        sequence.restore(mark)

    parts = {
        "mlx_lm_1": mlx_lm(1),
        f"mlx_lm_{size}": mlx_lm(size),
        "one_token_step": one_token_step,
        "verify_forward": verify_forward,
        "w2l4_step": tree_step,
    }
    for f in parts.values():
        f()
        f()
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(30):
        for name, f in parts.items():
            start = time.perf_counter()
            for _ in range(5):
                f()
            times[name].append((time.perf_counter() - start) / 5)
    ms = {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
    ms["tree_size"] = size
    ms["mlx_lm_ratio"] = round(ms[f"mlx_lm_{size}"] / ms["mlx_lm_1"], 3)
    ms["verify_ratio"] = round(ms["verify_forward"] / ms["one_token_step"], 3)
    ms["step_ratio"] = round(ms["w2l4_step"] / ms["one_token_step"], 3)
    print(json.dumps(ms))


if __name__ == "__main__":
    main()
