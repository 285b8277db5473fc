"""What a decode step costs beyond its arithmetic: a one-token step and a ReDrafter step on a
stand-in with many layers and little arithmetic (what a GPU pays per step in launched work and
Python graph building), on the generic plan (the path Metal and CUDA run) by default.

Interleaved repetitions after a warm-up, medians in ms; the drafter is random, so each step
verifies a full W x L tree and accepts about nothing (the cost side only)::

    REDRAFTER_CPU_TUNING=0 .venv/bin/python benchmarks/step_overhead.py \\
        --out benchmarks/results/step_overhead.json

It runs on the decode core before issue #31 (its own ``Decoder.time_steps``), after it and after
issue #41 (``tuning.measure.time_steps`` over a ``Session``), so checkouts can be compared on one
machine (``lab/sequence/step_overhead_ab.sh BEFORE AFTER`` interleaves two).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import llama

from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import random_drafter

PROMPT = list(range(3, 67))  # 64 cached tokens


def stand_in(layers: int, hidden: int, vocab: int) -> llama.Model:
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def timer(model, drafter, shape: BeamShape):
    """A function timing (one-token step, ReDrafter step) seconds at the prompt's length, and
    which decode core it runs."""
    try:
        try:
            from redrafter_mlx.backend.plan import build_decoder
        except ImportError:  # before the Verifier was named Decoder
            from redrafter_mlx.backend.plan import build_verifier as build_decoder

        try:
            from redrafter_mlx.core.decode.step import Decoding
        except ImportError:  # before #41
            from redrafter_mlx.core.decode.decoder import Decoding
        from redrafter_mlx.core.decode.mode import Mode
        from redrafter_mlx.core.serving.session import Session
        from redrafter_mlx.tuning.measure import time_steps
    except ImportError:  # the decode core before #31
        from redrafter_mlx.backend.plan import plan_for
        from redrafter_mlx.core.decode.accept import greedy
        from redrafter_mlx.core.decode.decoder import Decoder

        decoder = Decoder(model, greedy, drafter, shape, plan=plan_for())
        decoder.warm_up()
        cache = decoder.new_cache()
        decoder.prefill(cache, PROMPT)
        return (lambda reps: decoder.time_steps(cache, reps)), "Decoder"
    session = Session(build_decoder(model, drafter), None, Decoding(Mode.REDRAFTER, shape))
    next(session.steps(PROMPT))  # the prefill: the prompt is in the cache
    return (lambda reps: time_steps(session, reps)), "Session"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--beam-width", type=int, default=2)
    parser.add_argument("--beam-length", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=9, help="medians over this many rounds")
    parser.add_argument("--reps", type=int, default=8, help="steps timed per round")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = stand_in(args.layers, args.hidden, args.vocab)
    drafter = BeamDrafter(random_drafter(args.hidden, args.vocab, seed=1), model.model.embed_tokens)
    time, core = timer(model, drafter, BeamShape(args.beam_width, args.beam_length))
    time(2)  # warm-up
    rounds = [time(args.reps) for _ in range(args.rounds)]
    one, tree = (statistics.median(r[i] for r in rounds) * 1e3 for i in (0, 1))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "commit": commit,
        "layers": args.layers,
        "hidden": args.hidden,
        "shape": f"W{args.beam_width}L{args.beam_length}",
        "one_token_ms": round(one, 3),
        "redrafter_step_ms": round(tree, 3),
        "ratio": round(tree / one, 3),
        "device": str(mx.default_device()),
        "core": core,
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
