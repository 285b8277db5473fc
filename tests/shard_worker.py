"""One rank of a sharded decode check (run by tests/test_shard.py under ``mlx.launch``, or alone
with ``--shard none`` for the one-process answers): rank 0 answers the cases of :func:`cases`
through a mirrored session, the other ranks follow; each rank writes the tokens it decoded to
``OUT/rank{r}-{sharding}.json``, for each sharding in turn (one launch checks both).

    python tests/shard_worker.py MODEL DRAFTER tensor,pipeline OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from redrafter_mlx.core.decode.accept import make_sampler
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.step import Decoding
from redrafter_mlx.core.serving.distributed import follow, session_for

PROMPT = [1, 450, 4996, 310, 278, 3186, 338, 263, 5650, 310, 278, 3186, 338]
MORE = [29892, 322, 278, 3186, 338]


def cases() -> list[tuple[str, Decoding]]:
    """Greedy with drafter beams (and a lookup beam), lookup beams alone, autoregressive, and
    sampling at temperature 1 with drafter beams."""
    drafted = BeamShape(width=2, length=3, lookup=1)
    return [
        ("drafter", Decoding(Mode.REDRAFTER, drafted)),
        ("lookup", Decoding(Mode.LOOKUP, BeamShape(width=1, length=4, lookup=2))),
        ("autoregressive", Decoding(Mode.AUTOREGRESSIVE, drafted)),
        ("sampled", Decoding(Mode.REDRAFTER, drafted, make_sampler(1.0, top_k=50))),
    ]


def answer(session, ids: list[int], decoding: Decoding, limit: int | None = None) -> list[int]:
    """The tokens of one answer; with ``limit``, stop reading after that many."""
    tokens = []
    steps = session.generate(ids, max_tokens=12, decoding=decoding)
    for response in steps:
        tokens.extend(response.tokens)
        if limit is not None and len(tokens) >= limit:
            steps.close()  # a client gone: a sharded lead finishes it silently
            break
    return tokens


def lead(runtime) -> dict[str, list[int]]:
    """Each case's answer, then a second turn (prefix reuse), a stopped answer, and the turn
    after it (the ranks still in step)."""
    out = {}
    for name, decoding in cases():
        runtime.decoder.warm_up(decoding)
        session = session_for(runtime.decoder, runtime.tokenizer, decoding, seed=7, warm=False)
        if name == "sampled":
            import mlx.core as mx

            mx.random.seed(7)
        first = answer(session, PROMPT, decoding)
        out[name] = first
        if name in ("drafter", "sampled"):
            out[f"{name}+turn"] = answer(session, PROMPT + first + MORE, decoding)
    session = session_for(runtime.decoder, runtime.tokenizer, cases()[0][1], warm=False)
    out["stopped"] = answer(session, PROMPT, cases()[0][1], limit=3)
    out["after-stopped"] = answer(session, PROMPT + MORE, cases()[0][1])
    return out


def run(model: str, drafter: str, shard: str, out: Path) -> None:
    if shard == "none":
        from redrafter_mlx.io.runtime import load_runtime

        runtime, rank, orders = load_runtime(model, drafter, need_drafter=True), 0, None
    else:
        from redrafter_mlx.io.sharded import load_runtime

        runtime, orders = load_runtime(model, drafter, shard, need_drafter=True)
        rank = orders.rank
    if rank == 0:
        result = lead(runtime)
        if orders is not None:
            orders.stop()
    else:
        result = follow(runtime.decoder, runtime.tokenizer, orders)
    (out / f"rank{rank}-{shard}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    for sharding in sys.argv[3].split(","):
        run(sys.argv[1], sys.argv[2], sharding, Path(sys.argv[4]))
