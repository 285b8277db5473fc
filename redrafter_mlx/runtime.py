"""What every command shares: its flags, loading target + drafter, and building a Decoder.

Commands turn their flags into these objects on their first lines; nothing below reads argparse.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from redrafter_mlx.accept import make_sampler
from redrafter_mlx.decode import CPU_TREE_SIZES, BeamShape, Decoder, PhaseTimer
from redrafter_mlx.draft import BeamDrafter

# Without an autotune profile: one short beam, the measured best on the 2-core CPU with the
# shipped drafter (benchmarks/README.md); `redrafter-mlx autotune` measures each chip.
DEFAULT_SHAPE = BeamShape(width=1, length=2)


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


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="MLX model folder or hub id (default: embedded SmolLM2-135M)"
    )
    parser.add_argument(
        "--drafter", help="drafter folder (default: the shipped drafter of the embedded model)"
    )


def add_decode_args(parser: argparse.ArgumentParser, *, max_tokens: int = 256) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="new tokens at most")
    parser.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling (0 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    parser.add_argument("--beam-width", type=int, default=None, help="beams W (default: profile)")
    parser.add_argument("--beam-length", type=int, default=None, help="tokens per beam L")
    parser.add_argument(
        "--min-prob",
        type=float,
        default=None,
        help="verify only draft tokens whose drafter path probability is at least this "
        "(0 = the whole tree; default: profile)",
    )


def fail(message: str) -> None:
    """Print a one-line error and exit 1 (bad input, not a bug)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(1)


def load_runtime(model: str | None, drafter: str | None, *, need_drafter: bool) -> Runtime:
    """Load the target (embedded default when None) and its drafter, evaluated and checked."""
    from redrafter_mlx.drafter import DrafterError, load_drafter
    from redrafter_mlx.embedded import default_drafter_path, default_model_path
    from redrafter_mlx.load import load_target

    try:
        model_path = model or str(default_model_path())
        target, tokenizer, config = load_target(model_path)
        drafter_path = drafter or (None if model else default_drafter_path())
        beam_drafter = None
        if drafter_path is not None:
            loaded = load_drafter(drafter_path, target)
            beam_drafter = BeamDrafter(loaded, target.model.embed_tokens)
    except (ValueError, OSError, DrafterError) as e:
        fail(str(e))
    if need_drafter and beam_drafter is None:
        fail(
            "no drafter for this model: pass --drafter DIR (see `redrafter-mlx train`) "
            "or use --autoregressive"
        )
    return Runtime(
        target,
        tokenizer,
        config,
        beam_drafter,
        str(model_path),
        None if drafter_path is None else str(drafter_path),
    )


def resolve_shape(args: argparse.Namespace, runtime: Runtime) -> tuple[BeamShape, str]:
    """The beam shape to use and where it came from: flags, the autotune profile, or default."""
    if any(getattr(args, k) is not None for k in ("beam_width", "beam_length", "min_prob")):
        width = args.beam_width or DEFAULT_SHAPE.width
        length = args.beam_length or DEFAULT_SHAPE.length
        floor = DEFAULT_SHAPE.min_prob if args.min_prob is None else args.min_prob
        return _checked_shape(width, length, floor), "flags"
    try:
        from redrafter_mlx.autotune import lookup_profile
    except ImportError:
        return DEFAULT_SHAPE, "default"
    found = lookup_profile(runtime)
    return (found, "autotune profile") if found is not None else (DEFAULT_SHAPE, "default")


def _checked_shape(width: int, length: int, min_prob: float = 0.0) -> BeamShape:
    try:
        return BeamShape(width, length, min_prob)
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
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp, top_p=top_p, top_k=top_k)
    return Decoder(
        runtime.model,
        sampler,
        runtime.drafter,
        shape,
        runtime.max_context,
        PhaseTimer(timing),
        tree_sizes=tree_sizes(),
    )


def tree_sizes() -> tuple[int, ...]:
    """Tree sizes the decoder pads to on this backend (measured on CPU only; exact elsewhere)."""
    return CPU_TREE_SIZES if mx.default_device() == mx.cpu else ()


def encode_chat(runtime: Runtime, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the model's chat template and a generation prompt."""
    from redrafter_mlx.templates import apply_chat_template

    return apply_chat_template(runtime.tokenizer, messages, model_path=Path(runtime.model_id))
