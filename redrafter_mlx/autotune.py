"""`redrafter-mlx autotune`: the fastest beam shape (W, L) for this chip, model and drafter.

Legend: W beam width, L beam length, T packed tree nodes.

Search: successive halving over the W x L grid on short held-out prompts (never MT-Bench),
measuring real tokens/s with the benchmark's own timer (``bench.measure``). Every round runs all
surviving shapes once on the next prompt, in a shuffled order (so drift hits all alike), then
keeps the best ~30% until three finalists remain, which get extra rounds.

A single run is 20-30% noisy here, too noisy to rank shapes that differ by 5%. But a run's
tokens/s is ``tokens per step / seconds per step``, and only the second factor is noisy
(greedy acceptance is exact); seconds per step is a smooth function of the shape. So each
round fits one small cost model over *all* runs (``seconds/step ~ 1, T, T^2, L-1, W(L-1)``,
relative least squares) and ranks a shape by its own tokens/step over the modelled cost,
corrected by its own mean residual shrunk towards zero (``n / (n + SHRINK)``). Noise then
averages over every run instead of the one or two each shape gets.

With ``--temp`` > 0 the runs sample (reseeded per prompt, the same stream for every shape):
tokens/step is then random too, and the same averaging over all runs absorbs it. Sampling
accepts fewer drafts than greedy decoding, so its best shape is often shorter.

Profiles: one JSON (``$REDRAFTER_CACHE/profiles.json``, default ``~/.cache/redrafter-mlx``)
keyed by chip + backend + model + drafter + dtype/quantization (+ `` | sampling`` for the one
tuned with ``--temp``), written atomically; a stale or unreadable profile is ignored with a
warning, never an error. Sampling runs use the sampling profile, else the greedy one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from redrafter_mlx.atomic import write_text
from redrafter_mlx.decode import BeamShape, shape_grid

PROFILE_VERSION = 1
DEFAULT_WIDTHS = tuple(range(1, 9))
DEFAULT_LENGTHS = tuple(range(2, 7))
KEEP = 0.3  # fraction of shapes kept per round
FINALISTS = 3
FINAL_ROUNDS = 4  # rounds the finalists get (including the one that made them finalists)
SHRINK = 12.0  # runs of its own before a shape's residual counts half

# Short generic held-out prompts (not MT-Bench, not training data).
HELDOUT_PROMPTS = (
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about autumn leaves.",
    "What are three tips for learning a new language?",
    "Describe the water cycle in simple terms.",
    "Give me a recipe for a quick vegetable soup.",
    "Why is the sky blue? Answer in a few sentences.",
)

EXAMPLES = """examples:
  redrafter-mlx autotune                          # embedded SmolLM2 + its drafter
  redrafter-mlx autotune --model models/vicuna-7b --drafter models/vicuna-7b-drafter
  redrafter-mlx autotune --beam-width 1,2,3,4 --beam-length 3,4,5 --max-tokens 32
  redrafter-mlx autotune --beam-width 1,2 --beam-length 2,3,4 --min-prob 0,0.2,0.3
  redrafter-mlx autotune --beam-width 2,4 --beam-length 4,5 --search-width 1,8,16
  redrafter-mlx autotune --temp 0.7                # the shape for sampled chats (--temp > 0)
  redrafter-mlx autotune --prompts my_prompts.jsonl --num-prompts 6   # tune on your workload
  redrafter-mlx autotune --full-grid --repetitions 2   # exhaustive grid, for comparison
  redrafter-mlx autotune --show                   # stored profiles
