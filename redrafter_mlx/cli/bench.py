"""`redrafter-mlx bench`: ReDrafter against mlx-lm and our own autoregressive path, same run
(:mod:`redrafter_mlx.tuning.measure` measures; this command prints and writes the files)."""

from __future__ import annotations

import argparse
import csv
import io
import json
from pathlib import Path

import numpy as np

from redrafter_mlx.cli import flags
from redrafter_mlx.cli.flags import fail
from redrafter_mlx.core import atomic
from redrafter_mlx.core.shape import BeamShape, shape_grid
from redrafter_mlx.core.step import PHASES
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.io.prompts import MT_BENCH
from redrafter_mlx.tuning.measure import BenchConfig, bench_methods, run_bench
from redrafter_mlx.tuning.profiles import lookup_profile

DEFAULT_WIDTHS = (1, 2)
DEFAULT_LENGTHS = (2, 3)

EXAMPLES = """examples:
  redrafter-mlx bench                                   # short: 2 MT-Bench prompts, W 1,2 x L 2,3
  redrafter-mlx bench --num-prompts 10 --beam-width 1,2,3,4 --beam-length 2,3,4,5 --out runs/b
  redrafter-mlx bench --num-prompts 5 --beam-width 1 --beam-length 2,3,4 --min-prob 0,0.3
  redrafter-mlx bench --num-prompts 5 --beam-width 4 --beam-length 5 --search-width 1,8,16
  redrafter-mlx bench --turns 2 --num-prompts 5 --beam-width 2 --beam-length 4
  # Spec-Bench's prompts (github.com/hemingkx/Spec-Bench), every 10th line: 8 per category
  curl -LO https://raw.githubusercontent.com/hemingkx/Spec-Bench/main/data/spec_bench/question.jsonl
  awk 'NR % 10 == 1' question.jsonl > specbench48.jsonl
  redrafter-mlx bench --prompts specbench48.jsonl --num-prompts 48 --beam-width 2 \\
      --beam-length 4 --lookup 0,4     # per category; lookup alone and with W2
  redrafter-mlx bench --model mlx-community/Qwen3-0.6B-4bit --lookup 4   # no drafter: lookup only
  redrafter-mlx bench --prompts specbench48.jsonl --temp 0.7 --seed 0 --repetitions 3
  REDRAFTER_NO_OPENBLAS=1 redrafter-mlx bench --num-prompts 1 --beam-width 1 --beam-length 3
  REDRAFTER_NO_SMALLROWS=1 redrafter-mlx bench --num-prompts 2   # without the small-row kernel
"""


CSV_FIELDS = (
    "method",
    "beam_width",
    "beam_length",
    "min_prob",
    "search_width",
    "lookup",
    "generation_tps",
    "generation_tps_p25",
    "generation_tps_p75",
    "rep_spread",
    "prompt_tps",
    "time_to_first_token_s",
    "speedup_vs_mlx-lm",
    "speedup_vs_mlx-lm_median_of_ratios",
    "speedup_vs_mlx-lm-stock",
    "speedup_vs_mlx-lm-stock_median_of_ratios",
    "speedup_vs_autoregressive",
    "speedup_vs_autoregressive_median_of_ratios",
    "tokens_per_step",
    "accepted_drafter",
    "accepted_lookup",
    "accepted_both",
    "mean_tree_size",
    "compression_p1",
    "compression_p50",
    "compression_p99",
    "verify_tokens",
    "verify_cost_ratio",
    "draft_cost_ratio",
    "speedup_bound",
    "syncs_per_step",
    "latency_p50_ms",
    "latency_p95_ms",
    "peak_memory_gb",
    "exact",
    "runs",
)


