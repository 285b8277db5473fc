"""`redrafter-mlx autotune`: the fastest beam shape (W, L) for this chip, model and drafter
(:mod:`redrafter_mlx.tuning.search` searches; profiles are kept by
:mod:`redrafter_mlx.tuning.profiles`). Sampling runs use the sampling profile, else the greedy
one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from rich.table import Table

from redrafter_mlx.cli import flags
from redrafter_mlx.cli.flags import fail, read_prompts
from redrafter_mlx.cli.progress import console as stderr_console
from redrafter_mlx.cli.progress import progress as progress_for
from redrafter_mlx.core.atomic import check_writable, os_error_text
from redrafter_mlx.core.decode.shape import shape_grid
from redrafter_mlx.tuning.device import chip_info
from redrafter_mlx.tuning.measure import AUTOREGRESSIVE, REDRAFTER, Method, measure, warm_up
from redrafter_mlx.tuning.profiles import (
    SAMPLING,
    entry_shape,
    read_store,
    runtime_identity,
    save_profile,
    store_path,
    warn,
)
from redrafter_mlx.tuning.search import (
    CONTEXTS,
    DEFAULT_LENGTHS,
    DEFAULT_WIDTHS,
    FINALISTS,
    HELDOUT_PROMPTS,
    SearchResult,
    choose_bands,
    context_costs,
    full_grid,
    halving_runs,
    heldout_prompt_ids,
    make_measure,
    observed_tokens_per_step,
    plain_gain,
    profile_entry,
    successive_halving,
)

EXAMPLES = """examples:
  redrafter-mlx autotune                          # embedded SmolLM2 + its drafter
  redrafter-mlx autotune --model models/demo --drafter drafters/demo   # see train --help
  redrafter-mlx autotune --beam-width 1,2,3,4 --beam-length 3,4,5 --max-tokens 32
  redrafter-mlx autotune --beam-width 1,2 --beam-length 2,3,4 --min-prob 0,0.2,0.3
  redrafter-mlx autotune --beam-width 2,4 --beam-length 4,5 --search-width 1,8,16
  redrafter-mlx autotune --temp 0.7                # the shape for sampled chats (--temp > 0)
  # your own prompts, one JSON object per line ("prompt", "text" or "turns"), to tune for your
  # workload (prompt-lookup beams pay where answers repeat the prompt)
  printf '%s\\n' '{"prompt": "Explain what a hash map is."}' '{"prompt": "Write a limerick."}' \\
      > my_prompts.jsonl
  redrafter-mlx autotune --prompts my_prompts.jsonl --num-prompts 2 --lookup 0,2,4,8
  redrafter-mlx autotune --full-grid --repetitions 2   # exhaustive grid, for comparison
  redrafter-mlx autotune --show                   # stored profiles
