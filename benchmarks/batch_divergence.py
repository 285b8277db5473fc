"""How often a greedy answer decoded in a batch differs from the same request decoded alone.

The batched verify forward (core/decode/joint.py) multiplies all the batch's rows by each weight in
one product; alone, a request's rows go through a product of their own. BLAS may round a
row's sums differently with the row count, so where the target's top two logits are nearly
tied the argmax can flip. For each prompt (MT-Bench and Spec-Bench dev first turns, chat
templated) this answers it alone and in a batch of ``--batch`` prompts (each answer still the
target's own: the batch accepts only tokens its forward chose), and counts the answers whose
tokens differ, with the first differing position:

    PYTHONPATH=. .venv/bin/python benchmarks/batch_divergence.py --dtype float32 --plan cpu \\
        --out benchmarks/results/batch/divergence_float32_cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()

import mlx.core as mx  # noqa: E402

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN, build_decoder  # noqa: E402
from redrafter_mlx.core.decode.accept import greedy  # noqa: E402
from redrafter_mlx.core.decode.mode import Mode  # noqa: E402
from redrafter_mlx.core.decode.step import Decoding  # noqa: E402
from redrafter_mlx.core.serving.scheduler import answer_together  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.io.prompts import MT_BENCH, load_prompts  # noqa: E402
from redrafter_mlx.tuning.measure import environment  # noqa: E402

DTYPES = {"float16": mx.float16, "float32": mx.float32}
SPECBENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench_dev.jsonl"


def answers(decoder, tokenizer, decoding, prompts: list[list[int]], n: int) -> list[list[int]]:
    done = answer_together(decoder, tokenizer, prompts, decoding, max_tokens=[n] * len(prompts))
    return [[t for r in answer for t in r.tokens] for answer in done]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--plan", choices=["generic", "cpu"], default="cpu")
    p.add_argument("--num-prompts", type=int, default=16, help="from each prompt set")
    p.add_argument("--specbench", default=str(SPECBENCH))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default="benchmarks/results/batch/divergence.json")
    args = p.parse_args()
    runtime = rt.load_runtime(None, None, need_drafter=True)
    dtype = DTYPES[args.dtype]
    runtime.model.set_dtype(dtype)
    mx.eval(runtime.model.parameters())
    plan = CPU_PLAN if args.plan == "cpu" else GENERIC_PLAN
    shape = CPU_PLAN.default_shape  # W1 L2 + one lookup beam: serve's default here
    runtime.drafter.drafter.bind_target(runtime.model)
    decoder = build_decoder(runtime.model, runtime.drafter, plan=plan)
    decoding = Decoding(Mode.REDRAFTER, shape, greedy)
    decoder.warm_up(decoding)
    texts = []
    for source in (MT_BENCH, args.specbench):
        texts += [turns[0] for turns in load_prompts(source, args.num_prompts, 1)]
    prompts = [rt.encode_chat(runtime, [{"role": "user", "content": t}]) for t in texts]
    tokenizer = runtime.tokenizer
    alone = [answers(decoder, tokenizer, decoding, [ids], args.max_tokens)[0] for ids in prompts]
    together = []
    for start in range(0, len(prompts), args.batch):
        group = prompts[start : start + args.batch]
        together += answers(decoder, tokenizer, decoding, group, args.max_tokens)
    rows = []
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        first = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        rows.append({"prompt": i, "tokens": len(a), "first_divergence": first})
    diverged = [r for r in rows if r["first_divergence"] is not None]
    summary = {
        "dtype": args.dtype,
        "plan": args.plan,
        "shape": shape.describe(),
        "batch": args.batch,
        "prompts": len(rows),
        "tokens": sum(r["tokens"] for r in rows),
        "diverged": len(diverged),
    }
    print(json.dumps(summary))
    report = {"environment": environment(runtime), "summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
