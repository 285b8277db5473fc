"""Run 87: the CPU plan's one-token attention as issue 46's split (``fused.split_attention``
as it was at f52badf) against one grouped softmax, in one process, interleaved; our
autoregressive loop and ReDrafter W1 L2 K1, tokens/s. Run at f52badf (after a933ec1 the split
itself sends one-token steps to the softmax, so both arms are the same)."""

import statistics
import time

import redrafter_mlx  # noqa: F401  (BLAS first)
from redrafter_mlx.backend.cpu import fused
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.serving.session import Session
from redrafter_mlx.io import runtime as rt

PROMPT = [{"role": "user", "content": "Write a short story about a dragon who learns to cook."}]
METHODS = ((Mode.AUTOREGRESSIVE, BeamShape(1, 2)), (Mode.REDRAFTER, BeamShape(1, 2, lookup=1)))


def main() -> None:
    runtime = rt.load_runtime(None, None, need_drafter=True)
    split = fused.split_attention

    def softmax_for_one_token(q, k, v, scale, mask):
        if mask is None:
            return fused.softmax_attention(q, k, v, scale, mask)
        return split(q, k, v, scale, mask)

    ids = rt.encode_chat(runtime, PROMPT)

    def tokens_per_second(mode: Mode, shape: BeamShape) -> float:
        session = Session(
            runtime.decoder, runtime.tokenizer, rt.decoding(runtime, shape, mode=mode)
        )
        tic, count = time.perf_counter(), 0
        for response in session.generate(ids, max_tokens=128):
            count += len(response.tokens)
        return count / (time.perf_counter() - tic)

    results: dict = {}
    for _ in range(4):
        for name, attention in (("split", split), ("softmax", softmax_for_one_token)):
            fused.split_attention = attention
            for mode, shape in METHODS:
                results.setdefault((name, mode.value), []).append(tokens_per_second(mode, shape))
    for key, values in results.items():  # the first round warms up
        print(key, round(statistics.median(values[1:]), 1), [round(x, 1) for x in values])


if __name__ == "__main__":
    main()