"""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


# ---------------------------------------------------------------- chip and profile keys


def chip_info() -> dict:
    """The chip: Apple device name/architecture/GPU cores, CUDA device name, or CPU + BLAS."""
    import mlx.core as mx

    from redrafter_mlx.bench import backend, device_name
    from redrafter_mlx.blas import blas_in_use

    kind = backend()
    if kind == "CPU":
        return {
            "chip": device_name(),
            "backend": kind,
            "blas": blas_in_use(),
            "cores": os.cpu_count(),
        }
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    chip = {"chip": device_name(), "backend": kind}
    for name in ("architecture", "gpu_cores", "num_gpu_cores", "memory_size"):
        if name in info:
            chip[name] = str(info[name])
    return chip


def profile_key(
    chip: dict, model_id: str, drafter_id: str | None, dtype: str, quantization: object
) -> str:
    """One string key: chip (+ BLAS on CPU), backend, model, drafter, dtype/quantization."""
    quant = "none" if not quantization else json.dumps(quantization, sort_keys=True)
    parts = [
        chip.get("chip"),
        chip.get("blas"),
        chip.get("backend"),
        model_id,
        drafter_id,
        dtype,
        quant,
    ]
    return " | ".join(str(p) for p in parts if p is not None)


def fingerprint(*paths: str | None) -> str:
    """Size + mtime of the weight files under ``paths``: changes when a model is retrained."""
    h = hashlib.sha1()
    for p in paths:
        if p is None:
            continue
        path = Path(p)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        for f in files:
            try:
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
            except OSError:
                h.update(f"{f}:missing;".encode())
    return h.hexdigest()[:16]


def runtime_identity(runtime) -> tuple[str, str]:
    """(profile key, fingerprint) of a loaded runtime."""
    from redrafter_mlx.llm import compute_dtype

    dtype = str(compute_dtype(runtime.model)).replace("mlx.core.", "")
    quant = runtime.config.get("quantization") if isinstance(runtime.config, dict) else None
    key = profile_key(chip_info(), str(runtime.model_id), runtime.drafter_id, dtype, quant)
    return key, fingerprint(runtime.model_id, runtime.drafter_id)


# ---------------------------------------------------------------- the profile store


def store_path() -> Path:
    from redrafter_mlx.embedded import cache_dir

    return cache_dir() / "profiles.json"


def read_store(path: Path | None = None) -> dict:
    """The profile store ``{"version", "profiles": {key: entry}}``; raises ValueError if corrupt."""
    path = path or store_path()
    if not path.exists():
        return {"version": PROFILE_VERSION, "profiles": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable profile store ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("profiles"), dict):
        raise ValueError(f"{path}: not a profile store (no 'profiles' object)")
    return data


def write_store(data: dict, path: Path | None = None) -> None:
    """Write the store atomically: a temp file in the same folder, then a rename."""
    write_text(path or store_path(), json.dumps(data, indent=2, default=str) + "\n")


def save_profile(key: str, entry: dict, path: Path | None = None) -> None:
    """Add or replace one profile; an unreadable store is replaced (with a warning)."""
    try:
        data = read_store(path)
    except ValueError as e:
        warn(f"{e}; starting a new store")
        data = {"version": PROFILE_VERSION, "profiles": {}}
    data["version"] = PROFILE_VERSION
    data["profiles"][key] = entry
    write_store(data, path)


def entry_shape(entry: dict) -> BeamShape:
    """A stored profile's shape; raises (TypeError, KeyError, ValueError...) when malformed."""
    width, length, *more = entry["shape"]  # [W, L], [W, L, min_prob] or [W, L, p, search]
    floor = float(more[0]) if more else 0.0
    search = int(more[1]) if len(more) > 1 else 0
    return BeamShape(int(width), int(length), floor, search)


def find_profile(key: str, fp: str, path: Path | None = None) -> BeamShape | None:
    """The stored shape for ``key``, or None (warning on stderr when stale or corrupt)."""
    try:
        data = read_store(path)
        entry = data["profiles"].get(key)
        if entry is None:
            return None
        if data.get("version") != PROFILE_VERSION or entry.get("fingerprint") != fp:
            warn(
                "ignoring a stale autotune profile (model or drafter changed): rerun "
                "`redrafter-mlx autotune`"
            )
            return None
        return entry_shape(entry)
    except Exception as e:  # a profile must never break generation
        warn(f"ignoring the autotune profile: {e}")
        return None


SAMPLING = " | sampling"  # suffix of the profile key tuned with --temp > 0


def lookup_profile(runtime, *, sampling: bool = False) -> tuple[BeamShape, str] | None:
    """The autotuned shape for this chip + model + drafter and where it came from, or None.
    ``sampling``: the profile tuned at a temperature if there is one, else the greedy one."""
    if runtime.drafter_id is None:
        return None
    try:
        key, fp = runtime_identity(runtime)
    except Exception as e:
        warn(f"ignoring the autotune profile: {e}")
        return None
    if sampling and (shape := find_profile(key + SAMPLING, fp)) is not None:
        return shape, "autotune profile, sampling"
    shape = find_profile(key, fp)
    return None if shape is None else (shape, "autotune profile")


# ---------------------------------------------------------------- the search


@dataclass
class Observation:
    """One run of one shape: tokens/step (exact, greedy), seconds/step (noisy), tree size T."""

    shape: BeamShape
    prompt: int
    tokens_per_step: float
    seconds_per_step: float
    tree_size: float

    @property
    def tps(self) -> float:
        return self.tokens_per_step / max(self.seconds_per_step, 1e-12)


