"""Phase 2 of distillation: train a drafter on the cached training split, evaluate it on the
held-out split every ``eval_every`` steps, keep the best one in ``out`` and a resumable
checkpoint in ``out/checkpoint``, and stop early when held-out agreement stops improving or
``max_minutes`` run out (the cosine schedule is fitted to end then).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from redrafter_mlx.core.atomic import write_text
from redrafter_mlx.core.drafters.redrafter import save_drafter
from redrafter_mlx.core.errors import TrainError
from redrafter_mlx.training import progress
from redrafter_mlx.training.cache import Cache, join_docs
from redrafter_mlx.training.checkpoint import (
    clear_staged,
    load_checkpoint,
    save_checkpoint,
    truncate_log,
)
from redrafter_mlx.training.examples import Examples, frequent_tokens
from redrafter_mlx.training.options import TrainOptions
from redrafter_mlx.training.ranks import ONE, Ranks, check_split
from redrafter_mlx.training.trainer import Trainer, build_trainer

FIT_AFTER = 50  # max_minutes: steps timed before the first fit of the schedule to the time
TIME_MARGIN = 0.95  # ... and the share of the time left that the fit plans to use


def train(
    model, cache: Cache, out: Path, opts: TrainOptions, *, run_options: dict, ranks: Ranks = ONE
) -> dict:
    """Train on the cached training split; early-stop on held-out agreement. Returns the best
    evaluation (also in ``out/train_log.jsonl``). ``run_options`` go into the checkpoint (a
    resumed run is compared against them). On several ``ranks`` training is data-parallel
    (``Trainer.step``) and rank 0 alone writes ``out``; they start from its drafter."""
    check_split(opts.batch_size, ranks)
    if not ranks.lead:
        opts = replace(opts, quiet=True)  # rank 0 shows progress and notes
    train_data, heldout_data = _splits(cache, opts)
    tokens = train_data["tokens"].tobytes() + heldout_data["tokens"].tobytes()
    ranks.check_same(tokens, f"the training data in --cache-dir {cache.root}")
    examples = Examples.build(train_data, opts.positions)
    heldout = Examples.build(heldout_data, opts.positions)
    total = planned_steps(len(examples.starts), opts)
    trainer = build_trainer(model, _draft_vocab(train_data, opts), opts, total)
    if ranks.lead:
        out.mkdir(parents=True, exist_ok=True)
        clear_staged(out)
    state = {"step": 0, "best": -1.0, "bad": 0, "tokens": int(train_data["tokens"].shape[0])}
    state["options"] = run_options
    if ranks.lead_says(opts.resume and (out / "checkpoint").exists()):
        state = _resume(trainer, out, ranks, run_options)
        fitted = state.get("total_steps", total)  # max_minutes shortened it
        total = trainer.schedule.total = min(total, fitted)
    else:
        if opts.resume and not opts.quiet:
            print(f"note: no checkpoint in {out}: starting at step 0", file=sys.stderr)
        trainer.drafter.update(ranks.share_tree(trainer.drafter.trainable_parameters()))
    if ranks.lead:
        truncate_log(out / "train_log.jsonl", state["step"])
    return run_loop(trainer, examples, heldout, out, state, opts, total, ranks)


def _resume(trainer: Trainer, out: Path, ranks: Ranks, run_options: dict) -> dict:
    """Rank 0 loads ``out/checkpoint`` into ``trainer`` and every rank gets its drafter,
    optimizer state and loop state; the loop state, with ``run_options``."""
    state = load_checkpoint(trainer, out / "checkpoint") if ranks.lead else None
    if ranks.size > 1:
        if not ranks.lead:  # the state's structure, to be filled with rank 0's
            trainer.optimizer.init(trainer.drafter.trainable_parameters())
        trainer.drafter.update(ranks.share_tree(trainer.drafter.trainable_parameters()))
        trainer.optimizer.state = ranks.share_tree(trainer.optimizer.state)
        state = ranks.share_json(state)
    return {**state, "options": run_options}


def _splits(cache: Cache, opts: TrainOptions) -> tuple[dict, dict]:
    """``(training, held-out)`` token streams: the cache's (training up to ``max_tokens``),
    training plus every ``extra_cache``'s."""
    train_data = cache.load("train", opts.max_tokens)
    heldout_data = cache.load("heldout")
    for split, found in (("training", train_data), ("held-out", heldout_data)):
        if found is None:
            raise TrainError(
                f"{cache.root}: no {split} tokens were extracted (answers too short for "
                "--max-seq-len, or --cache-max-gb already used up)"
            )
    return with_extra_caches(train_data, cache, opts.extra_cache), heldout_data


