"""`redrafter-mlx eval-drafter`: mean tokens per step of a drafter in the real greedy decode loop.

For each beam shape (W, L, search width S and K prompt-lookup beams) of the grid, every prompt
is decoded greedily with ReDrafter for ``--max-tokens`` new tokens (or until end of sequence);
tokens/step is the number of tokens the speculative steps emitted divided by the number of steps
(the prefill's first token is not counted). The reported mean is pooled over prompts (total
tokens / total steps), and over the prompts of each category when the prompt file gives lines a
"category" (MT-Bench, Spec-Bench). With ``--lookup K`` each step also verifies up to K beams
copied from the context (:mod:`redrafter_mlx.core.decode.lookup`); the JSON counts every row's
accepted drafted tokens by source: "drafter", "lookup", or "both" (a beam of each held them). No
timing.

``--simulate`` is the cheap variant for sweeps: each prompt is decoded once by the real loop (at
W 2, L 5) to get its greedy path; every shape is then replayed along that path from the drafter's
beams at each position, and the lookup beams an n-gram index of the prompt and the path so far
proposes there, with no further target passes. Greedy decoding is exact, so the counts equal the
real loop's up to floating-point near-ties.

Default prompts: the MT-Bench first turns. MT-Bench is for final reports only; choose drafters and
hyper-parameters on held-out training-distribution prompts (``train`` writes
``heldout_prompts.jsonl`` into its cache folder).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from redrafter_mlx.cli import flags
from redrafter_mlx.cli.flags import fail
from redrafter_mlx.cli.progress import progress as progress_for
from redrafter_mlx.core.atomic import check_writable, os_error_text
from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.shape import shape_grid
from redrafter_mlx.io.prompts import MT_BENCH
from redrafter_mlx.training import evaluate as ev
from redrafter_mlx.tuning.profiles import fingerprint

EPILOG = """examples:
  # the shipped SmolLM2 drafter on 10 MT-Bench first turns, W 1-4 x L 3-5 (real decode loop)
  redrafter-mlx eval-drafter --num-prompts 10

  # 40 MT-Bench first turns (every 2nd: 5 per category), replayed along greedy paths
  redrafter-mlx eval-drafter --num-prompts 40 --every 2 --simulate --paths-cache runs/mtb.json

  # one shape, on the held-out prompts `train` left in its cache (its example in train --help),
  # JSON output
  redrafter-mlx eval-drafter --model models/demo --drafter drafters/demo \\
      --prompts runs/distill-demo/heldout_prompts.jsonl --beam-width 2 --beam-length 5 --json

  # 4 beams picked from a 16-beam search against the plain 4-beam search, L 5
  redrafter-mlx eval-drafter --simulate --beam-width 4 --beam-length 5 --search-width 1,16

  # Spec-Bench's prompts (github.com/hemingkx/Spec-Bench), every 10th line: 8 per category;
  # W 2, L 4 without and with 4 prompt-lookup beams, tokens/step per category too
  curl -LO https://raw.githubusercontent.com/hemingkx/Spec-Bench/main/data/spec_bench/question.jsonl
  awk 'NR % 10 == 1' question.jsonl > specbench48.jsonl
  redrafter-mlx eval-drafter --prompts specbench48.jsonl --num-prompts 48 --simulate \\
      --beam-width 2 --beam-length 4 --lookup 0,4
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
    p.add_argument("--drafter", help=flags.DRAFTER_HELP)
    p.add_argument(
        "--prompts",
        default=str(MT_BENCH),
        help="JSONL prompts: first of 'turns', or 'prompt'/'text', and an optional "
        "'category' (default: MT-Bench)",
    )
    p.add_argument("--num-prompts", type=positive, default=10)
    every = "use every k-th prompt of the file (spread over MT-Bench categories)"
    p.add_argument("--every", type=positive, default=1, help=every)
    p.add_argument("--max-tokens", type=positive, default=128, help="new tokens per prompt")
    p.add_argument("--max-prompt-tokens", type=positive, default=1024, help="skip longer prompts")
    grid = {
        "beam_width": [1, 2, 3, 4],
        "beam_length": [3, 4, 5],
        "search_width": [0],
        "lookup": [0],
    }
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
    conversations = flags.read_conversations(args.prompts, None, 1)
    texts = [c.turns[0] for c in conversations]
    categories = [c.category for c in conversations]
    if args.paths_cache and not args.simulate:
        fail("--paths-cache is read and written by --simulate only: add --simulate")
    if args.paths_cache:
        check_writable(Path(args.paths_cache).parent, "--paths-cache")
    runtime = flags.load_runtime(args.model, args.drafter, need_drafter=True)
    flags.say_drafter(runtime)
    model, tokenizer, drafter = runtime.model, runtime.tokenizer, runtime.drafter.drafter
    args.model, args.drafter = runtime.model_id, runtime.drafter_id
    shapes = shape_grid(
        args.beam_width, args.beam_length, search_widths=args.search_width, lookups=args.lookup
    )
    ev.check_shapes(drafter, shapes)

    def fits(prompt: str) -> bool:
        return len(tokenizer.encode(prompt)) <= args.max_prompt_tokens

    prompts, categories = select_prompts(texts, categories, args.every, args.num_prompts, fits)
    if not prompts:
        fail(f"{args.prompts}: no prompt of at most --max-prompt-tokens {args.max_prompt_tokens}")
    if not any(c is not None for c in categories):
        categories = None
    job = ev.Evaluation(
        model, tokenizer, drafter, prompts, shapes, args.max_tokens, categories, runtime.decoder
    )
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
        "categories": {
            c: categories.count(c) for c in dict.fromkeys(categories or ()) if c is not None
        },
        "results": rows,
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)