"""


def prompt_texts(path: str | None) -> list[str]:
    """First user turns of a JSONL prompt file (``turns``/``prompt``/``text``, as ``bench``
    reads), or the built-in held-out prompts; SystemExit with one line for a bad file."""
    if path is None:
        return list(HELDOUT_PROMPTS)

    return [turns[0] for turns in read_prompts(path, None, 1)]


TABLE_COLUMNS = {  # row key of :func:`table` -> column of the printed table
    "beam_width": "W",
    "beam_length": "L",
    "min_prob": "p",
    "search_width": "S",
    "lookup": "K",
    "runs": "runs",
    "tokens_per_step": "tok/step",
    "mean_tree_size": "tree",
    "measured_tps": "measured tok/s",
    "estimated_tps": "estimated tok/s",
}


# ---------------------------------------------------------------- CLI


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Find the fastest ReDrafter beam shape (W, L) on this machine.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_model_args(parser)
    flags.add_shape_args(
        parser,
        grid={
            "beam_width": list(DEFAULT_WIDTHS),
            "beam_length": list(DEFAULT_LENGTHS),
            "min_prob": [0.0],
            "search_width": [0],
            "lookup": [0, 4],
        },
    )
    parser.add_argument(
        "--max-tokens", type=flags.at_least(8), default=48, help="new tokens per run"
    )
    parser.add_argument(
        "--num-prompts",
        type=flags.at_least(1),
        default=4,
        help="prompts to cycle through (default 4; the built-in prompts are "
        f"{len(HELDOUT_PROMPTS)})",
    )
    parser.add_argument(
        "--prompts",
        help="JSONL of your own prompts ('turns', 'prompt' or 'text'; first turns), to tune "
        "for your workload (default: short built-in held-out prompts). Rounds take them in "
        "file order and the first round ranks every shape on the first prompt: put a typical "
        "one first (the best shape can depend on the context length)",
    )
    parser.add_argument(
        "--contexts",
        type=context_list,
        default=list(CONTEXTS),
        help="context lengths to time the best shapes and plain decoding at, for a shape per "
        "context band (default %(default)s, cut to the model's context; 0: one shape for all)",
    )
    parser.add_argument("--full-grid", action="store_true", help="exhaustive grid instead")
    parser.add_argument(
        "--repetitions", type=flags.at_least(1), default=2, help="grid runs per prompt"
    )
    parser.add_argument(
        "--temp",
        type=flags.non_negative,
        default=0.0,
        help="tune for sampling at this temperature (0 = greedy): stored as this chip's "
        "sampling profile, which generate and chat use when they sample",
    )
    parser.add_argument("--seed", type=flags.at_least(0), default=0, help="shuffling/sampling seed")
    parser.add_argument("--no-save", action="store_true", help="do not store the profile")
    parser.add_argument("--show", action="store_true", help="print stored profiles and exit")
    return parser


def context_list(text: str) -> list[int]:
    """``--contexts``: comma-separated positive token counts, or 0 for none."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of token counts: {text!r}") from None
    if values == [0]:
        return []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be positive: {text!r}")
    return values


def tune_bands(
    runtime, args: argparse.Namespace, result: SearchResult, texts: Sequence[str], progress
):
    """The shape per context band (:func:`context_costs` over the search's best few shapes),
    with its costs; ``(None, [])`` without ``--contexts`` or for a model with recurrent layers."""
    if not args.contexts:
        return None, []
    best = sorted(result.estimates, key=lambda s: -result.estimates[s])[:FINALISTS]
    filler = [t for ids in heldout_prompt_ids(runtime, len(texts), texts) for t in ids]
    lengths = ", ".join(str(c) for c in args.contexts)
    task = progress.add_task(
        f"timing the best {len(best)} shapes and plain decoding at {lengths} cached tokens",
        total=len(set(args.contexts)),
    )
    costs = context_costs(
        runtime,
        best,
        args.contexts,
        filler,
        temp=args.temp,
        on_context=lambda context: progress.advance(task),
    )
    if not costs:
        return None, []
    return choose_bands(costs, observed_tokens_per_step(result)), costs


def show(console) -> None:
    try:
        data = read_store()
    except ValueError as e:
        warn(str(e))
        return
    if not data["profiles"]:
        console.print(f"no profiles in {store_path()}")
    for key, entry in data["profiles"].items():
        try:
            shape = entry_shape(entry)
        except Exception as e:  # shown, like find_profile, never an error
            warn(f"ignoring a malformed profile {key!r}: {e!r}")
            continue
        temp = f", temperature {entry['temp']:g}" if entry.get("temp") else ""
        console.print(
            f"[bold]{key}[/bold]\n  {shape.describe()} "
            f"({entry.get('method')}{temp}, {entry.get('tokens_per_second')} tok/s, "
            f"{entry.get('created')}, {entry.get('seconds')} s)"
        )
    console.print(f"({store_path()})")


def grid_of(args: argparse.Namespace) -> list:
    """The shapes the flags ask for; SystemExit with one line for a bad combination."""
    try:
        return shape_grid(
            args.beam_width, args.beam_length, args.min_prob, args.search_width, args.lookup
        )
    except ValueError as e:
        fail(str(e))


