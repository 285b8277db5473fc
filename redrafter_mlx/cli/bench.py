"""`redrafter-mlx bench`: ReDrafter against our own plain (autoregressive) loop and mlx-lm,
same run, on each plan this machine has (:mod:`redrafter_mlx.tuning.measure` measures; this
command prints and writes the files).

On a Linux CPU the generic plan (the code Metal and CUDA run) is measured in a child process
started with ``REDRAFTER_CPU_TUNING=0`` (read at start-up, before MLX loads) and the same BLAS;
its figures come first: they are the ones that say something about a Mac."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console

from redrafter_mlx.backend.cpu import CPU_TUNING_ENV
from redrafter_mlx.backend.cpu.blas import NEXT_ENV, OPENBLAS, blas_in_use
from redrafter_mlx.backend.plan import GENERIC_PLAN, plan_for
from redrafter_mlx.cli import flags
from redrafter_mlx.cli.flags import fail
from redrafter_mlx.cli.progress import UNWRAPPED_WIDTH
from redrafter_mlx.cli.progress import console as stderr_console
from redrafter_mlx.cli.progress import progress as progress_for
from redrafter_mlx.core import atomic
from redrafter_mlx.core.decode.shape import BeamShape, shape_grid
from redrafter_mlx.core.decode.step import PHASES
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.io.prompts import MT_BENCH
from redrafter_mlx.tuning.measure import LOOKUP, REDRAFTER, BenchConfig, plan_name, run_bench
from redrafter_mlx.tuning.profiles import lookup_profile, resolve_shape

DEFAULT_WIDTHS = (1, 2)
DEFAULT_LENGTHS = (2, 3)

EXAMPLES = """examples:
  redrafter-mlx bench --quick                           # about 2 minutes: the picked shape
  redrafter-mlx bench                                   # 2 MT-Bench prompts, W 1,2 x L 2,3
  REDRAFTER_CPU_TUNING=0 redrafter-mlx bench --quick    # the generic plan alone
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
    "plan",
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