Measure = Callable[[BeamShape, int], Observation]


def _features(shape: BeamShape, tree: float) -> list[float]:
    searched, n = shape.searched, shape.length  # drafting: L - 1 depths of S beams
    return [1.0, tree, tree * tree / 16.0, n - 1.0, searched * (n - 1.0)]


def fit_cost(observations: Sequence[Observation]) -> Callable[[BeamShape, float], float]:
    """Seconds/step model from all runs (relative least squares) -> ``log seconds``."""
    x = np.array([_features(o.shape, o.tree_size) for o in observations])
    y = np.array([o.seconds_per_step for o in observations])
    beta = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)[0]

    def log_cost(shape: BeamShape, tree: float) -> float:
        return math.log(max(float(np.dot(_features(shape, tree), beta)), 1e-9))

    return log_cost


def scores(
    observations: Sequence[Observation], shapes: Sequence[BeamShape], *, shrink: float = SHRINK
) -> dict[BeamShape, float]:
    """Estimated log tokens/s of each shape: own tokens/step over the modelled cost, plus the
    shape's own mean residual shrunk by ``n / (n + shrink)``."""
    log_cost = fit_cost(observations)
    out = {}
    for shape in shapes:
        own = [o for o in observations if o.shape == shape]
        tree = statistics.fmean(o.tree_size for o in own)
        resid = statistics.fmean(
            math.log(o.seconds_per_step) - log_cost(shape, o.tree_size) for o in own
        )
        accepted = statistics.fmean(o.tokens_per_step for o in own)
        out[shape] = (
            math.log(accepted) - log_cost(shape, tree) - len(own) / (len(own) + shrink) * resid
        )
    return out


@dataclass
class SearchResult:
    best: BeamShape
    # tokens/s per shape: halving keeps each shape's estimate from the last round that ranked
    # it (eliminated shapes keep their last one); the full grid, its measured median
    estimates: dict[BeamShape, float]
    observations: list[Observation] = field(default_factory=list)


def successive_halving(
    shapes: Sequence[BeamShape],
    measure: Measure,
    *,
    num_prompts: int,
    seed: int = 0,
    keep: float = KEEP,
    finalists: int = FINALISTS,
    final_rounds: int = FINAL_ROUNDS,
    shrink: float = SHRINK,
    on_run: Callable[[BeamShape], None] | None = None,
) -> SearchResult:
    """Rounds over prompts ``0, 1, ...`` (mod ``num_prompts``); see the module docstring."""
    rng = np.random.default_rng(seed)
    alive, observations, ranked = list(shapes), [], {}
    extra, rnd = None, 0
    while True:
        for i in rng.permutation(len(alive)):
            observations.append(measure(alive[i], rnd % num_prompts))
            if on_run:
                on_run(alive[i])
        rnd += 1
        est = scores(observations, alive, shrink=shrink)
        ranked |= {s: math.exp(v) for s, v in est.items()}
        alive.sort(key=lambda s: -est[s])
        if len(alive) <= finalists:
            extra = final_rounds - 1 if extra is None else extra - 1
            if extra <= 0:
                return SearchResult(alive[0], ranked, observations)
        else:
            alive = alive[: max(finalists, math.ceil(len(alive) * keep))]


def full_grid(
    shapes: Sequence[BeamShape],
    measure: Measure,
    *,
    num_prompts: int,
    repetitions: int = 1,
    seed: int = 0,
    on_run: Callable[[BeamShape], None] | None = None,
) -> SearchResult:
    """Every shape on every prompt ``repetitions`` times (shuffled order); best = the highest
    median over prompts of per-prompt median tokens/s (the bench's figure)."""
    rng = np.random.default_rng(seed)
    observations = []
    for _ in range(repetitions):
        for prompt in range(num_prompts):
            for i in rng.permutation(len(shapes)):
                observations.append(measure(shapes[i], prompt))
                if on_run:
                    on_run(shapes[i])
    med = {s: grid_tps(observations, s) for s in shapes}
    best = max(shapes, key=lambda s: med[s])
    return SearchResult(best, med, observations)


def grid_tps(observations: Sequence[Observation], shape: BeamShape) -> float:
    """Median over prompts of the per-prompt median tokens/s of ``shape``."""
    per: dict[int, list[float]] = {}
    for o in observations:
        if o.shape == shape:
            per.setdefault(o.prompt, []).append(o.tps)
    return statistics.median(statistics.median(v) for v in per.values())