def search_runs(args: argparse.Namespace, shapes: int, prompts: int) -> int:
    """Measured runs the search makes (the full grid's, or successive halving's)."""
    return shapes * prompts * args.repetitions if args.full_grid else halving_runs(shapes)


def expected_line(runtime, args: argparse.Namespace, shapes: list, prompts: list) -> str:
    """autotune's first line: what it will run and about how long, sized by one timed plain
    run of ``--max-tokens`` here (a shape's warm-up and run each count as about one)."""
    plain = Method(AUTOREGRESSIVE)
    warm_up(runtime, [plain], prompts[0], temp=args.temp)
    tic = time.perf_counter()
    measure(runtime, plain, prompts[0], max_tokens=args.max_tokens, temp=args.temp)
    run_s = time.perf_counter() - tic
    runs = search_runs(args, len(shapes), len(prompts))
    gain_runs = 2 * len(prompts)
    minutes = run_s * (len(shapes) + runs + gain_runs) / 60
    method = "full grid" if args.full_grid else "successive halving"
    bands = f", then step timings at {len(args.contexts)} context lengths" if args.contexts else ""
    return (
        f"autotune: expected about {max(minutes, 1):.0f} min: {len(shapes)} shapes warmed up, "
        f"{runs} runs of {args.max_tokens} tokens ({method}), then the best shape against "
        f"plain decoding on {len(prompts)} prompts{bands} (a plain run of {args.max_tokens} "
        f"tokens takes {run_s:.1f} s here)"
    )


def run_search(
    runtime, args: argparse.Namespace, progress, shapes: list, prompts: list
) -> tuple[SearchResult, float]:
    """Warm up, then the search (or grid) with progress; returns the result and seconds."""
    measure_shape = make_measure(
        runtime, prompts, max_tokens=args.max_tokens, temp=args.temp, seed=args.seed
    )
    task = progress.add_task(
        f"warming up {len(shapes)} shapes (compiling each tree size and beam search)",
        total=len(shapes),
    )
    for shape in shapes:
        warm_up(runtime, [Method(REDRAFTER, shape)], prompts[0], temp=args.temp)
        progress.advance(task)
    total = search_runs(args, len(shapes), len(prompts))
    task = progress.add_task("searching", total=total)
    tick = lambda s: progress.update(task, advance=1, description=f"searching ({s.label})")
    tic = time.perf_counter()
    if args.full_grid:
        result = full_grid(
            shapes,
            measure_shape,
            num_prompts=len(prompts),
            repetitions=args.repetitions,
            seed=args.seed,
            on_run=tick,
        )
    else:
        result = successive_halving(
            shapes, measure_shape, num_prompts=len(prompts), seed=args.seed, on_run=tick
        )
    return result, time.perf_counter() - tic


def measure_gain(runtime, args: argparse.Namespace, progress, best, prompts: list) -> float:
    """The best shape's tokens/s over plain decoding's (:func:`plain_gain`), with progress."""
    task = progress.add_task("the best shape against plain decoding", total=2 * len(prompts))
    return plain_gain(
        runtime,
        best,
        prompts,
        max_tokens=args.max_tokens,
        temp=args.temp,
        seed=args.seed,
        on_run=lambda name: progress.advance(task),
    )


