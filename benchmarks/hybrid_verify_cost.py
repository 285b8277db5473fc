"""Verify cost on hybrid stand-ins: a tree of T nodes against a one-token step, T = 1..16.

Random-weight models built with mlx-lm's own classes at one size (hidden 1024, 8 layers):
a Qwen3.5-style Gated DeltaNet hybrid (3 of 4 layers recurrent), a Nemotron-H-style Mamba2
hybrid, an LFM2-style short-convolution hybrid, and an attention-only Qwen3 of the same
size, all on the generic plan (the path Metal and CUDA run). A tree's recurrent layers run
depth by depth (``core/decode/recurrent.py``), so its cost grows with its depth as well as its size;
the trees here are at most 4 deep (L = 4): a chain of min(T, 4) nodes, the rest siblings
spread over depths 1..3. Interleaved medians, one model at a time:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/hybrid_verify_cost.py \\
        --out benchmarks/results/hybrid_verify_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from redrafter_mlx.backend.cpu.blas import blas_in_use
from redrafter_mlx.backend.plan import GENERIC_PLAN, make_forward
from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.tree import Tree, tree_mask
from redrafter_mlx.tuning.device import backend, cpu_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.families import build_config  # noqa: E402 (mlx-lm's classes, random weights)

SIZE = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "intermediate_size": 2816,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "vocab_size": 32000,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
STAND_INS = {
    "qwen3 (attention only)": {"model_type": "qwen3"},
    "qwen3_5 (Gated DeltaNet 3:1)": {
        "model_type": "qwen3_5",
        "full_attention_interval": 4,
        "linear_num_value_heads": 8,
        "linear_num_key_heads": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    },
    "nemotron_h (Mamba2 4 of 8)": {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": ["M", "-", "M", "-", "M", "*", "M", "-"],
        "attention_bias": False,
        "mamba_num_heads": 32,
        "mamba_head_dim": 64,
        "mamba_proj_bias": False,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "n_groups": 8,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
    },
    "lfm2 (short convolution 5:3)": {
        "model_type": "lfm2",
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 1024,
        "block_ff_dim": 2816,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [2, 5, 7],
    },
}


def tree_of(size: int, depth: int = 4) -> Tree:
    """A tree of ``size`` nodes at most ``depth`` deep: a chain of min(size, depth) nodes, then
    siblings hung under the chain's nodes at depths 1, 2, 3, 1, 2, ..."""
    chain = min(size, depth)
    parents = list(range(-1, chain - 1))
    for i in range(size - chain):
        parents.append(i % (chain - 1) if chain > 1 else 0)
    parents = np.array(parents)
    depths = np.zeros(size, np.int64)
    for node in range(1, size):
        depths[node] = depths[parents[node]] + 1
    ancestors = np.eye(size, dtype=bool)
    for node in range(size):
        p = parents[node]
        while p >= 0:
            ancestors[node, p] = True
            p = parents[p]
    unpack = np.arange(chain)[None]
    return Tree(np.arange(size) % 100 + 10, depths, parents, unpack, ancestors)


def seconds(forward, model, cache, tree: Tree) -> float:
    offset = cache.offset
    tic = time.perf_counter()
    hidden = forward(
        mx.array(tree.tokens),
        mx.array(offset + tree.depths),
        tree_mask(tree, offset) if tree.size > 1 else None,
        cache,
        tree=tree,
    )
    mx.eval(llm.lm_head(model, hidden), *cache.state())
    return time.perf_counter() - tic


def curve(model, sizes: list[int], context: int, repetitions: int) -> dict[int, float]:
    """Each size's verify time over the one-token step's (medians, interleaved)."""
    forward = make_forward(model, GENERIC_PLAN)
    cache = llm.new_sequence(model)
    prompt = [int(t) for t in np.arange(context) % 100 + 10]
    mx.eval(forward(mx.array(prompt), mx.arange(context), llm.CAUSAL, cache, compiled=False))
    cache.commit(prompt)
    times = {size: [] for size in sizes}
    one = tree_of(1)
    for rep in range(repetitions + 1):
        for size in sizes:
            tree = tree_of(size)
            pair = (seconds(forward, model, cache, one), seconds(forward, model, cache, tree))
            if rep:  # the first round warms up
                times[size].append(pair[1] / pair[0])
    return {size: statistics.median(ratios) for size, ratios in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(str(t) for t in range(1, 17)))
    p.add_argument("--context", type=int, default=128, help="cached tokens before the tree")
    p.add_argument("--repetitions", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/hybrid_verify_cost.json")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    for name, family in STAND_INS.items():
        model = build_config({**SIZE, **family}, seed=0)
        results[name] = curve(model, sizes, args.context, args.repetitions)
        row = " ".join(f"{results[name][t]:.2f}" for t in sizes)
        print(f"{name:32s} {row}", flush=True)
        del model
    report = {
        "environment": {
            "backend": backend(),
            "cpu": cpu_model(),
            "blas": blas_in_use(),
            "dtype": "float32",
            "mlx": mx.__version__,
        },
        "plan": "generic",
        "stand_in_size": SIZE,
        "context": args.context,
        "repetitions": args.repetitions,
        "ratio_to_one_token": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