# ---------------------------------------------------------------- measuring real runs


def make_measure(
    runtime, prompts: Sequence[list[int]], *, max_tokens: int, temp: float = 0.0, seed: int = 0
) -> Measure:
    """A ``Measure`` that generates with the benchmark's timer (``bench.measure``); with
    ``temp`` > 0 it samples, reseeded per prompt (every shape sees the same random stream)."""
    from redrafter_mlx.bench import REDRAFTER, Method, measure

    def run(shape: BeamShape, prompt: int) -> Observation:
        result = measure(
            runtime,
            Method(REDRAFTER, shape),
            prompts[prompt],
            max_tokens=max_tokens,
            temp=temp,
            seed=seed + prompt if temp else None,
        )
        steps = max(result.steps, 1)
        tree = statistics.fmean(result.tree_sizes) if result.tree_sizes else 1.0
        after_first = len(result.token_latencies)
        return Observation(
            shape,
            prompt,
            max(after_first, 1) / steps,
            max(sum(result.token_latencies), 1e-9) / steps,
            tree,
        )

    return run


def heldout_prompt_ids(runtime, count: int, texts: Sequence[str] = HELDOUT_PROMPTS):
    """The first ``count`` of ``texts`` (default: the built-in held-out prompts) as chat
    token ids ``[ids, ...]``."""
    from redrafter_mlx import runtime as rt

    return [rt.encode_chat(runtime, [{"role": "user", "content": p}]) for p in texts[:count]]


def prompt_texts(path: str | None) -> list[str]:
    """First user turns of a JSONL prompt file (``turns``/``prompt``/``text``, as ``bench``
    reads), or the built-in held-out prompts; SystemExit with one line for a bad file."""
    if path is None:
        return list(HELDOUT_PROMPTS)
    from redrafter_mlx.bench import read_prompts

    return [turns[0] for turns in read_prompts(path, None, 1)]


TABLE_COLUMNS = {  # row key of :func:`table` -> column of the printed table
    "beam_width": "W",
    "beam_length": "L",
    "min_prob": "p",
    "search_width": "S",
    "runs": "runs",
    "tokens_per_step": "tok/step",
    "mean_tree_size": "tree",
    "measured_tps": "measured tok/s",
    "estimated_tps": "estimated tok/s",
}


def table(result: SearchResult) -> list[dict]:
    """Per-shape rows: runs, tokens/step, tree size, median measured and estimated tokens/s."""
    rows = []
    for shape, estimate in sorted(result.estimates.items(), key=lambda kv: -kv[1]):
        own = [o for o in result.observations if o.shape == shape]
        rows.append(
            {
                "beam_width": shape.width,
                "beam_length": shape.length,
                "min_prob": shape.min_prob,
                "search_width": shape.searched,
                "runs": len(own),
                "tokens_per_step": round(statistics.fmean(o.tokens_per_step for o in own), 3),
                "mean_tree_size": round(statistics.fmean(o.tree_size for o in own), 2),
                "measured_tps": round(statistics.median(o.tps for o in own), 3),
                "estimated_tps": round(estimate, 3),
            }
        )
    return rows


def profile_entry(
    runtime,
    result: SearchResult,
    *,
    method: str,
    seconds: float,
    max_tokens: int,
    temp: float = 0.0,
    prompts: str | None = None,
) -> dict:
    import mlx.core as mx

    _, fp = runtime_identity(runtime)
    return {
        "shape": [
            result.best.width,
            result.best.length,
            result.best.min_prob,
            result.best.searched,
        ],
        "method": method,
        "fingerprint": fp,
        "chip": chip_info(),
        "model": str(runtime.model_id),
        "drafter": runtime.drafter_id,
        "mlx": mx.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(seconds, 1),
        "max_tokens": max_tokens,
        "temp": temp,
        "prompts": prompts or "built-in",
        "tokens_per_second": round(result.estimates[result.best], 3),
        "table": table(result),
    }


# ---------------------------------------------------------------- CLI