def with_extra_caches(data: dict[str, np.ndarray], cache: Cache, extra) -> dict:
    """``data`` plus every training shard of each ``extra`` cache folder (same target)."""
    parts = [data]
    for folder in map(Path, extra):
        other = Cache.existing(folder)
        if other.manifest["identity"]["fingerprint"] != cache.manifest["identity"]["fingerprint"]:
            raise TrainError(f"--extra-cache {folder} was extracted from another target")
        extra_data = other.load("train")
        if extra_data is None:
            raise TrainError(f"--extra-cache {folder}: no training shards")
        parts.append(extra_data)
    return join_docs(parts) if len(parts) > 1 else data


def planned_steps(positions: int, opts: TrainOptions) -> int:
    """Optimizer steps of ``opts.epochs`` over ``positions`` training positions; TrainError
    when that is not even one."""
    total = int(opts.epochs * positions / opts.batch_size)
    if total < 1:
        raise TrainError(
            f"{positions:,} training positions make no step of --batch-size "
            f"{opts.batch_size} in --epochs {opts.epochs}: lower the batch size or add data"
        )
    return total


def _draft_vocab(train_data: dict[str, np.ndarray], opts: TrainOptions) -> np.ndarray | None:
    """The ``opts.draft_vocab`` most frequent predicted tokens ``(K,)``; None: full vocab."""
    if not opts.draft_vocab:
        return None
    vocab = frequent_tokens(train_data, opts.draft_vocab)
    if len(vocab) < opts.draft_vocab and not opts.quiet and not opts.init:
        print(
            f"note: draft vocabulary {len(vocab):,} tokens, not {opts.draft_vocab:,}: the target "
            "predicts no more distinct tokens at the training answers' positions",
            file=sys.stderr,
        )
    return vocab


def run_loop(
    trainer: Trainer,
    examples: Examples,
    heldout: Examples,
    out: Path,
    state: dict,
    opts: TrainOptions,
    total_steps: int,
    ranks: Ranks = ONE,
) -> dict:
    """The step / evaluate / checkpoint loop with a rich progress bar, from ``state["step"]``
    to ``total_steps`` (fewer when ``max_minutes`` fits the schedule). Returns the best
    evaluation."""
    start, seen0, losses = time.perf_counter(), state["step"], []
    before = state.get("seconds", 0.0)  # trained before a resume
    best, total = state.get("best_eval", {}), total_steps
    marks = {"step": seen0, "comm": 0.0}  # at the last evaluation: its exchange time per step
    lines, stopped, agree = progress.PlainLines(opts.quiet), None, "-"
    with Progress(*_train_columns(), disable=opts.quiet, console=progress.console()) as bar:
        task = bar.add_task("", total=total, completed=seen0, loss="-", agree="-", rate="", eta="")
        while state["step"] < total:
            rows = batch_rows(examples, state["step"], opts)
            losses.append(trainer.step(examples, rows, ranks))
            state["step"] = step = state["step"] + 1
            elapsed = _clock(start, opts, ranks)
            rate = _rate(trainer, step - seen0, elapsed, opts, ranks)
            time_left = opts.max_minutes * 60 - before - elapsed if opts.max_minutes else None
            shown, eta = progress.fitted(
                total, have=step, done=step - seen0, seconds=elapsed, time_left=time_left
            )  # the schedule is fitted after FIT_AFTER steps; what is shown, from the first
            loss = np.mean(losses[-50:])
            bar.update(task, completed=step, total=shown, loss=f"{loss:.3f}", rate=rate, eta=eta)
            if lines.due():
                progress.say(
                    f"train step {step}/{shown} ({100 * step / shown:.0f}%), loss {loss:.3f}, "
                    f"agree {agree}, {rate}, {eta}"
                )
            timed_out = opts.max_minutes and before + elapsed > opts.max_minutes * 60
            if opts.max_minutes and step - seen0 == FIT_AFTER:
                total = _refit(trainer, total, step - seen0, elapsed, step, opts, before)
                bar.update(task, total=total)
            if step % opts.eval_every and step < total and not timed_out:
                continue
            ev = trainer.agreement(heldout, ranks=ranks)
            ev.update(_progress(trainer, examples, state, losses, opts, ranks, marks))
            ev.update(seconds=round(before + elapsed, 1))
            state.update(seconds=before + elapsed, total_steps=total)
            best = _keep(trainer, ev, out, state, ranks.lead) or best
            agree = "/".join(f"{a:.2f}" for a in ev["agreement"])
            bar.update(task, agree=agree)
            if stopped := _stop_reason(state, opts, timed_out):
                break
            if opts.max_minutes:
                elapsed = _clock(start, opts, ranks)  # evaluation included
                total = _refit(trainer, total, step - seen0, elapsed, step, opts, before)
                bar.update(task, total=total)
    if stopped and not opts.quiet:
        print(f"stopped early at step {state['step']} of {total}: {stopped}", file=sys.stderr)
    return {**best, "stopped": stopped or f"finished the planned {total} steps"}


