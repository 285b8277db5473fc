"""Verify cost against context length: one target forward over a T-node tree after S cached
tokens, against a one-token forward at the same S, on the CPU plan and the generic plan.

The cache holds S zero keys/values (timing does not depend on their values), so no prefill is
needed. ``cpu`` is the CPU plan as it runs (its attention kernels, ``backend/cpu/kernels.py``);
``cpu-split`` the same plan without them (attention in MLX ops, as through run 120);
``cpu-before`` its attention as it was before issue 46 (grouped query heads against all S + T
keys under the whole mask, ``mx.softmax``); each swapped in within the same process, so they
are measured interleaved. Medians; also one layer's attention
call alone (30 times, as a forward runs it) to show where the S-dependent cost sits:

    PYTHONPATH=. .venv/bin/python benchmarks/context_verify_cost.py \\
        --out benchmarks/results/context_verify_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

if __name__ == "__main__":
    reexec_with_blas()  # before MLX loads: the BLAS the console script runs with

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from redrafter_mlx.backend.cpu import fused  # noqa: E402
from redrafter_mlx.backend.cpu.kernels import cpu_kernels  # noqa: E402
from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN  # noqa: E402
from redrafter_mlx.core.decode.tree import pack_beams, tree_mask  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.tuning.measure import environment  # noqa: E402


def filled_cache(decoder, context: int):
    """A sequence holding ``context`` committed tokens: one token's K/V computed (each layer's
    buffers allocated), the rest zeros, which the next forward's room covers (as autotune's
    band timing fills it)."""
    sequence = decoder.new_sequence()
    mx.eval(decoder.forward(mx.zeros((1,), mx.int32), mx.zeros((1,), mx.int32), None, sequence))
    sequence.commit([0] * context)
    return sequence


def chain_tree(size: int):
    return pack_beams(np.arange(size)[None])


def forward_seconds(decoder, cache, size: int) -> float:
    tree = chain_tree(size)
    mask = tree_mask(tree, cache.offset) if size > 1 else None
    positions = mx.array(cache.offset + tree.depths)
    tic = time.perf_counter()
    hidden = decoder.forward(mx.array(tree.tokens), positions, mask, cache, tree=tree)
    mx.eval(decoder.forward.lm_head(hidden))
    return time.perf_counter() - tic


def attention_split(queries, keys, values, scale: float, mask, grouped: bool, kernels=None):
    """The CPU plan's attention without its kernels (run 120's)."""
    return ATTENTION["cpu"](queries, keys, values, scale, mask, grouped)


def attention_before(queries, keys, values, scale: float, mask, grouped: bool, kernels=None):
    """The CPU plan's attention before issue 46 (``grouped``; else MLX's fused kernel)."""
    if not grouped:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    _, heads, t, d = queries.shape
    kv_heads = keys.shape[1]
    grouped = (queries * scale).reshape(1, kv_heads, heads // kv_heads * t, d)
    scores = grouped @ keys.swapaxes(-1, -2)
    if mask is not None:
        scores = scores.reshape(1, kv_heads, heads // kv_heads, t, -1)
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        scores = scores.reshape(1, kv_heads, heads // kv_heads * t, -1)
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ values).reshape(1, heads, t, d)


def attention_run111(queries, keys, values, scale: float, mask, grouped: bool, kernels=None):
    """The CPU plan's attention as run 111 left it: a one-token step (no mask) always as one
    softmax, whatever the context."""
    if not grouped:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    if mask is None:
        return fused.softmax_attention(queries, keys, values, scale, mask)
    return fused.split_attention(queries, keys, values, scale, mask)


ATTENTION = {
    "cpu": fused.attention,
    "cpu-split": attention_split,
    "cpu-before": attention_before,
    "cpu-run111": attention_run111,
    "generic": fused.attention,
}


def attention_seconds(variant: str, context: int, size: int) -> float:
    """One layer's attention (9 query heads, 3 K/V heads, D 64) over the cache, 30 times."""
    q = mx.random.normal((1, 9, size, 64))
    k = mx.random.normal((1, 3, context + 64, 64))[..., : context + size, :]
    v = mx.random.normal((1, 3, context + 64, 64))[..., : context + size, :]
    mask = tree_mask(chain_tree(size), context) if size > 1 else None
    mx.eval(q, k, v)
    grouped = variant != "generic"
    kernels = cpu_kernels() if variant == "cpu" else None
    tic = time.perf_counter()
    mx.eval([ATTENTION[variant](q, k, v, 0.125, mask, grouped, kernels) for _ in range(30)])
    return time.perf_counter() - tic


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="512,2048,4096,8000")
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--variants", default="cpu,cpu-split,generic")
    p.add_argument("--out")
    args = p.parse_args()
    contexts = [int(s) for s in args.contexts.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = args.variants.split(",")
    plans = {
        "cpu": CPU_PLAN,
        "cpu-split": CPU_PLAN,
        "cpu-before": CPU_PLAN,
        "cpu-run111": CPU_PLAN,
        "generic": GENERIC_PLAN,
    }
    decoders = {}
    for name in {plans[v].llama_layers: v for v in variants}.values():  # one per plan
        runtime = rt.load_runtime(None, None, need_drafter=False, plan=plans[name])
        decoders[plans[name]] = runtime.decoder
    report = {"environment": environment(runtime), "forward_ms": {}, "attention_ms": {}}
    for context in contexts:
        caches = {plan: filled_cache(v, context) for plan, v in decoders.items()}
        times = {(v, s): [] for v in variants for s in sizes}
        attn = {(v, s): [] for v in variants for s in sizes}
        for rep in range(args.repetitions + 1):  # round 0 warms up (traces each size once)
            for variant in variants:
                fused.attention = ATTENTION[variant]  # what FusedForward.run calls
                plan = plans[variant]
                for size in sizes:
                    seconds = forward_seconds(decoders[plan], caches[plan], size)
                    one_layer = attention_seconds(variant, context, size)
                    if rep:
                        times[variant, size].append(seconds)
                        attn[variant, size].append(one_layer)
        fused.attention = ATTENTION["cpu"]
        for variant in variants:
            ms = {s: 1000 * statistics.median(times[variant, s]) for s in sizes}
            att = {s: 1000 * statistics.median(attn[variant, s]) for s in sizes}
            report["forward_ms"][f"{variant} S={context}"] = ms
            report["attention_ms"][f"{variant} S={context}"] = att
            row = " ".join(f"T={s}: {v:6.1f} ms ({v / ms[sizes[0]]:.2f}x)" for s, v in ms.items())
            print(f"{variant:10s} S={context:5d} forward  {row}", flush=True)
            row = " ".join(f"T={s}: {v:6.1f} ms" for s, v in att.items())
            print(f"{variant:10s} S={context:5d} 30x attn {row}", flush=True)
        del caches
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