def setup_arg_parser() -> argparse.ArgumentParser:
    from redrafter_mlx import runtime as rt

    parser = argparse.ArgumentParser(
        description="Find the fastest ReDrafter beam shape (W, L) on this machine.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rt.add_model_args(parser)
    parser.add_argument(
        "--beam-width",
        type=rt.widths,
        default=list(DEFAULT_WIDTHS),
        help="widths to search (default 1..8)",
    )
    parser.add_argument(
        "--beam-length",
        type=rt.lengths,
        default=list(DEFAULT_LENGTHS),
        help="lengths to search (default 2..6)",
    )
    parser.add_argument(
        "--min-prob",
        type=rt.floors,
        default=[0.0],
        help="drafter path-probability floors to search, e.g. 0,0.2,0.3 (default 0: whole trees)",
    )
    parser.add_argument(
        "--search-width",
        type=rt.widths,
        default=[0],
        help="drafter search widths S to try, e.g. 1,8,16: search with S beams, verify the W "
        "with the most expected accepted tokens (S <= W: plain; default: plain only)",
    )
    parser.add_argument("--max-tokens", type=rt.at_least(8), default=48, help="new tokens per run")
    parser.add_argument(
        "--num-prompts",
        type=rt.at_least(1),
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
    parser.add_argument("--full-grid", action="store_true", help="exhaustive grid instead")
    parser.add_argument(
        "--repetitions", type=rt.at_least(1), default=2, help="grid runs per prompt"
    )
    parser.add_argument(
        "--temp",
        type=rt.non_negative,
        default=0.0,
        help="tune for sampling at this temperature (0 = greedy): stored as this chip's "
        "sampling profile, which generate and chat use when they sample",
    )
    parser.add_argument("--seed", type=rt.at_least(0), default=0, help="shuffling/sampling seed")
    parser.add_argument("--no-save", action="store_true", help="do not store the profile")
    parser.add_argument("--show", action="store_true", help="print stored profiles and exit")
    return parser


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


def run_search(
    runtime, args: argparse.Namespace, progress, texts: Sequence[str]
) -> tuple[SearchResult, float]:
    """Warm up, then the search (or grid) with a progress bar; returns the result and seconds."""
    try:
        shapes = shape_grid(args.beam_width, args.beam_length, args.min_prob, args.search_width)
    except ValueError as e:
        from redrafter_mlx.runtime import fail

        fail(str(e))
    from redrafter_mlx.bench import REDRAFTER, Method, warm_up

    prompts = heldout_prompt_ids(runtime, args.num_prompts, texts)
    measure = make_measure(
        runtime, prompts, max_tokens=args.max_tokens, temp=args.temp, seed=args.seed
    )
    task = progress.add_task("warming up", total=len(shapes))
    for shape in shapes:
        warm_up(runtime, [Method(REDRAFTER, shape)], prompts[0], temp=args.temp)
        progress.advance(task)
    total = len(shapes) * len(prompts) * args.repetitions if args.full_grid else None
    task = progress.add_task("searching", total=total)
    tick = lambda s: progress.update(task, advance=1, description=s.label)
    tic = time.perf_counter()
    if args.full_grid:
        result = full_grid(
            shapes,
            measure,
            num_prompts=len(prompts),
            repetitions=args.repetitions,
            seed=args.seed,
            on_run=tick,
        )
    else:
        result = successive_halving(
            shapes, measure, num_prompts=len(prompts), seed=args.seed, on_run=tick
        )
    return result, time.perf_counter() - tic


def main(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from redrafter_mlx import runtime as rt

    console = Console(stderr=True)
    if args.show:
        show(Console())
        return
    texts = prompt_texts(args.prompts)
    if not 1 <= args.num_prompts <= len(texts):
        where = args.prompts or "the built-in prompts"
        rt.fail(f"--num-prompts must be 1..{len(texts)} ({where})")
    if not args.no_save:
        rt.check_writable(store_path().parent, "profile store")  # replaced by rename
        if store_path().is_dir():
            rt.fail(f"profile store {store_path()} is a folder")
    runtime = rt.load_runtime(args.model, args.drafter, need_drafter=True)
    console.print(f"chip: {chip_info()}")
    try:
        with Progress(console=console, transient=True) as progress:
            result, seconds = run_search(runtime, args, progress, texts)
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
    )
    out = Table(title=f"autotune ({method}, {len(result.observations)} runs, {seconds:.0f} s)")
    for key in TABLE_COLUMNS:
        out.add_column(TABLE_COLUMNS[key], justify="right")
    for row in entry["table"][:12]:
        out.add_row(*(str(row[key]) for key in TABLE_COLUMNS))
    Console().print(out)
    if not args.no_save:
        try:
            save_profile(runtime_identity(runtime)[0] + (SAMPLING if args.temp else ""), entry)
        except OSError as e:
            rt.fail(f"profile not saved: {rt.os_error_text(e, str(store_path()))}")
    Console().print(
        f"best: {result.best.describe()} "
        f"({'not saved' if args.no_save else f'saved to {store_path()}'})"
    )