def _stop_reason(state: dict, opts: TrainOptions, timed_out: bool) -> str | None:
    """Why training stops after this evaluation, in words; None to go on."""
    if state["bad"] >= opts.patience:
        return (
            f"held-out agreement did not improve in {opts.patience} evaluations (--patience); "
            f"the best one (step {state.get('best_eval', {}).get('step')}) is kept"
        )
    if timed_out:
        return f"--max-minutes {opts.max_minutes:g} reached (the schedule was fitted to end here)"
    return None


def _clock(start: float, opts: TrainOptions, ranks: Ranks) -> float:
    """Seconds since ``start``; with ``max_minutes`` on several ranks rank 0's, so that all
    stop at the same step."""
    elapsed = time.perf_counter() - start
    if opts.max_minutes and ranks.size > 1:
        elapsed = float(ranks.share(np.array([elapsed]))[0])
    return elapsed


def _rate(trainer: Trainer, steps: int, seconds: float, opts: TrainOptions, ranks) -> str:
    """Training positions per second of all ranks together (and, on several, the time a
    step spends exchanging gradients)."""
    rate = f"{steps * opts.batch_size / seconds:.0f} pos/s"
    if ranks.size == 1:
        return rate
    return f"{rate}, {ranks.size} ranks, {trainer.comm_seconds / steps * 1e3:.0f} ms/step exchange"


def _progress(trainer, examples, state, losses, opts: TrainOptions, ranks, marks) -> dict:
    """An evaluation's log fields besides agreement: where training is, its recent loss, the
    ranks and (several) the gradient exchange's time per step since the last evaluation."""
    step = state["step"]
    fields = {
        "step": step,
        "examples": step * opts.batch_size,
        "epoch": round(step / max(len(examples.starts) // opts.batch_size, 1), 3),
        "train_tokens": state["tokens"],
        "loss": float(np.mean(losses[-opts.eval_every :])),
        "ranks": ranks.size,
    }
    if ranks.size > 1:
        steps, comm = step - marks["step"], trainer.comm_seconds - marks["comm"]
        fields["exchange_ms_per_step"] = round(comm / max(steps, 1) * 1e3, 3)
        marks.update(step=step, comm=trainer.comm_seconds)
    return fields


def _train_columns() -> tuple:
    return (
        TextColumn("train"),
        BarColumn(),
        TextColumn(
            "{task.completed}/{task.total} loss {task.fields[loss]} agree {task.fields[agree]} "
            "{task.fields[rate]}"
        ),
        TimeElapsedColumn(),
        TextColumn("{task.fields[eta]}"),
    )


def batch_rows(examples: Examples, step: int, opts: TrainOptions) -> np.ndarray:
    """The example positions ``(B,)`` of optimizer step ``step``: each epoch is its own
    permutation (seeded by ``seed + epoch``), so a resumed run draws the same batches."""
    per_epoch = max(len(examples.starts) // opts.batch_size, 1)
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng(opts.seed + epoch).permutation(examples.starts)
    return order[k * opts.batch_size : (k + 1) * opts.batch_size]


def _keep(trainer: Trainer, ev: dict, out: Path, state: dict, lead: bool = True) -> dict | None:
    """Log evaluation ``ev``, save the drafter to ``out`` when it is the best so far (then
    return ``ev``), and checkpoint the run; only ``lead`` (rank 0) writes."""
    if lead:
        _log(out / "train_log.jsonl", ev)
    improved = ev["mean_agreement"] > state["best"]
    if improved:
        state.update(best=ev["mean_agreement"], bad=0, best_eval=ev)
        if lead:
            save_drafter(trainer.drafter, out)
    else:
        state["bad"] += 1
    if lead:
        save_checkpoint(trainer, out / "checkpoint", state)
    return ev if improved else None


def _log(path: Path, ev: dict) -> None:
    """Append ``ev`` to the log, atomically (the whole file is rewritten: a kill mid-write
    leaves the old one)."""
    old = path.read_text() if path.exists() else ""
    write_text(path, old + json.dumps(ev) + "\n")


def _refit(trainer, total, steps, seconds, step, opts: TrainOptions, before) -> int:
    """``fit_to_time``, applied to the trainer's schedule too; the new total."""
    total = fit_to_time(
        total, steps=steps, seconds=seconds, step=step, max_minutes=opts.max_minutes, before=before
    )
    trainer.schedule.total = total
    return total


def fit_to_time(
    total_steps: int,
    *,
    steps: int,
    seconds: float,
    step: int,
    max_minutes: float,
    before: float = 0.0,
) -> int:
    """``total_steps`` shortened to the steps that fit in what ``max_minutes`` leaves after
    ``before`` seconds (trained before a resume) and ``seconds`` (this process, evaluations
    included, in which it made ``steps`` steps: the rate), from step ``step`` on, so the
    learning rate has decayed when time runs out. Never lengthens it."""
    left = max_minutes * 60 - before - seconds
    fit = step + max(int(left * steps / seconds * TIME_MARGIN), 1)
    return min(fit, total_steps)
