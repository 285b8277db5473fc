"""What the commands share: flag types, one definition of each flag group (model, decoding,
beam shape), and turning library errors into the one-line messages users see.

argparse reports a bad value as "argument --flag: ..." with the usage, before anything loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from redrafter_mlx.core.atomic import os_error_text
from redrafter_mlx.core.decode.shape import SHAPE_FIELDS, BeamShape
from redrafter_mlx.core.errors import ConfigError, ReDrafterError
from redrafter_mlx.core.paths import UNWRITABLE
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.io.field_drafters import KIND_NAMES
from redrafter_mlx.io.prompts import MT_BENCH, load_conversations

# SHAPE_FIELDS' flags, in their order
SHAPE_FLAGS = ("beam_width", "beam_length", "min_prob", "search_width", "lookup")


def program() -> str:
    """How a hint names this program so that it runs when pasted: ``redrafter-mlx`` where
    that is this install's script on PATH, else the script beside the running Python (a venv
    not activated: ``.venv/bin/redrafter-mlx`` in the clone), relative to the working folder
    when it lies inside it."""
    beside = Path(sys.executable).parent / "redrafter-mlx"
    if not beside.is_file():  # ``python -m redrafter_mlx`` without an install
        return "redrafter-mlx"
    on_path = shutil.which("redrafter-mlx")
    if on_path and Path(on_path).resolve() == beside.resolve():
        return "redrafter-mlx"
    inside = beside.absolute().is_relative_to(Path.cwd())
    return os.path.relpath(beside) if inside else str(beside)


def at_least(low: int) -> Callable[[str], int]:
    """An int flag type that refuses values below ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def non_negative(text: str) -> float:
    """A finite float >= 0 (temperatures, floors, minutes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


# A time budget's bound: a year (a budget beyond it is a typo, and its deadline a date that
# the clock cannot show: 1e308 minutes overflowed time.localtime)
MAX_MINUTES = 366 * 24 * 60


def minutes(text: str) -> float:
    """A time budget in minutes: finite, > 0 and at most :data:`MAX_MINUTES` (a flag left out
    means no limit; 0 is refused, not read as "none")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"must be a positive number of minutes, got {text} (leave the flag out for no limit)"
        )
    if value > MAX_MINUTES:
        raise argparse.ArgumentTypeError(f"at most {MAX_MINUTES:,} minutes (a year), got {text}")
    return value


BYTE_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def byte_size(text: str) -> int:
    """``2GB`` -> 2_000_000_000 (K, M, G, T, with or without B; a bare number is bytes)."""
    match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([KMGT]?)B?", text.strip().upper())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes such as 512MB or 2GB")
    return int(float(match[1]) * BYTE_UNITS[match[2]])


