"""`redrafter-mlx demo-model`: a tiny random model folder, to try the own-model path offline
(:mod:`redrafter_mlx.io.demo` does the work)."""

from __future__ import annotations

import argparse
import sys

from redrafter_mlx.cli import flags
from redrafter_mlx.io.demo import CHATS_NAME, FAMILIES, write_demo_model

EPILOG = """examples:
  redrafter-mlx demo-model --out models/demo
  redrafter-mlx generate --model models/demo --prompt "Hi!" --max-tokens 16
  redrafter-mlx train --model models/demo --data models/demo/chats.jsonl --out drafters/demo \\
      --heldout 2 --heldout-tokens 60 --batch-size 16 --epochs 2 --eval-every 10 --eval-prompts 1
  printf 'Hi!\\n' | redrafter-mlx chat --model models/demo --max-tokens 16
  redrafter-mlx demo-model --out models/demo-qwen3 --family qwen3
  # a hybrid: Gated DeltaNet (qwen3_5), short convolutions (lfm2) or Mamba2 (nemotron_h,
  # falcon_h1) layers among attention layers, speculated on exactly
  redrafter-mlx demo-model --out models/demo-hybrid --family qwen3_5
"""


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Write a tiny model with random weights (mlx-lm's own classes, the embedded "
        "SmolLM2's tokenizer and chat template) as an mlx-lm folder, with a few conversations "
        f"in {CHATS_NAME} for train --data: every command's --model path, offline, in seconds. "
        "Its answers are noise.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="output folder (must not exist, see --force)")
    p.add_argument(
        "--family",
        choices=list(FAMILIES),
        default="llama",
        help="mlx-lm family: attention only (llama, qwen3) or a hybrid with recurrent layers "
        "(qwen3_5, lfm2, nemotron_h, falcon_h1)",
    )
    p.add_argument("--seed", type=flags.at_least(0), default=0, help="seed of the random weights")
    p.add_argument("--force", action="store_true", help="replace an earlier demo-model folder")
    return p


@flags.reports_errors
def main(args: argparse.Namespace) -> None:
    out = write_demo_model(args.out, family=args.family, seed=args.seed, force=args.force)
    print(f"wrote {out}: a tiny random {args.family} model (noise, for trying commands)")
    hint = f"  {flags.program()} generate --model {out} --prompt 'Hi!' --max-tokens 16"
    print(hint, file=sys.stderr)
