"""What each distillation stage costs per token, on one rank or several (`mlx.launch`): the
numbers to size a `redrafter-mlx train` run with.

Runs as the console script does (re-executed once with OpenBLAS and the small-row kernel
preloaded, where available), on the embedded SmolLM2-135M-Instruct (or ``--model``), with
the `train` command's own library calls and default drafter shape. The same work on any
number of ranks: self-generation answers the first ``--gen-prompts`` training prompts,
teacher forcing reads the first ``--teacher-convs`` training conversations (no token
budget, so no rank's work is cut off), then ``--steps`` timed training steps of the global
batch ``--batch-size`` (after 2 untimed ones), and on several ranks the median time of the
gradient exchange alone (after the ranks line up: a step's exchange also waits for the
slowest). Rank 0 writes the JSON:

    .venv/bin/python benchmarks/distributed_cost.py --data sharegpt.json \\
        --out benchmarks/results/distributed_cost-1.json
    sleep infinity | .venv/bin/mlx.launch --hosts 127.0.0.1 -n 2 --backend ring -- \\
        .venv/bin/python benchmarks/distributed_cost.py --data sharegpt.json \\
        --out benchmarks/results/distributed_cost-2.json

(``sleep infinity |``: without a terminal, mlx.launch polls a closed stdin in a busy loop
that takes a core.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()  # before MLX loads: the BLAS the console script runs with

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from redrafter_mlx.backend.cpu.blas import blas_in_use  # noqa: E402
from redrafter_mlx.cli import train as cli  # noqa: E402
from redrafter_mlx.io.embedded import default_model_path  # noqa: E402
from redrafter_mlx.io.load import load_target  # noqa: E402
from redrafter_mlx.training.cache import Cache  # noqa: E402
from redrafter_mlx.training.data import read_conversations, split_conversations  # noqa: E402
from redrafter_mlx.training.examples import Examples, frequent_tokens  # noqa: E402
from redrafter_mlx.training.extract import extract  # noqa: E402
from redrafter_mlx.training.loop import batch_rows  # noqa: E402
from redrafter_mlx.training.ranks import Ranks  # noqa: E402
from redrafter_mlx.training.trainer import build_trainer  # noqa: E402


def timed_extract(model, tokenizer, convs, folder: Path, opts, ranks: Ranks) -> dict:
    """Extract ``convs`` whole into a new cache at ``folder``: tokens and seconds (all ranks)."""
    if ranks.lead:
        shutil.rmtree(folder, ignore_errors=True)
    ranks.sum(np.zeros(1, np.int64))  # removed before anyone opens it
    cache = Cache.open(folder, {"benchmark": opts.source})
    ranks.sum(np.zeros(1, np.int64))  # every rank starts the clock together
    start = time.perf_counter()
    extract(model, tokenizer, convs, cache, "train", 10**12, opts, ranks)
    seconds = time.perf_counter() - start
    data = cache.load("train")
    tokens, answers = int(data["tokens"].shape[0]), int(data["mask"].sum())
    return {
        "conversations": len(convs),
        "tokens": tokens,
        "answer_tokens": answers,
        "seconds": round(seconds, 2),
        "tokens_per_second": round(tokens / seconds, 1),
        "answer_tokens_per_second": round(answers / seconds, 1),
        "ms_per_1k_tokens": round(seconds / tokens * 1e6, 1),
    }


def timed_training(model, cache: Cache, args, ranks: Ranks) -> dict:
    """``args.steps`` training steps (after 2 untimed) of the default drafter on ``cache``."""
    flags = cli.setup_arg_parser().parse_args(["--batch-size", str(args.batch_size)])
    opts = replace(cli.train_options(flags), quiet=True)
    data = cache.load("train")
    examples = Examples.build(data, opts.positions)
    trainer = build_trainer(model, frequent_tokens(data, opts.draft_vocab), opts, 10**6)
    for step in range(2):
        trainer.step(examples, batch_rows(examples, step, opts), ranks)
    trainer.comm_seconds = 0.0
    ranks.sum(np.zeros(1, np.int64))
    start = time.perf_counter()
    for step in range(2, 2 + args.steps):
        trainer.step(examples, batch_rows(examples, step, opts), ranks)
    seconds = time.perf_counter() - start
    positions = args.steps * opts.batch_size
    params = sum(v.size for _, v in tree_flatten(trainer.drafter.trainable_parameters()))
    return {
        "trained_parameters": params,
        "transfer_ms": transfer_ms(params, ranks),
        "steps": args.steps,
        "batch_size": opts.batch_size,
        "positions": opts.positions,
        "seconds": round(seconds, 2),
        "positions_per_second": round(positions / seconds, 1),
        "ms_per_step": round(seconds / args.steps * 1e3, 1),
        "exchange_ms_per_step": round(trainer.comm_seconds / args.steps * 1e3, 2),
    }


def transfer_ms(params: int, ranks: Ranks) -> float | None:
    """The exchange alone: the median time of averaging a gradient of ``params`` floats
    after the ranks have lined up (a step's exchange also waits for the slowest rank)."""
    if ranks.size == 1:
        return None
    grads, times = mx.zeros((params + 1,)), []  # + the loss
    for _ in range(11):
        ranks.sum(np.zeros(1, np.int64))
        start = time.perf_counter()
        mx.eval(nn.average_gradients(grads, group=ranks.group))
        times.append(time.perf_counter() - start)
    return round(float(np.median(times[1:])) * 1e3, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--data", required=True, help="ShareGPT JSON (the `train` default corpus)")
    p.add_argument("--work", default="/tmp/redrafter-distributed-cost", help="cache folders")
    p.add_argument("--gen-prompts", type=int, default=128)
    p.add_argument("--gen-batch", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--teacher-convs", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=512, help="tokens per record at most")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    ranks = Ranks.launched()
    model, tokenizer, _ = load_target(args.model or default_model_path())
    _, training = split_conversations(read_conversations(args.data), 0, 200)
    flags = cli.setup_arg_parser().parse_args(["--gen-batch", str(args.gen_batch)])
    base = replace(cli.extract_options(flags), quiet=True, cache_max_gb=1e6)
    base = replace(base, max_seq_len=args.max_seq_len)
    self_opts = replace(base, source="self", gen_tokens=args.gen_tokens)
    teacher_opts = replace(base, source="data")
    work = Path(args.work)
    result = {
        "ranks": ranks.size,
        "model": str(args.model or "embedded SmolLM2-135M-Instruct"),
        "blas": blas_in_use(),
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        "load_before": os.getloadavg()[0],
        "self_generation": timed_extract(
            model, tokenizer, training[: args.gen_prompts], work / "self", self_opts, ranks
        ),
        "teacher_forcing": timed_extract(
            model, tokenizer, training[: args.teacher_convs], work / "data", teacher_opts, ranks
        ),
    }
    result["training"] = timed_training(model, Cache.existing(work / "data"), args, ranks)
    result["load_after"] = os.getloadavg()[0]
    if ranks.lead:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result))


if __name__ == "__main__":
    main()