def write_outputs(result: dict, out: Path) -> list[Path]:
    """``bench.json``, ``bench.csv`` and the PNG plots into ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.csv"]
    atomic.write_text(paths[0], json.dumps(result, indent=2, default=str) + "\n")
    rows = io.StringIO()
    writer = csv.DictWriter(rows, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(_flat(row) for row in result["results"])
    atomic.write_text(paths[1], rows.getvalue())
    return paths + plot_all(result["results"], out)


def _flat(row: dict) -> dict:
    """A result row with its accepted sources as ``accepted_<source>`` columns."""
    sources = row.get("accepted_from") or {}
    return row | {f"accepted_{k}": v for k, v in sources.items()}


def plot_all(rows: list[dict], out: Path) -> list[Path]:
    """Speedup heatmap (W x L), per-phase stacked bars, tokens/step histograms (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shaped = [r for r in rows if r["beam_width"] is not None]
    paths = []
    for name, draw in (
        ("speedup_heatmap.png", _heatmap),
        ("phases.png", _phases),
        ("tokens_per_step.png", _histograms),
    ):
        fig = draw(plt, shaped)
        fig.tight_layout()
        atomic.write_with(out / name, lambda tmp, fig=fig: fig.savefig(tmp, dpi=110))
        plt.close(fig)
        paths.append(out / name)
    return paths


def _heatmap(plt, rows: list[dict]):
    # one cell per (W, L): the lowest floor, then the narrowest search
    floor = min(r.get("min_prob") or 0.0 for r in rows)
    rows = [r for r in rows if (r.get("min_prob") or 0.0) == floor]
    rows = [r for r in rows if r.get("search_width") in (None, r["beam_width"])] or rows
    widths = sorted({r["beam_width"] for r in rows})
    lengths = sorted({r["beam_length"] for r in rows})
    grid = np.full((len(widths), len(lengths)), np.nan)
    for r in rows:
        value = r.get("speedup_vs_mlx-lm")
        grid[widths.index(r["beam_width"]), lengths.index(r["beam_length"])] = (
            np.nan if value is None else value
        )
    from matplotlib.colors import TwoSlopeNorm

    size = (max(5.0, 0.9 * len(lengths) + 3), max(3.5, 0.5 * len(widths) + 2))
    fig, ax = plt.subplots(figsize=size)
    low, high = np.nanmin(grid), np.nanmax(grid)
    norm = TwoSlopeNorm(1.0, vmin=min(low, 0.99), vmax=max(high, 1.01))  # white = parity
    image = ax.imshow(grid, cmap="RdYlGn", norm=norm, origin="lower", aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(widths)), [str(w) for w in widths])
    ax.set_xlabel("beam length L")
    ax.set_ylabel("beam width W")
    title = "ReDrafter speedup over mlx-lm" + (f" (min path prob {floor:g})" if floor else "")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax)
    return fig


def _phases(plt, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(max(4, 0.7 * len(rows) + 2), 3.5))
    bottom = np.zeros(len(rows))
    for phase in PHASES:
        values = np.array([(r.get("phase_fraction") or {}).get(phase, 0.0) for r in rows])
        ax.bar([r["method"] for r in rows], values, bottom=bottom, label=phase)
        bottom += values
    ax.set_ylabel("fraction of step time (timed runs)")
    ax.set_title("Per-phase split of a ReDrafter step")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    ax.tick_params(axis="x", rotation=45)
    return fig