def select_prompts(
    texts: list[str],
    categories: list[str | None],
    every: int,
    num: int,
    fits: Callable[[str], bool],
) -> tuple[list[str], list[str | None]]:
    """Every ``every``-th prompt of ``texts`` that ``fits`` (``--max-prompt-tokens``), the first
    ``num`` of them, each with its category."""
    picked = [
        (text, category)
        for text, category in zip(texts[::every], categories[::every], strict=True)
        if text.strip() and fits(text)
    ][:num]
    return [text for text, _ in picked], [category for _, category in picked]


def run_with_progress(job: ev.Evaluation, args: argparse.Namespace, target_id: str) -> list[dict]:
    """:func:`~redrafter_mlx.training.evaluate.simulate_grid` (``--simulate``) or
    :func:`~redrafter_mlx.training.evaluate.evaluate` with progress on stderr (a bar on a
    terminal, else a line every few seconds)."""
    with progress_for() as bar:
        task = bar.add_task("decoding", total=len(job.prompts) * len(job.shapes))

        def progress(done: int) -> None:
            bar.advance(task, done)

        if args.simulate:
            return ev.simulate_grid(job, args.paths_cache, progress, target_id)
        return ev.evaluate(job, progress)


def _label(row: dict, *, length: bool = False) -> str:
    """``W=2``, plus `` L=4`` (``length``), `` search 8`` and `` lookup 4`` when set."""
    w, searched, k = row["width"], row["search_width"], row.get("lookup", 0)
    return (
        f"W={w}"
        + (f" L={row['length']}" if length else "")
        + (f" search {searched}" if searched > w else "")
        + (f" lookup {k}" if k else "")
    )


def print_table(report: dict) -> None:
    """Tokens/step as a (W, S, K) x L grid (rich table), then per category when the prompts
    have categories."""
    rows = report["results"]

    def key(r: dict) -> tuple[int, int, int]:
        return r["width"], r["search_width"], r.get("lookup", 0)

    searches = sorted({key(r) for r in rows})
    labels = {key(r): _label(r) for r in rows}
    lengths = sorted({r["length"] for r in rows})
    cell = {(*key(r), r["length"]): r["tokens_per_step"] for r in rows}
    mode = "simulated" if report.get("simulated") else "greedy decode loop"
    table = Table(title="mean tokens/step")
    table.add_column("W \\ L")
    for length in lengths:
        table.add_column(f"L={length}", justify="right")
    for search in searches:
        table.add_row(labels[search], *(f"{cell.get((*search, n)) or 0:.2f}" for n in lengths))
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
    print_categories(rows)


def print_categories(rows: list[dict]) -> None:
    """Tokens/step per prompt category (columns) of every shape (rows); nothing without
    categories."""
    categories = list(dict.fromkeys(c for r in rows for c in r.get("per_category", {})))
    if not categories:
        return
    table = Table(title="mean tokens/step per category")
    table.add_column("shape")
    for category in categories:
        table.add_column(category, justify="right")
    table.add_column("all", justify="right")
    for r in rows:
        per = r["per_category"]
        cells = [f"{per[c]:.2f}" if per.get(c) is not None else "-" for c in categories]
        table.add_row(_label(r, length=True), *cells, f"{r['tokens_per_step'] or 0:.2f}")
    Console().print(table)