@flags.reports_errors
def main(args: argparse.Namespace) -> None:
    console = stderr_console()
    if args.show:
        show(stderr_console(stderr=False))
        return
    texts = prompt_texts(args.prompts)
    if not 1 <= args.num_prompts <= len(texts):
        where = args.prompts or "the built-in prompts"
        fail(f"--num-prompts must be 1..{len(texts)} ({where})")
    if not args.no_save:
        check_writable(store_path().parent, "profile store")  # replaced by rename
        if store_path().is_dir():
            fail(f"profile store {store_path()} is a folder")
    shapes = grid_of(args)
    runtime = flags.load_runtime(args.model, args.drafter, need_drafter=True)
    flags.say_drafter(runtime)
    prompts = heldout_prompt_ids(runtime, args.num_prompts, texts)
    console.print(expected_line(runtime, args, shapes, prompts), highlight=False)
    console.print(f"chip: {chip_text(chip_info())}", highlight=False)
    try:
        with progress_for(console) as progress:  # a bar, or lines into a pipe or log
            result, seconds = run_search(runtime, args, progress, shapes, prompts)
            bands, costs = tune_bands(runtime, args, result, texts, progress)
            gain = measure_gain(runtime, args, progress, result.best, prompts)
    except KeyboardInterrupt:
        console.print("interrupted: the stored profile is unchanged")
        raise SystemExit(130) from None
    method = "full-grid" if args.full_grid else "successive-halving"
    entry = profile_entry(
        runtime,
        result,
        method=method,
        seconds=seconds,
        max_tokens=args.max_tokens,
        temp=args.temp,
        prompts=args.prompts,
        bands=bands,
        costs=costs,
        gain=gain,
    )
    key = runtime_identity(runtime)[0] + (SAMPLING if args.temp else "")
    report(entry, key, bands, method, len(result.observations), seconds, args)


def report(entry: dict, key: str, bands, method: str, runs: int, seconds: float, args) -> None:
    """The table of shapes, the bands, the profile's fate and the best shape's line (stdout)."""
    out = stderr_console(stderr=False)
    table = Table(title=f"autotune ({method}, {runs} runs, {seconds:.0f} s)")
    for key in TABLE_COLUMNS:
        table.add_column(TABLE_COLUMNS[key], justify="right")
    for row in entry["table"][:12]:
        table.add_row(*(str(row[key]) for key in TABLE_COLUMNS))
    out.print(table)
    if bands is not None:
        out.print(f"by context length: {bands.describe()}", highlight=False)
    if not args.no_save:
        try:
            save_profile(key, entry)
        except OSError as e:
            fail(f"profile not saved: {os_error_text(e, str(store_path()))}")
    saved = "not saved" if args.no_save else f"saved to {store_path()}"
    out.print(f"best: {best_line(entry['table'][0])} ({saved})", highlight=False)
    out.print(gain_line(entry["gain_over_plain_decoding"], args.num_prompts), highlight=False)


def gain_line(gain: float, prompts: int) -> str:
    """What the best shape gives over plain decoding, measured after the search."""
    measured = f"measured after the search on {prompts} prompt{'s' if prompts > 1 else ''}"
    if gain < 1:
        return (
            f"gain over plain decoding: {gain:.2f}x ({measured}): SLOWER than plain decoding "
            "here; `generate --autoregressive` is faster"
        )
    return f"gain over plain decoding: {gain:.2f}x ({measured})"


def chip_text(chip: dict) -> str:
    """``Intel Xeon ..., CPU, OpenBLAS + small-row kernel, 2 cores``: the chip's fields as text."""
    cores = chip.get("cores") or chip.get("gpu_cores")
    fields = [chip.get(k) for k in ("chip", "backend", "blas", "architecture", "memory_size")]
    return ", ".join([str(f) for f in fields if f] + ([f"{cores} cores"] if cores else []))


def best_line(row: dict) -> str:
    """The winning shape in full, from its table row (the table's first):
    ``W=2 L=2 lookup K=4 min-prob p=0 search S=2 (= W: no wider search), 173.7 tok/s
    estimated ...`` ("plain" means plain decoding only, in every line autotune prints)."""
    narrow = row["search_width"] in (0, row["beam_width"])
    search = f"{row['search_width']}{' (= W: no wider search)' if narrow else ''}"
    return (
        f"W={row['beam_width']} L={row['beam_length']} lookup K={row['lookup']} "
        f"min-prob p={row['min_prob']:g} search S={search}, {row['estimated_tps']:g} tok/s "
        f"estimated ({row['measured_tps']:g} measured)"
    )