def write_outputs(results: list[dict], out: Path) -> list[Path]:
    """``bench.json`` (``{"plans": [...]}``, one result per plan), ``bench.csv`` (a row per
    plan and method) and the PNG plots into ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.csv"]
    atomic.write_text(paths[0], json.dumps({"plans": results}, indent=2, default=str) + "\n")
    rows = io.StringIO()
    writer = csv.DictWriter(rows, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for result in results:
        writer.writerows(_flat(row) | {"plan": result["plan"]} for row in result["results"])
    atomic.write_text(paths[1], rows.getvalue())
    return paths + plot_all(results, out)


def _flat(row: dict) -> dict:
    """A result row with its accepted sources as ``accepted_<source>`` columns."""
    sources = row.get("accepted_from") or {}
    return row | {f"accepted_{k}": v for k, v in sources.items()}


HEATMAPS = {  # file -> (the row's speedup, what it is over)
    "speedup_heatmap_plain.png": ("speedup_vs_autoregressive", "our plain loop"),
    "speedup_heatmap.png": ("speedup_vs_mlx-lm-stock", "mlx-lm"),
}


def plot_all(results: list[dict], out: Path) -> list[Path]:
    """Speedup heatmaps (W x L, a panel per plan) over our plain loop and over mlx-lm,
    per-phase stacked bars, tokens/step histograms (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = len(results) > 1  # methods named with their plan
    shaped = [
        r | {"method": f"{result['plan']} {r['method']}" if named else r["method"]}
        for result in results
        for r in result["results"]
        if r["beam_width"] is not None
    ]
    if not shaped:
        return []
    figures = {
        name: lambda plt, key=key, over=over: _heatmaps(plt, results, key, over)
        for name, (key, over) in HEATMAPS.items()
    }
    figures |= {"phases.png": _phases, "tokens_per_step.png": _histograms}
    paths = []
    for name, draw in figures.items():
        fig = draw(plt) if name in HEATMAPS else draw(plt, shaped)
        fig.tight_layout()
        atomic.write_with(out / name, lambda tmp, fig=fig: fig.savefig(tmp, dpi=110))
        plt.close(fig)
        paths.append(out / name)
    return paths


def _heatmaps(plt, results: list[dict], key: str, over: str):
    """One W x L heatmap of ``key`` per plan that has shaped rows, side by side."""
    panels = [r for r in results if any(row["beam_width"] is not None for row in r["results"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, result in zip(axes[0], panels, strict=True):
        rows = [r for r in result["results"] if r["beam_width"] is not None]
        _heatmap(fig, ax, rows, key, f"{PLANS[result['plan']]}\nspeedup over {over}")
    return fig


def _heatmap(fig, ax, rows: list[dict], key: str, title: str) -> None:
    # one cell per (W, L): the lowest floor, then the narrowest search
    floor = min(r.get("min_prob") or 0.0 for r in rows)
    rows = [r for r in rows if (r.get("min_prob") or 0.0) == floor]
    rows = [r for r in rows if r.get("search_width") in (None, r["beam_width"])] or rows
    widths = sorted({r["beam_width"] for r in rows})
    lengths = sorted({r["beam_length"] for r in rows})
    grid = np.full((len(widths), len(lengths)), np.nan)
    for r in rows:
        value = r.get(key, r.get("speedup_vs_mlx-lm"))  # no stock run: mlx-lm is stock
        grid[widths.index(r["beam_width"]), lengths.index(r["beam_length"])] = (
            np.nan if value is None else value
        )
    from matplotlib.colors import TwoSlopeNorm

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
    ax.set_title(title + (f" (min path prob {floor:g})" if floor else ""), fontsize=10)
    fig.colorbar(image, ax=ax)


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

# Presets: what bench runs unless a flag says otherwise. --quick: a representative figure,
# sized for about 2 minutes with SmolLM2 on a quiet 2-core x86 CPU, both plans (the shape the
# command picks and the baselines only: no lookup-alone row, no per-phase or cost timing)
FULL = {"num_prompts": 2, "max_tokens": 128, "repetitions": 2, "timed_prompts": 1}
QUICK = {"num_prompts": 3, "max_tokens": 48, "repetitions": 2, "timed_prompts": 0}

PLANS = {  # plan -> what its figures stand for
    "generic": "generic plan, the code a Mac runs",
    "cpu": "CPU plan, this Linux CPU's own kernels",
}

# Every column of the results table and what it says (printed above the tables and kept in
# docs/usage.md, which a test holds to this text)
COLUMNS = {
    "method": "ReDrafter's shape (W beam width, L beam length, s search width, p min path "
    "prob, k lookup beams; * the shape the command picks), lookup beams alone, or a baseline",
    "tok/s": "generated tokens per second (median over prompts of per-prompt medians)",
    "x plain": "speedup over our own plain loop (autoregressive: one token per step, same "
    "code and weights); below 1.00x speculation costs more than it gives",
    "x mlx-lm": "speedup over mlx-lm's stream_generate in the same process (on the CPU plan "
    "with our small-row BLAS kernel, as every product here is)",
    "x stock": "speedup over mlx-lm with the small-row kernel off: the BLAS alone, as a user "
    "of mlx-lm gets it (CPU plan only)",
    "spread": "run-to-run noise: median over prompts of (max - min) / median tokens/s",
    "TTFT s": "seconds to the first token (prompts of 1,024 tokens or more)",
    "tok/step": "tokens emitted per decode step (1 for plain decoding)",
    "from d/l/b": "accepted drafted tokens by source, percent: drafter beams / lookup beams / both",
    "tree": "mean tree nodes verified per step",
    "verify x": "time of one verify forward over the tree / a one-token forward",
    "bound": "tok/step / verify x: the speedup over plain decoding if drafting were free",
    "p50 ms": "median milliseconds per emitted token",
    "exact": "greedy tokens equal to our plain loop's (True: lossless)",
}


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Benchmark ReDrafter against our own plain decoding and mlx-lm (same run, "
        "interleaved), on each plan this machine has: on a Linux CPU the generic plan (the "
        "code a Mac runs, in a child process) and the CPU plan.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_model_args(parser)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a representative figure in about 2 minutes: the shape the command picks only, "
        f"{QUICK['num_prompts']} prompts, {QUICK['max_tokens']} tokens, no cost timing",
    )
    parser.add_argument(
        "--this-plan-only",
        action="store_true",
        help="measure only the plan this process runs (REDRAFTER_CPU_TUNING=0: the generic one)",
    )
    parser.add_argument("--generic-child", help=argparse.SUPPRESS)  # the parent's folder
    parser.add_argument(
        "--prompts",
        help="JSONL with 'prompt' or 'turns', and optionally 'category' for per-category rows "
        "(default: MT-Bench)",
    )
    parser.add_argument(
        "--num-prompts",
        type=flags.at_least(1),
        help=f"conversations to run (default {FULL['num_prompts']}, --quick "
        f"{QUICK['num_prompts']})",
    )
    parser.add_argument("--turns", type=int, choices=(1, 2), default=1, help="user turns each")
    flags.add_shape_args(parser, grid=dict.fromkeys(flags.SHAPE_FLAGS))
    parser.add_argument(
        "--max-tokens",
        type=flags.at_least(2),  # a speed needs decode steps after the prompt's token
        help=f"new tokens per generation (default {FULL['max_tokens']}, --quick "
        f"{QUICK['max_tokens']})",
    )
    parser.add_argument(
        "--repetitions",
        type=flags.at_least(1),
        help=f"measured runs per prompt (default {FULL['repetitions']})",
    )
    parser.add_argument(
        "--timed-prompts",
        type=flags.at_least(0),
        help="prompts for the separate per-phase timed runs (default "
        f"{FULL['timed_prompts']}, --quick 0)",
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


def with_presets(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the preset's value (``--quick`` or the full run) for each unset flag."""
    preset = QUICK if args.quick else FULL
    given = vars(args)
    return argparse.Namespace(**given | {k: v for k, v in preset.items() if given[k] is None})


def picked_shape(runtime: rt.Runtime, temp: float) -> BeamShape:
    """The shape ``generate`` takes without shape flags: this chip's profile, else the plan's
    default for the drafter's type (the one rule, ``resolve_shape``)."""
    return resolve_shape(runtime, temp=temp)[0]


def shapes_from_args(args: argparse.Namespace, runtime: rt.Runtime) -> list[BeamShape]:
    """The grid from flags; without shape flags the short default grid plus the decoder's
    default shape and the autotuned one (each with every ``--lookup`` K given); with
    ``--quick`` and no shape flags the picked shape alone."""
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
    if getattr(args, "quick", False) and not args.lookup:
        return [picked_shape(runtime, args.temp)]
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
    if args.generic_child:
        run_child(Path(args.generic_child))
        return
    args = with_presets(args)
    console = stderr_console()
    atomic.check_writable(args.out, "--out")
    conversations = flags.read_conversations(args.prompts, args.num_prompts, args.turns)
    results = []
    if not args.this_plan_only and plan_for() != GENERIC_PLAN:
        results.append(generic_in_child(args, console))
    results.append(bench_plan(args, conversations, console))
    out = Console(width=None if console.is_terminal else UNWRAPPED_WIDTH)
    out.print(legend(results))
    for result in results:
        out.print(results_table(result))
        if result.get("per_category"):
            out.print(category_table(result["per_category"]))
    for line in summary(results):
        out.print(line, highlight=False, markup=False)
    try:
        paths = write_outputs(results, Path(args.out))
    except OSError as e:
        fail(f"--out: {atomic.os_error_text(e, args.out)}")
    console.print("wrote " + ", ".join(str(p) for p in paths))


def bench_plan(args: argparse.Namespace, conversations: list, console: Console) -> dict:
    """Load the model and run the benchmark on the plan this process runs, with progress."""
    lookup = any(args.lookup or ())
    runtime = flags.load_runtime(args.model, args.drafter, need_drafter=not lookup)
    categories = [c.category for c in conversations]
    shapes = shapes_from_args(args, runtime)
    cfg = BenchConfig(
        shapes,
        [c.turns for c in conversations],
        args.max_tokens,
        args.repetitions,
        args.temp,
        args.seed,
        args.timed_prompts,
        categories=categories if any(categories) else None,
        drafter=runtime.drafter is not None,
        costs=not args.quick,
        lookup_alone=not args.quick,
    )
    name = PLANS[plan_name(runtime)]
    if (choice := getattr(runtime, "drafter_choice", None)) is not None:
        console.print(choice.describe(), highlight=False, markup=False)
    if short := sum(len(turns) < args.turns for turns in cfg.conversations):
        console.print(
            f"note: {short} of {len(conversations)} conversations have fewer than {args.turns} "
            "user turns; they run with the turns they have"
        )
    if len(conversations) < args.num_prompts:
        console.print(f"note: {args.prompts or MT_BENCH} holds {len(conversations)} conversations")
    with progress_for(console) as progress:  # a bar, or lines into a pipe or log
        task = [None]

        def on_phase(what: str, units: int) -> None:
            task[0] = progress.add_task(f"{name}: {what}", total=units)

        def on_run(method: str) -> None:
            progress.update(task[0], advance=1)

        result = run_bench(runtime, cfg, on_run, on_phase)
    result["environment"]["drafter_choice"] = flags.drafter_json(runtime)
    result["picked"] = None if lookup else picked_shape(runtime, args.temp).label
    return result


def generic_in_child(args: argparse.Namespace, console: Console) -> dict:
    """The generic plan's result, measured in a child process (``REDRAFTER_CPU_TUNING=0`` is
    read when the process starts), with the same BLAS preloaded: every product, ours and
    mlx-lm's, runs on the same library, and only the plan differs."""
    console.print(
        f"{PLANS['generic']}: measured first, in a child process with REDRAFTER_CPU_TUNING=0 "
        f"and the same BLAS ({blas_in_use().split(' + ')[0]})",
        highlight=False,
    )
    with tempfile.TemporaryDirectory(prefix="redrafter-bench-") as folder:
        given = vars(args) | {"generic_child": None}
        (Path(folder) / "args.json").write_text(json.dumps(given))
        command = [sys.executable, "-m", "redrafter_mlx", "bench", "--generic-child", folder]
        done = subprocess.run(command, env=generic_env(dict(os.environ)), check=False)
        result = Path(folder) / "result.json"
        if done.returncode or not result.exists():
            fail(
                f"the generic plan's run failed (exit status {done.returncode}, its error "
                "above); --this-plan-only measures the CPU plan alone"
            )
        return json.loads(result.read_text())


def run_child(folder: Path) -> None:
    """The generic plan's side of :func:`generic_in_child`: the parent's flags in, the
    result out (``result.json``, written whole or not at all)."""
    args = argparse.Namespace(**json.loads((folder / "args.json").read_text()))
    conversations = flags.read_conversations(args.prompts, args.num_prompts, args.turns)
    result = bench_plan(args, conversations, stderr_console())
    atomic.write_text(folder / "result.json", json.dumps(result, default=str))


def generic_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for the generic plan's child: ``REDRAFTER_CPU_TUNING=0`` and this process's
    BLAS preloaded without the small-row kernel (an x86-only CPU-plan part)."""
    preload = [
        p
        for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":")
        if p and "smallrows" not in Path(p).name
    ]
    if blas_in_use().startswith("OpenBLAS") and not any("openblas" in p for p in preload):
        preload.insert(0, OPENBLAS)  # loaded in-process (a library import), not preloaded
    child = {k: v for k, v in env.items() if k not in ("LD_PRELOAD", NEXT_ENV)}
    child[CPU_TUNING_ENV] = "0"
    if preload:
        child["LD_PRELOAD"] = ":".join(preload)
    return child


def legend(results: list[dict]):
    """The columns the tables show, each with what it says."""
    from rich.table import Table

    shown = {c.header for result in results for c in results_table(result).columns}
    table = Table(title="columns", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for column, meaning in COLUMNS.items():
        if column in shown:
            table.add_row(column, meaning)
    return table


def summary(results: list[dict]) -> list[str]:
    """Plain sentences per plan: the picked shape's speedups, and every shape slower than
    plain decoding."""
    lines = []
    for result in results:
        rows = {r["method"]: r for r in result["results"]}
        name = PLANS[result["plan"]]
        picked = rows.get(result.get("picked") or "")
        if picked is not None:
            lines.append(
                f"{name}: {picked['method']} (the shape the command picks) ran "
                f"{_fmt(picked.get('speedup_vs_autoregressive'), '{:.2f}x')} our plain loop "
                f"and {_fmt(stock_speedup(picked), '{:.2f}x')} mlx-lm"
            )
        slower = [
            f"{r['method']} ({r['speedup_vs_autoregressive']:.2f}x)"
            for r in result["results"]
            if r["kind"] in (REDRAFTER, LOOKUP) and (r.get("speedup_vs_autoregressive") or 1) < 1
        ]
        if slower:
            lines.append(
                f"{name}: SLOWER than plain decoding here: {', '.join(slower)}; "
                "`generate --autoregressive` is faster at these shapes"
            )
    return lines


def stock_speedup(row: dict) -> float | None:
    """Speedup over mlx-lm as its users run it: with the small-row kernel off where it was on."""
    return row.get("speedup_vs_mlx-lm-stock", row.get("speedup_vs_mlx-lm"))


def results_table(result: dict):
    """A rich table of one plan's result rows: speedup over our plain loop first."""
    from rich.table import Table

    env = result["environment"]
    table = Table(
        title=f"{PLANS[result.get('plan', 'cpu')]} | {env['device']} | {env['backend']} | "
        f"{env['blas']} | {env['dtype']} | {Path(env['model']).name}"
    )
    stock = any("speedup_vs_mlx-lm-stock" in row for row in result["results"])
    ttft = long_prompts(result)
    for col in (
        "method",
        "tok/s",
        "x plain",
        "x mlx-lm",
        *(["x stock"] if stock else []),
        "spread",
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
        mark = "*" if row["method"] == result.get("picked") else ""
        table.add_row(
            row["method"] + mark,
            f"{row['generation_tps']:.2f}",
            _fmt(row.get("speedup_vs_autoregressive"), "{:.2f}x"),
            _fmt(row.get("speedup_vs_mlx-lm"), "{:.2f}x"),
            *([_fmt(row.get("speedup_vs_mlx-lm-stock"), "{:.2f}x")] if stock else []),
            f"{row['rep_spread']:.0%}",
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

    table = Table(title="per category: tokens/step | tok/s | x plain")
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