def probability(text: str) -> float:
    """A float in [0, 1]."""
    value = non_negative(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _list_of(item: Callable[[str], float]) -> Callable[[str], list]:
    """A comma-separated list flag whose items are checked by ``item`` (one of the types above)."""

    def parse(text: str) -> list:
        values = [item(x.strip()) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return values

    return parse


def floor(text: str) -> float:
    """A path-probability floor: 0 <= p < 1 (0: whole trees)."""
    value = probability(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be below 1 (0 = whole trees), got {text}")
    return value


widths, lengths, floors = _list_of(at_least(1)), _list_of(at_least(2)), _list_of(floor)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's help: examples kept as written, and each flag's default shown where its
    help does not already say it (argparse's ``ArgumentDefaultsHelpFormatter`` would also show
    ``None`` and ``False``, which say nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text.lower()
            or not action.option_strings
            or any(default is nothing for nothing in (None, False, True, argparse.SUPPRESS))
            or default == []
        ):
            return text
        return f"{text} (default: {shown_default(default)})"


def shown_default(value: object) -> str:
    """A default as a user would type it: ``0.7``, ``1,2,3``, ``128``; %-escaped for argparse."""
    if isinstance(value, (list, tuple)):
        text = ",".join(shown_default(v) for v in value)
    elif isinstance(value, float):
        text = f"{value:g}"
    else:
        text = str(value)
    return text.replace("%", "%%")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="MLX model folder or hub id (default: embedded SmolLM2-135M)"
    )
    parser.add_argument("--drafter", help=DRAFTER_HELP)


DRAFTER_HELP = (
    "drafter folder, Hub id (USER/NAME, cached for offline use), auto (the published drafter "
    "the package's catalogue lists for the model, downloaded once) or none (default: the one "
    "found for the model: trained here, shipped in its redrafter/ folder, or none)"
)


def load_runtime(model: str | None, drafter: str | None, *, need_drafter: bool) -> rt.Runtime:
    """:func:`rt.load_runtime`, said first: loading takes seconds (minutes for a first
    conversion or download) that would otherwise pass in silence."""
    say_loading(model)
    runtime = rt.load_runtime(model, drafter, need_drafter=need_drafter)
    say_skipped(runtime)
    return runtime


def say_skipped(runtime) -> None:
    """One stderr line naming the drafter sources discovery skipped (a broken registry entry,
    a folder that holds no drafter), if any: they are worth mending, not worth stopping for."""
    choice = getattr(runtime, "drafter_choice", None)
    if choice is not None and (line := choice.skipped_line()):
        print(line, file=sys.stderr)


def say_loading(model: str | None) -> None:
    """One stderr line before a model loads."""
    name = model or "the embedded SmolLM2-135M-Instruct"
    print(f"loading {name}...", file=sys.stderr, flush=True)


def say_drafter(runtime, *, json_mode: bool = False, autoregressive: bool = False) -> None:
    """Say on stderr which drafter the command uses and why, in one line (not with --json,
    whose output carries :func:`drafter_json`; nor when no drafter runs)."""
    choice = getattr(runtime, "drafter_choice", None)
    if choice is not None and not (json_mode or autoregressive):
        print(choice.describe(), file=sys.stderr)


# The lookup beams a model speculates with when no drafter was found and the shape has none
LOOKUP_WITHOUT_DRAFTER = 1


def lookup_when_no_drafter(runtime, shape: BeamShape, source: str) -> tuple[BeamShape, str]:
    """``(shape, source)`` for ``runtime``: without a drafter, lookup beams alone (the shape's
    K, else :data:`LOOKUP_WITHOUT_DRAFTER`), which need no drafter; with one, unchanged."""
    if runtime.drafter is not None or shape.lookup:
        return shape, source
    shape = dataclasses.replace(shape, lookup=LOOKUP_WITHOUT_DRAFTER)
    return shape, f"{source}; lookup {LOOKUP_WITHOUT_DRAFTER}: no drafter"


def drafter_name(runtime) -> str:
    """The drafter type's name as banners say it (``ReDrafter``, ``EAGLE-3``, ``DFlash``...)."""
    drafter = getattr(runtime, "drafter", None)  # a test's stand-in runtime may have none
    kind = drafter.kind if drafter is not None else "redrafter"
    return KIND_NAMES.get(kind, kind)


def drafter_json(runtime) -> dict | None:
    """``{"path": ..., "reason": ...}``: the drafter and why, for a command's --json output."""
    choice = getattr(runtime, "drafter_choice", None)
    return None if choice is None else choice.as_json()


def add_decode_args(parser: argparse.ArgumentParser, *, max_tokens: int = 256) -> None:
    parser.add_argument(
        "--max-tokens", type=at_least(1), default=max_tokens, help="new tokens at most"
    )
    parser.add_argument("--temp", type=non_negative, default=0.0, help="temperature (0 = greedy)")
    parser.add_argument("--top-p", type=probability, default=0.0, help="nucleus sampling (0 = off)")
    parser.add_argument("--top-k", type=at_least(0), default=0, help="top-k sampling (0 = off)")
    parser.add_argument("--seed", type=at_least(0), default=None, help="random seed for sampling")


SHAPE_HELP = {
    "beam_width": "beams W",
    "beam_length": "tokens per beam L (column 0 is the pending token)",
    "min_prob": "verify only draft tokens whose drafter path probability is at least this "
    "(0 = the whole tree)",
    "search_width": "search with S beams, verify the W of them with the most expected "
    "accepted tokens (S <= W: plain beam search)",
    "lookup": "also verify up to K prompt-lookup beams: continuations copied from where the "
    "last tokens occurred earlier in the context (0 = off; without a drafter: lookup alone)",
}
SHAPE_EXAMPLES = {
    "beam_width": "1,2,4",
    "beam_length": "3,4,5",
    "min_prob": "0,0.3",
    "search_width": "1,16",
    "lookup": "0,2,4",
}
SHAPE_TYPES = {
    "beam_width": at_least(1),
    "beam_length": at_least(2),
    "min_prob": floor,
    "search_width": at_least(1),
    "lookup": at_least(0),
}


def add_shape_args(parser: argparse.ArgumentParser, *, grid: dict | None = None) -> None:
    """``--beam-width``, ``--beam-length``, ``--min-prob``, ``--search-width``, ``--lookup``:
    one value each
    (default: the autotune profile), or with ``grid`` comma-separated lists of the flags that
    ``grid`` names, with the defaults it gives (None: not searched unless given)."""
    for name, kind in SHAPE_TYPES.items():
        if grid is not None and name not in grid:
            continue
        flag = "--" + name.replace("_", "-")
        if grid is None:
            parser.add_argument(
                flag, type=kind, default=None, help=SHAPE_HELP[name] + " (default: profile)"
            )
            continue
        default = grid.get(name)
        shown = "" if default is None else f" (default: {','.join(f'{x:g}' for x in default)})"
        if name == "search_width" and default == [0]:
            shown = " (default: the plain search only)"
        if name == "lookup" and default == [0]:
            shown = " (default: no lookup beams)"
        parser.add_argument(
            flag,
            type=_list_of(kind),
            default=default,
            help=f"list of: {SHAPE_HELP[name]}, e.g. {SHAPE_EXAMPLES[name]}{shown}",
        )


def add_speculation_args(parser: argparse.ArgumentParser) -> None:
    """The beam shape's flags and ``--autoregressive``: what every decoding command takes."""
    add_shape_args(parser)
    parser.add_argument(
        "--autoregressive",
        action="store_true",
        help="plain one-token-per-step decoding with the same forward, no drafter (baseline)",
    )


def shape_overrides(args: argparse.Namespace) -> dict:
    """The shape flags given, by BeamShape field (``width``, ``length``, ...)."""
    return {f: getattr(args, k, None) for k, f in zip(SHAPE_FLAGS, SHAPE_FIELDS, strict=True)}


def ignored_when_autoregressive(args: argparse.Namespace) -> list[str]:
    """The ReDrafter flags given on a command line that also says --autoregressive."""
    if not getattr(args, "autoregressive", False):
        return []
    flags = ("drafter", *SHAPE_FLAGS, "timing")
    return [
        f"--{f.replace('_', '-')}" for f in flags if getattr(args, f, None) not in (None, False)
    ]


def reports_errors(main: Callable) -> Callable:
    """A command's ``main`` whose library errors (:class:`ReDrafterError`) end it with their
    one-line message and exit status 1, however it is called (dispatcher, test, script); so
    does a file that cannot be written (read-only, no permission, a full disk), named with
    what to do when it is the cache (:func:`os_error_text`)."""

    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ReDrafterError as e:
            fail(str(e))
        except OSError as e:
            if e.errno not in UNWRITABLE:
                raise  # anything else is not the user's to fix: keep the traceback
            fail(os_error_text(e))

    return run


def fail(message: str) -> None:
    """Print a one-line error and exit 1 (bad input, not a bug)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(1)


def read_prompts(path: Path | str | None, num: int | None, turns: int) -> list[list[str]]:
    """:func:`load_prompts` for a command: a bad or empty file is a ConfigError naming
    ``--prompts``."""
    return [c.turns for c in read_conversations(path, num, turns)]


def read_conversations(path: Path | str | None, num: int | None, turns: int) -> list:
    """:func:`load_conversations` (turns and category) for a command, as :func:`read_prompts`."""
    try:
        conversations = load_conversations(path, num, turns)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--prompts {e}") from None
    if not conversations:
        raise ConfigError(f"--prompts {path or MT_BENCH} holds no prompt")
    return conversations
