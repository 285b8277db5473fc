"""What every command shares: its flags, loading target + drafter, and building a Decoder.

The flag helpers (``add_*_args``, the argparse types, ``resolve_shape``) read argparse; loading
and building take plain values.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import astuple, dataclass
from pathlib import Path

import mlx.core as mx

from redrafter_mlx.accept import make_sampler
from redrafter_mlx.decode import CPU_TREE_SIZES, BeamShape, Decoder, PhaseTimer
from redrafter_mlx.draft import BeamDrafter

# Without an autotune profile: one short beam, the measured best on the 2-core CPU with the
# shipped drafter (benchmarks/README.md); `redrafter-mlx autotune` measures each chip.
DEFAULT_SHAPE = BeamShape(width=1, length=2)
SHAPE_FLAGS = ("beam_width", "beam_length", "min_prob", "search_width")  # BeamShape's fields


@dataclass
class Runtime:
    model: object
    tokenizer: object
    config: dict
    drafter: BeamDrafter | None
    model_id: str
    drafter_id: str | None

    @property
    def max_context(self) -> int | None:
        return self.config.get("max_position_embeddings")


# ---------------------------------------------------------------- argument types (argparse
# reports a bad value as "argument --flag: ..." with the usage, before anything loads)


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


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="MLX model folder or hub id (default: embedded SmolLM2-135M)"
    )
    parser.add_argument(
        "--drafter", help="drafter folder (default: the shipped drafter of the embedded model)"
    )


def add_decode_args(parser: argparse.ArgumentParser, *, max_tokens: int = 256) -> None:
    parser.add_argument(
        "--max-tokens", type=at_least(1), default=max_tokens, help="new tokens at most"
    )
    parser.add_argument("--temp", type=non_negative, default=0.0, help="temperature (0 = greedy)")
    parser.add_argument("--top-p", type=probability, default=0.0, help="nucleus sampling (0 = off)")
    parser.add_argument("--top-k", type=at_least(0), default=0, help="top-k sampling (0 = off)")
    parser.add_argument("--seed", type=at_least(0), default=None, help="random seed for sampling")
    parser.add_argument(
        "--beam-width", type=at_least(1), default=None, help="beams W (default: profile)"
    )
    parser.add_argument("--beam-length", type=at_least(2), default=None, help="tokens per beam L")
    parser.add_argument(
        "--min-prob",
        type=floor,
        default=None,
        help="verify only draft tokens whose drafter path probability is at least this "
        "(0 = the whole tree; default: profile)",
    )
    parser.add_argument(
        "--search-width",
        type=at_least(1),
        default=None,
        help="search with S beams, verify the W of them with the most expected accepted "
        "tokens (S <= W: plain beam search; default: profile)",
    )


def ignored_when_autoregressive(args: argparse.Namespace) -> list[str]:
    """The ReDrafter flags given on a command line that also says --autoregressive."""
    if not getattr(args, "autoregressive", False):
        return []
    flags = ("drafter", *SHAPE_FLAGS, "timing")
    return [
        f"--{f.replace('_', '-')}" for f in flags if getattr(args, f, None) not in (None, False)
    ]


def fail(message: str) -> None:
    """Print a one-line error and exit 1 (bad input, not a bug)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(1)


def os_error_text(e: OSError, path: str | None = None) -> str:
    """One line for a failed file operation: ``path: reason`` (``path`` when the error names
    no file)."""
    where = e.filename or path
    return f"{where}: {e.strerror or e}" if where else str(e.strerror or e)


def check_writable(path: Path | str, what: str) -> None:
    """Fail now, not after a long run, when ``path`` (a folder to create or fill, or a file's
    folder) cannot be written: its nearest existing ancestor must be a folder that takes a
    file (probed with a temp file: permission bits say nothing to root or about /proc)."""
    folder = Path(path).expanduser().absolute()
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        fail(f"{what} {path}: {folder} is a file")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        fail(f"{what} {path}: {folder} is not writable ({e.strerror or e})")


def load_runtime(model: str | None, drafter: str | None, *, need_drafter: bool) -> Runtime:
    """Load the target (embedded default when None) and its drafter, evaluated and checked."""
    from redrafter_mlx.drafter import DrafterError, load_drafter
    from redrafter_mlx.embedded import (
        EmbeddedModelError,
        default_drafter_path,
        default_model_path,
        is_embedded_model,
    )
    from redrafter_mlx.load import load_target

    for flag, value in (("--model", model), ("--drafter", drafter)):
        if value is not None and not value.strip():
            fail(f"{flag}: an empty path (leave the flag out for the default)")
    try:
        model_path = model or str(default_model_path())
        target, tokenizer, config = load_target(model_path)
        embedded = not model or is_embedded_model(model)
        drafter_path = drafter or (default_drafter_path() if embedded else None)
        beam_drafter = None
        if drafter_path is not None:
            loaded = load_drafter(drafter_path, target)
            beam_drafter = BeamDrafter(loaded, target.model.embed_tokens)
    except (ValueError, OSError, DrafterError, EmbeddedModelError) as e:
        fail(str(e))
    if need_drafter and beam_drafter is None:
        fail("no drafter for this model: pass --drafter DIR (make one with `redrafter-mlx train`)")
    return Runtime(
        target,
        tokenizer,
        config,
        beam_drafter,
        str(model_path),
        None if drafter_path is None else str(drafter_path),
    )


def resolve_shape(args: argparse.Namespace, runtime: Runtime) -> tuple[BeamShape, str]:
    """The beam shape to use and where it came from. Each shape flag given overrides its
    field; the others come from the autotune profile (if this chip, model and drafter have
    one; with ``--temp`` > 0 the one tuned for sampling, if any), else from the default."""
    from redrafter_mlx.autotune import lookup_profile

    given = {k: getattr(args, k, None) for k in SHAPE_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) < len(SHAPE_FLAGS):
        sampling = getattr(args, "temp", 0.0) > 0
        base, source = lookup_profile(runtime, sampling=sampling) or (DEFAULT_SHAPE, "default")
        if not given:
            return base, source
        source = f"flags + {source}"
    else:  # every field given: no profile read (nor its warnings)
        base, source = DEFAULT_SHAPE, "flags"
    fields = dict(zip(SHAPE_FLAGS, astuple(base), strict=True)) | given
    try:
        return BeamShape(*fields.values()), source
    except ValueError as e:
        fail(str(e))


def make_decoder(
    runtime: Runtime,
    shape: BeamShape,
    *,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    timing: bool = False,
) -> Decoder:
    vocab = runtime.config.get("vocab_size")
    if top_k and vocab and top_k >= vocab:
        fail(f"--top-k {top_k}: the vocabulary has {vocab} tokens (0 turns top-k off)")
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp, top_p=top_p, top_k=top_k)
    decoder = Decoder(
        runtime.model,
        sampler,
        runtime.drafter,
        shape,
        runtime.max_context,
        PhaseTimer(timing),
        tree_sizes=tree_sizes(),
        seed=seed,
    )
    try:
        decoder.check_shape(shape)
    except ValueError as e:
        fail(f"{shape.describe()}: {e}")
    return decoder


def tree_sizes() -> tuple[int, ...]:
    """Tree sizes the decoder pads to on this backend (measured on CPU only; exact elsewhere)."""
    return CPU_TREE_SIZES if mx.default_device() == mx.cpu else ()


def encode_chat(runtime: Runtime, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the model's chat template and a generation prompt."""
    from redrafter_mlx.templates import apply_chat_template

    return apply_chat_template(runtime.tokenizer, messages, model_path=Path(runtime.model_id))