def _histograms(plt, rows: list[dict]):
    best = sorted(rows, key=lambda r: -r["generation_tps"])[:4]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    top = max((int(k) for r in best for k in r["accept_histogram"]), default=1)
    bar = 0.8 / max(len(best), 1)
    for i, r in enumerate(best):
        hist = r["accept_histogram"]
        steps = max(sum(hist.values()), 1)
        xs = np.arange(1, top + 1)
        ax.bar(
            xs + i * bar - 0.4 + bar / 2,
            [hist.get(str(k), 0) / steps for k in xs],
            bar,
            label=f"{r['method']} ({r['tokens_per_step']:.2f}/step)",
        )
    ax.set_xlabel("tokens emitted per step")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Tokens per step (fastest shapes)")
    ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------- CLI


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Benchmark ReDrafter against mlx-lm and autoregressive decoding (same run).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_model_args(parser)
    parser.add_argument(
        "--prompts",
        help="JSONL with 'prompt' or 'turns', and optionally 'category' for per-category rows "
        "(default: MT-Bench)",
    )
    parser.add_argument(
        "--num-prompts", type=flags.at_least(1), default=2, help="conversations to run"
    )
    parser.add_argument("--turns", type=int, choices=(1, 2), default=1, help="user turns each")
    flags.add_shape_args(parser, grid=dict.fromkeys(flags.SHAPE_FLAGS))
    parser.add_argument(
        "--max-tokens",
        type=flags.at_least(2),  # a speed needs decode steps after the prompt's token
        default=128,
        help="new tokens per generation",
    )
    parser.add_argument(
        "--repetitions", type=flags.at_least(1), default=2, help="measured runs per prompt"
    )
    parser.add_argument(
        "--timed-prompts",
        type=flags.at_least(0),
        default=1,
        help="prompts for the separate per-phase timed runs",
    )
    parser.add_argument(
        "--temp", type=flags.non_negative, default=0.0, help="temperature (0 = greedy)"
    )
    parser.add_argument("--seed", type=flags.at_least(0), default=0, help="sampling seed")
    parser.add_argument(
        "--out",
        default="bench-out",
        help="folder for JSON, CSV and PNGs (default: ./bench-out, its files replaced each run)",
    )
    return parser


def shapes_from_args(args: argparse.Namespace, runtime: rt.Runtime) -> list[BeamShape]:
    """The grid from flags; without shape flags the short default grid plus the decoder's
    default shape and the autotuned one (each with every ``--lookup`` K given)."""
    default = runtime.default_shape
    lookups = args.lookup or [default.lookup]
    if args.beam_width or args.beam_length or args.min_prob or args.search_width:
        widths = args.beam_width or [default.width]
        lengths = args.beam_length or [default.length]
        floors = args.min_prob or [default.min_prob]
        searches = args.search_width or [default.search_width]
        try:
            return shape_grid(widths, lengths, floors, searches, lookups)
        except ValueError as e:
            fail(str(e))
    shapes = shape_grid(DEFAULT_WIDTHS, DEFAULT_LENGTHS, lookups=lookups)
    if args.lookup:  # the short grid at each K given
        return shapes
    found = lookup_profile(runtime, temp=args.temp)
    for extra in (default, found and found[0]):
        if extra and extra not in shapes:
            shapes.append(extra)
    return shapes


@flags.reports_errors
def main(args: argparse.Namespace) -> None:
    from rich.console import Console

    from redrafter_mlx.cli.progress import progress as progress_for

    atomic.check_writable(args.out, "--out")
    conversations = flags.read_conversations(args.prompts, args.num_prompts, args.turns)
    lookup = any(args.lookup or ())
    runtime = flags.load_runtime(args.model, args.drafter, need_drafter=not lookup)
    categories = [c.category for c in conversations]
    cfg = BenchConfig(
        shapes_from_args(args, runtime),
        [c.turns for c in conversations],
        args.max_tokens,
        args.repetitions,
        args.temp,
        args.seed,
        args.timed_prompts,
        categories=categories if any(categories) else None,
        drafter=runtime.drafter is not None,
    )
    console = Console(stderr=True)
    if (choice := getattr(runtime, "drafter_choice", None)) is not None:
        console.print(choice.describe(), highlight=False, markup=False)
    if short := sum(len(turns) < args.turns for turns in cfg.conversations):
        console.print(
            f"note: {short} of {len(conversations)} conversations have fewer than {args.turns} "
            "user turns; they run with the turns they have"
        )
    if args.num_prompts and len(conversations) < args.num_prompts:
        console.print(f"note: {args.prompts or MT_BENCH} holds {len(conversations)} conversations")
    cases = sum(len(turns) for turns in cfg.conversations)
    total = cases * args.repetitions * len(bench_methods(cfg.shapes, drafter=cfg.drafter)) + 2
    with progress_for(console) as progress:  # a bar, or lines into a pipe or log
        task = progress.add_task("benchmarking", total=total)
        result = run_bench(
            runtime,
            cfg,
            lambda name: progress.update(task, advance=1, description=f"benchmarking ({name})"),
        )
    result["environment"]["drafter_choice"] = flags.drafter_json(runtime)
    out = Console(width=None if console.is_terminal else 150)
    out.print(results_table(result))
    if result.get("per_category"):
        out.print(category_table(result["per_category"]))
    try:
        paths = write_outputs(result, Path(args.out))
    except OSError as e:
        fail(f"--out: {atomic.os_error_text(e, args.out)}")
    console.print("wrote " + ", ".join(str(p) for p in paths))


