"""Where a decode step's time goes: the target forward at T = 1 and 2 against its parts.

Interleaved repetitions in one process, medians, after ``--context`` cached tokens:

- ``forward``: the decode forward + LM head over T tokens, built and evaluated (a step's verify);
- ``build``: the Python time to build that forward's graph (before evaluation);
- ``weights``: the same projections alone (stacked q/k/v and gate/up, o, down, LM head; the
  forward's own ``W @ x.T`` form at 2-3 rows without the small-row kernel): what reading the
  weights costs, with the bandwidth it implies;
- ``attention``: every layer's attention over the cache alone (the forward's own kernel);
- ``draft``: one W = 1, L = 2 beam search of the drafter (``--drafter``; default: the shipped one).

    .venv/bin/python benchmarks/step_breakdown.py --out benchmarks/results/step_breakdown.json

Like the CLI, it re-executes itself with OpenBLAS and the small-row kernel preloaded
(``redrafter_mlx/blas.py``; ``REDRAFTER_NO_SMALLROWS=1`` / ``REDRAFTER_NO_OPENBLAS=1`` opt out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

if __name__ == "__main__":
    reexec_with_blas()

import mlx.core as mx  # noqa: E402 (after the re-exec: MLX must load the preloaded BLAS)

from redrafter_mlx.backend.cpu.fused import attention  # noqa: E402
from redrafter_mlx.backend.plan import CPU_PLAN  # noqa: E402
from redrafter_mlx.core.decode import llm  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.tuning.measure import environment  # noqa: E402


def _seconds(fn) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def _forward(forward, cache, count: int):
    """The decode forward + LM head over ``count`` tokens after the cache (lazy)."""
    positions = mx.arange(cache.offset, cache.offset + count)
    mask = llm.chain_mask(cache.offset, count) if count > 1 else None
    hidden = forward(mx.zeros((count,), mx.int32), positions, mask, cache)
    return forward.lm_head(hidden)


def _weights(forward) -> list[mx.array]:
    """The matrices a decode forward multiplies by (stacked where the forward stacks them:
    the fused forward's ``layers.qkv`` / ``layers.gate_up``, else each projection's own)."""
    layers = forward.model.model.layers
    fused = getattr(forward, "layers", None)  # a FusedForward's compiled, stacked layers
    qkvs = fused.qkv if fused is not None else [None] * len(layers)
    gate_ups = fused.gate_up if fused is not None else [None] * len(layers)
    matrices = []
    for layer, qkv, gate_up in zip(layers, qkvs, gate_ups, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        matrices += (
            [qkv]
            if qkv is not None
            else [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        )
        matrices.append(attn.o_proj.weight)
        matrices += [gate_up] if gate_up is not None else [mlp.gate_proj.weight, mlp.up_proj.weight]
        matrices.append(mlp.down_proj.weight)
    return [*matrices, forward.model.model.embed_tokens.weight]


def _products(matrices: list[mx.array], count: int) -> list[mx.array]:
    """Each matrix times ``count`` rows of its input width, as the forward does it."""
    outs = []
    for w in matrices:
        x = mx.ones((count, w.shape[1]))
        outs.append(w @ x.T if count in CPU_PLAN.transposed_rows else x @ w.T)
    return outs


def _attention(model, cache, count: int) -> list[mx.array]:
    """Every layer's attention for ``count`` new tokens over the cache (lazy)."""
    attn = model.model.layers[0].self_attn
    d = cache.kv.keys[0].shape[-1]
    queries = mx.ones((1, attn.n_heads, count, d))
    end = cache.offset + count
    mask = llm.chain_mask(cache.offset, count) if count > 1 else None
    cpu = mx.default_device() == mx.cpu
    return [
        attention(queries, k[..., :end, :], v[..., :end, :], attn.scale, mask, cpu)
        for k, v in zip(cache.kv.keys, cache.kv.values, strict=True)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--drafter")
    p.add_argument("--context", type=int, default=256, help="cached tokens before each forward")
    p.add_argument("--repetitions", type=int, default=15)
    p.add_argument("--out", default="benchmarks/results/step_breakdown.json")
    args = p.parse_args()
    runtime = rt.load_runtime(args.model, args.drafter, need_drafter=True)
    model, drafter = runtime.model, runtime.drafter
    forward = runtime.decoder.forward  # the device plan's decode forward
    cache = runtime.decoder.new_sequence()
    tokens = mx.arange(args.context) % 100 + 10
    prefix = llm.chain_mask(0, args.context)
    mx.eval(forward(tokens, mx.arange(args.context), prefix, cache, compiled=False))
    cache.commit(tokens.tolist())
    for count in (1, 2):
        mx.eval(_forward(forward, cache, count))  # trace the compiled blocks
    matrices = _weights(forward)
    megabytes = sum(w.nbytes for w in matrices) / 1e6
    context = mx.zeros((model.args.hidden_size,), llm.compute_dtype(model))

    def build(count: int) -> float:
        tic = time.perf_counter()
        logits = _forward(forward, cache, count)
        seconds = time.perf_counter() - tic
        mx.eval(logits)
        return seconds

    parts = {"draft": lambda: mx.eval(drafter(context, mx.array(10), width=1, length=2))}
    for count in (1, 2):
        parts[f"forward_{count}"] = lambda c=count: mx.eval(_forward(forward, cache, c))
        parts[f"build_{count}"] = lambda c=count: build(c)
        parts[f"weights_{count}"] = lambda c=count: mx.eval(_products(matrices, c))
        parts[f"attention_{count}"] = lambda c=count: mx.eval(_attention(model, cache, c))
    times = {name: [] for name in parts}
    for rep in range(args.repetitions + 1):
        for name, fn in parts.items():
            seconds = fn() if name.startswith("build") else _seconds(fn)
            if rep:  # the first round is warm-up
                times[name].append(seconds)
    ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    for name, value in ms.items():
        print(f"{name:12s} {value:6.2f} ms", flush=True)
    for count in (1, 2):
        took = ms[f"weights_{count}"]
        rate = megabytes / took
        print(f"weights at T={count}: {megabytes:.0f} MB in {took:.1f} ms = {rate:.1f} GB/s")
    report = {
        "environment": environment(runtime),
        "context": args.context,
        "repetitions": args.repetitions,
        "weight_megabytes": megabytes,
        "median_ms": ms,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
