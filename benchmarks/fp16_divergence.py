"""How often greedy ReDrafter output leaves the autoregressive output in a half-precision dtype
or with a quantized target, and how close the target's own top two logits were where it first
does.

In float32 the two are equal token for token (the tests assert it). In float16 or bfloat16 a
verify forward over T tree nodes and a one-token forward run different kernels (on a GPU:
qmm vs qmv, gemm vs gemv, full vs vector attention), whose roundings differ, so where the
target's top two logits are nearly tied the argmax can flip. For each prompt this runs both
greedy decodings from the same weights, finds the first position where they differ, and
reports the autoregressive run's logit gap (top-1 minus top-2) there, recomputed with
mlx-lm's own forward over the prompt and the agreed prefix:

    .venv/bin/python benchmarks/fp16_divergence.py --dtype float16 --num-prompts 20 \\
        --out benchmarks/results/fp16_divergence.json

``--quantize 4`` (or 8) quantizes the target in memory after the cast, with mlx-lm's own
``quantize_model`` (group ``--group-size``, 64 as mlx-community's folders): its scales and
activations are then in ``--dtype``, as an mlx-community 4-bit folder's are in its dtype. The
drafter stays unquantized, bound to the quantized target's embedding and LM head as a
quantized folder's drafter is. ``--quick``: 5 prompts, 48 tokens each.

It runs the generic plan (the path Metal and CUDA run) unless ``--plan cpu``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import quantize_model

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN, build_decoder
from redrafter_mlx.core.decode.accept import greedy
from redrafter_mlx.core.decode.decoder import Decoder
from redrafter_mlx.core.decode.llm import embedding
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.step import Decoding
from redrafter_mlx.core.decode.stream import decode_steps
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.io.prompts import MT_BENCH, load_prompts
from redrafter_mlx.tuning.measure import environment

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def tokens(decoder: Decoder, decoding: Decoding, prompt: list[int], n: int) -> list[int]:
    steps = decode_steps(decoder, decoder.new_sequence(), prompt, decoding)
    out: list[int] = []
    for step in steps:
        out += step.tokens
        if len(out) >= n:
            return out[:n]
    return out


def logit_gap(model, ids: list[int]) -> float:
    """Top-1 minus top-2 logit of the target's next token after ``ids`` (mlx-lm's forward)."""
    logits = model(mx.array(ids)[None])[0, -1].astype(mx.float32)
    top2 = mx.sort(logits)[-2:]
    return float(top2[1] - top2[0])


def prepare(runtime: rt.Runtime, dtype: mx.Dtype, bits: int | None, group_size: int):
    """Cast the target and drafter to ``dtype``, quantize the target to ``bits`` (None: not)
    -> the drafter bound to the target as it now is."""
    runtime.model.set_dtype(dtype)
    runtime.drafter.drafter.set_dtype(dtype)
    if bits:
        quantize_model(runtime.model, {}, group_size, bits)
    drafter = runtime.drafter.drafter
    drafter.bind_target(runtime.model)  # its head rows from the target's (quantized) head
    mx.eval(runtime.model.parameters(), drafter.parameters())
    return BeamDrafter(drafter, embedding(runtime.model))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--drafter")
    p.add_argument("--dtype", choices=list(DTYPES), default="float16")
    p.add_argument("--quantize", type=int, choices=[4, 8], help="target bits (default: none)")
    p.add_argument("--group-size", type=int, default=64, help="quantization group (--quantize)")
    p.add_argument("--plan", choices=["generic", "cpu"], default="generic")
    p.add_argument("--prompts", default=str(MT_BENCH))
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--beam-width", type=int, default=2)
    p.add_argument("--beam-length", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="5 prompts, 48 tokens each")
    p.add_argument("--out", default="benchmarks/results/fp16_divergence.json")
    args = p.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens = 5, 48
    runtime = rt.load_runtime(args.model, args.drafter, need_drafter=True)
    if args.quantize and "quantization" in runtime.config:
        p.error(f"--quantize: {args.model} is quantized already")
    drafter = prepare(runtime, DTYPES[args.dtype], args.quantize, args.group_size)
    plan = CPU_PLAN if args.plan == "cpu" else GENERIC_PLAN
    shape = BeamShape(args.beam_width, args.beam_length)
    # built after the cast: a forward's compiled layers hold the weights they were built with
    decoder = build_decoder(runtime.model, drafter, plan=plan)
    plain = Decoding(Mode.AUTOREGRESSIVE, shape, greedy)
    fast = Decoding(Mode.REDRAFTER, shape, greedy)
    rows = []
    prompts = [turns[0] for turns in load_prompts(args.prompts, args.num_prompts, 1)]
    for i, text in enumerate(prompts):
        ids = rt.encode_chat(runtime, [{"role": "user", "content": text}])
        want = tokens(decoder, plain, ids, args.max_tokens)
        got = tokens(decoder, fast, ids, args.max_tokens)
        first = next((k for k, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
        row = {"prompt": i, "tokens": len(want), "first_divergence": first}
        if first is not None:
            row["logit_gap"] = logit_gap(runtime.model, ids + want[:first])
        rows.append(row)
        print(json.dumps(row), flush=True)
    diverged = [r for r in rows if r["first_divergence"] is not None]
    gaps = [r["logit_gap"] for r in diverged]
    summary = {
        "dtype": args.dtype,
        "quantize": f"{args.quantize}-bit, group {args.group_size}" if args.quantize else None,
        "plan": args.plan,
        "shape": f"W{shape.width} L{shape.length}",
        "prompts": len(rows),
        "tokens_each": args.max_tokens,
        "diverged": len(diverged),
        "divergence_rate": len(diverged) / max(len(rows), 1),
        "median_first_divergence": statistics.median(r["first_divergence"] for r in diverged)
        if diverged
        else None,
        "max_logit_gap_at_divergence": max(gaps) if gaps else None,
        "median_logit_gap_at_divergence": statistics.median(gaps) if gaps else None,
    }
    print(json.dumps(summary))
    report = {"environment": environment(runtime), "summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
