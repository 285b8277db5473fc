"""`redrafter-mlx demo-model`: a tiny random model folder, to try the own-model path offline
(:mod:`redrafter_mlx.io.demo` does the work)."""

from __future__ import annotations

import argparse
import sys

from redrafter_mlx.cli import flags
from redrafter_mlx.io.demo import CHATS_NAME, FAMILIES, write_demo_model
from redrafter_mlx.io.demo_drafters import KINDS, write_demo_drafter

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
  # a model coding agents can be pointed at offline (a tools chat template, a 128K context;
  # docs/serving.md has each agent's set-up)
  redrafter-mlx demo-model --out models/demo-agent --agent
  # rehearse a field drafter type offline: the model and a random drafter of that type
  redrafter-mlx demo-model --out models/demo-e3 --drafter eagle3
  redrafter-mlx generate --model models/demo-e3 --drafter models/demo-e3-eagle3 --prompt Hi!
  redrafter-mlx serve --model models/demo-agent --drafter none
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
    p.add_argument(
        "--agent",
        action="store_true",
        help="with a chat template that takes tools and a 128K context: a model coding agents "
        "(Claude Code, Codex CLI, opencode, ...) can be served offline",
    )
    p.add_argument(
        "--drafter",
        choices=KINDS,
        help="also write a random drafter of this type for the model, as its authors' "
        "repositories lay one out, into OUT-TYPE (or --drafter-out): rehearse loading, "
        "generating, serving and bench with it before downloading a real one",
    )
    p.add_argument("--drafter-out", help="where --drafter writes (default: OUT-TYPE)")
    p.add_argument("--seed", type=flags.at_least(0), default=0, help="seed of the random weights")
    p.add_argument("--force", action="store_true", help="replace an earlier demo-model folder")
    return p


@flags.reports_errors
def main(args: argparse.Namespace) -> None:
    out = write_demo_model(
        args.out, family=args.family, seed=args.seed, force=args.force, agent=args.agent
    )
    kind = " with a tools chat template and a 128K context" if args.agent else ""
    print(f"wrote {out}: a tiny random {args.family} model{kind} (noise, for trying commands)")
    drafter = ""
    if args.drafter:
        where = args.drafter_out or f"{str(args.out).rstrip('/')}-{args.drafter}"
        path = write_demo_drafter(where, out, args.drafter, seed=args.seed)
        print(f"wrote {path}: a random {args.drafter} drafter for it (its drafts are noise)")
        drafter = f" --drafter {path}"
    hint = f"  {flags.program()} generate --model {out}{drafter} --prompt 'Hi!' --max-tokens 16"
    print(hint, file=sys.stderr)