def results_table(result: dict):
    """A rich table of the result rows."""
    from rich.table import Table

    env = result["environment"]
    table = Table(
        title=f"{env['device']} | {env['backend']} | {env['blas']} | {env['dtype']} | "
        f"{Path(env['model']).name}"
    )
    stock = any("speedup_vs_mlx-lm-stock" in row for row in result["results"])
    ttft = long_prompts(result)
    for col in (
        "method",
        "tok/s",
        "spread",
        "x mlx-lm",
        *(["x stock"] if stock else []),
        "x AR",
        *(["TTFT s"] if ttft else []),
        "tok/step",
        "from d/l/b",
        "tree",
        "verify x",
        "bound",
        "p50 ms",
        "exact",
    ):
        table.add_column(col, justify="left" if col == "method" else "right")
    for row in result["results"]:
        table.add_row(
            row["method"],
            f"{row['generation_tps']:.2f}",
            f"{row['rep_spread']:.0%}",
            _fmt(row.get("speedup_vs_mlx-lm"), "{:.2f}x"),
            *([_fmt(row.get("speedup_vs_mlx-lm-stock"), "{:.2f}x")] if stock else []),
            _fmt(row.get("speedup_vs_autoregressive"), "{:.2f}x"),
            *([_fmt(row.get("time_to_first_token_s"), "{:.2f}")] if ttft else []),
            f"{row['tokens_per_step']:.2f}",
            sources_cell(row.get("accepted_from")),
            _fmt(row.get("mean_tree_size"), "{:.1f}"),
            _fmt(row.get("verify_cost_ratio"), "{:.2f}"),
            _fmt(row.get("speedup_bound"), "{:.2f}x"),
            f"{row['latency_p50_ms']:.0f}",
            _fmt(row.get("exact"), "{}"),
        )
    return table


# Prompts from this many tokens (median) on get a time-to-first-token column: there a prompt's
# prefill takes seconds (JSON and CSV hold it always)
LONG_PROMPT = 1024


def long_prompts(result: dict) -> bool:
    """Whether the benchmark's prompts were long (median token count >= LONG_PROMPT)."""
    lengths = result["settings"].get("prompt_tokens") or [0]
    return float(np.median(lengths)) >= LONG_PROMPT


def category_table(per_category: dict[str, list[dict]]):
    """Tokens/step and tokens/s of each method per prompt category (rich table)."""
    from rich.table import Table

    table = Table(title="per category: tokens/step | tok/s | x AR")
    table.add_column("method")
    for category, rows in per_category.items():
        table.add_column(f"{category} ({rows[0]['prompts']})", justify="right")
    methods = [row["method"] for row in next(iter(per_category.values()))]
    for i, method in enumerate(methods):
        cells = []
        for rows in per_category.values():
            row = rows[i]
            speedup = _fmt(row.get("speedup_vs_autoregressive"), "{:.2f}x")
            cells.append(f"{row['tokens_per_step']:.2f} | {row['generation_tps']:.1f} | {speedup}")
        table.add_row(method, *cells)
    return table


def sources_cell(sources: dict | None) -> str:
    """``62/31/7``: percent of the accepted drafts held by drafter beams only, lookup beams
    only, both; ``-`` for a method that drafts nothing."""
    if not sources:
        return "-"
    total = sum(sources.values())
    if not total:
        return "0/0/0"
    return "/".join(f"{100 * sources[k] / total:.0f}" for k in ("drafter", "lookup", "both"))


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)
