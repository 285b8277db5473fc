"""`redrafter-mlx eval-drafter`: mean tokens per step of a drafter in the real greedy decode loop.

For each beam shape (W, L, and search width S) of the grid, every prompt is decoded greedily
with ReDrafter for ``--max-tokens`` new tokens (or until end of sequence); tokens/step is the
number of tokens the speculative steps emitted divided by the number of steps (the prefill's
first token is not counted). The reported mean is pooled over prompts (total tokens / total
steps). No timing.

``--simulate`` is the cheap variant for sweeps: each prompt is decoded once by the real loop (at
W 2, L 5) to get its greedy path; every (W, L) is then replayed along that path from the drafter's
beams at each position, with no further target passes. Greedy decoding is exact, so the counts
equal the real loop's up to floating-point near-ties.

Default prompts: the MT-Bench first turns. MT-Bench is for final reports only; choose drafters and
hyper-parameters on held-out training-distribution prompts (``train`` writes
``heldout_prompts.jsonl`` into its cache folder).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from redrafter_mlx.cli import flags
from redrafter_mlx.cli.flags import fail, read_prompts
from redrafter_mlx.core import llm
from redrafter_mlx.core.atomic import check_writable, os_error_text
from redrafter_mlx.core.shape import shape_grid
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.io.prompts import MT_BENCH
from redrafter_mlx.training import evaluate as ev
from redrafter_mlx.tuning.profiles import fingerprint

EPILOG = """examples:
  # the shipped SmolLM2 drafter on 10 MT-Bench first turns, W 1-4 x L 3-5 (real decode loop)
  redrafter-mlx eval-drafter --num-prompts 10

  # 40 MT-Bench first turns (every 2nd: 5 per category), replayed along greedy paths
  redrafter-mlx eval-drafter --num-prompts 40 --every 2 --simulate --paths-cache runs/mtb.json

  # one shape, held-out ShareGPT prompts written by `train`, JSON output
  redrafter-mlx eval-drafter --drafter runs/drafter --prompts runs/cache/heldout_prompts.jsonl \\
      --beam-width 2 --beam-length 5 --json

  # 4 beams picked from a 16-beam search against the plain 4-beam search, L 5
  redrafter-mlx eval-drafter --simulate --beam-width 4 --beam-length 5 --search-width 1,16
"""


def setup_arg_parser() -> argparse.ArgumentParser:
    positive = flags.at_least(1)
    p = argparse.ArgumentParser(
        description="Mean tokens/step of a drafter with the real greedy ReDrafter decode loop, "
        "per beam shape (W, L).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="target model (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="drafter folder (default: the shipped SmolLM2 drafter)")
    p.add_argument(
        "--prompts",
        default=str(MT_BENCH),
        help="JSONL prompts: first of 'turns', or 'prompt'/'text' (default: MT-Bench)",
    )
    p.add_argument("--num-prompts", type=positive, default=10)
    every = "use every k-th prompt of the file (spread over MT-Bench categories)"
    p.add_argument("--every", type=positive, default=1, help=every)
    p.add_argument("--max-tokens", type=positive, default=128, help="new tokens per prompt")
    p.add_argument("--max-prompt-tokens", type=positive, default=1024, help="skip longer prompts")
    grid = {"beam_width": [1, 2, 3, 4], "beam_length": [3, 4, 5], "search_width": [0]}
    flags.add_shape_args(p, grid=grid)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--simulate",
        action="store_true",
        help="replay steps along each prompt's greedy path instead of running the "
        "decode loop (same counts up to float near-ties, far cheaper: for sweeps)",
    )
    p.add_argument("--paths-cache", help="with --simulate: JSON file caching greedy paths")
    return p


@flags.reports_errors
def main(args: argparse.Namespace) -> None:
    texts = [turns[0] for turns in read_prompts(args.prompts, None, 1)]
    if args.paths_cache and not args.simulate:
        fail("--paths-cache is read and written by --simulate only: add --simulate")
    if args.paths_cache:
        check_writable(Path(args.paths_cache).parent, "--paths-cache")
    runtime = rt.load_runtime(args.model, args.drafter, need_drafter=True)
    model, tokenizer, drafter = runtime.model, runtime.tokenizer, runtime.drafter.drafter
    args.model, args.drafter = runtime.model_id, runtime.drafter_id
    shapes = shape_grid(args.beam_width, args.beam_length, search_widths=args.search_width)
    ev.check_shapes(drafter, shapes)
    prompts = [
        p
        for p in texts[:: args.every]
        if p.strip() and len(tokenizer.encode(p)) <= args.max_prompt_tokens
    ][: args.num_prompts]
    if not prompts:
        fail(f"{args.prompts}: no prompt of at most --max-prompt-tokens {args.max_prompt_tokens}")
    job = ev.Evaluation(model, tokenizer, drafter, prompts, shapes, args.max_tokens)
    # the target's greedy paths depend on its weights (folder + files) and dtype
    target_id = f"{args.model} {fingerprint(args.model)} {llm.compute_dtype(model)}"
    try:
        rows = run_with_progress(job, args, target_id)
    except OSError as e:  # e.g. an unwritable --paths-cache
        fail(os_error_text(e))
    report = {
        "model": str(args.model),
        "drafter": str(args.drafter),
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "every": args.every,
        "max_tokens": args.max_tokens,
        "simulated": args.simulate,
        "results": rows,
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)


def run_with_progress(job: ev.Evaluation, args: argparse.Namespace, target_id: str) -> list[dict]:
    """:func:`~redrafter_mlx.training.evaluate.simulate_grid` (``--simulate``) or
    :func:`~redrafter_mlx.training.evaluate.evaluate` under a transient progress bar."""
    with Progress(transient=True) as bar:
        task = bar.add_task("decoding", total=len(job.prompts) * len(job.shapes))

        def progress(done: int) -> None:
            bar.advance(task, done)

        if args.simulate:
            return ev.simulate_grid(job, args.paths_cache, progress, target_id)
        return ev.evaluate(job, progress)


def print_table(report: dict) -> None:
    """Tokens/step as a W x L grid (rich table)."""
    rows = report["results"]
    searches = sorted({(r["width"], r["search_width"]) for r in rows})
    lengths = sorted({r["length"] for r in rows})
    cell = {(r["width"], r["search_width"], r["length"]): r["tokens_per_step"] for r in rows}
    mode = "simulated" if report.get("simulated") else "greedy decode loop"
    table = Table(title="mean tokens/step")
    table.add_column("W \\ L")
    for length in lengths:
        table.add_column(f"L={length}", justify="right")
    for w, searched in searches:
        label = f"W={w}" + (f" search {searched}" if searched > w else "")
        table.add_row(label, *(f"{cell.get((w, searched, n)) or 0:.2f}" for n in lengths))
    Console().print(table)
    Console().print(f"{report['num_prompts']} prompts x {report['max_tokens']} new tokens, {mode}")
    for r in rows:
        if r.get("real_tokens_per_step") is not None:
            Console().print(
                f"W={r['width']} L={r['length']}: real decode loop "
                f"{r['real_tokens_per_step']:.3f} tokens/step, simulated "
                f"{r['tokens_per_step']:.3f}"
            )
    digests = {r["output_digest"] for r in rows}
    note = "identical" if len(digests) == 1 else "DIFFER (near-tie argmax flips?)"
    Console().print(f"greedy outputs across shapes: {note}")
