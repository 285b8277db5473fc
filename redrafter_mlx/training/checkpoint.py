"""A run's ``--out`` folder: the best drafter (``config.json``, ``model.safetensors``), the
evaluation log ``train_log.jsonl`` and the resumable ``checkpoint/`` (drafter, optimizer state,
loop state ``state.json``), and which folders a new run may write into."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from redrafter_mlx.core.atomic import staged_dir, write_text
from redrafter_mlx.core.drafters.redrafter import save_drafter
from redrafter_mlx.core.errors import TrainError
from redrafter_mlx.training.trainer import Trainer

RUN_FILES = {"train_log.jsonl", "config.json", "model.safetensors"}  # what training writes


def save_checkpoint(trainer: Trainer, folder: Path, state: dict) -> None:
    """Drafter + optimizer + loop state into ``folder`` atomically (write aside, then swap)."""
    with staged_dir(folder) as tmp:
        save_drafter(trainer.drafter, tmp)
        mx.save_safetensors(
            str(tmp / "optimizer.safetensors"), dict(tree_flatten(trainer.optimizer.state))
        )
        (tmp / "state.json").write_text(json.dumps(state, indent=1))


def load_checkpoint(trainer: Trainer, folder: Path) -> dict:
    """Restore drafter weights, optimizer state and loop state saved by save_checkpoint."""
    weights = mx.load(str(folder / "model.safetensors"))
    trainer.drafter.load_weights(list(weights.items()), strict=True)
    opt = mx.load(str(folder / "optimizer.safetensors"))
    trainer.optimizer.state = tree_unflatten(list(opt.items()))
    mx.eval(trainer.drafter.parameters(), trainer.optimizer.state)
    return json.loads((folder / "state.json").read_text())


def clear_staged(out: Path) -> None:
    """Remove checkpoints staged by a run killed mid-save (``staged_dir``'s temp folders)."""
    for stale in out.glob(".checkpoint.*-*"):
        shutil.rmtree(stale, ignore_errors=True)


def truncate_log(path: Path, step: int) -> None:
    """Keep the log lines up to ``step``, the checkpoint's (a run killed after an evaluation
    but before its checkpoint, or a fresh start over an old log, leaves lines beyond it)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut off by the kill
    write_text(path, "".join(kept))


def finished(state: dict, *, patience: int, max_minutes: float) -> bool:
    """Whether a checkpoint's run ended: all its steps, early stopping, or its ``max_minutes``."""
    ran_out = "total_steps" in state and state["step"] >= state["total_steps"]
    # in minutes, as the option is given: seconds / 60 * 60 need not give the seconds back
    timed_out = max_minutes and state.get("seconds", 0.0) / 60 >= max_minutes
    return bool(ran_out or state.get("bad", 0) >= patience or timed_out)


def check_out_is_free(out: Path) -> None:
    """Refuse an --out without a checkpoint that holds other files than a training run's (a
    model, a shipped drafter): training writes config.json and model.safetensors there. A run
    killed before its first checkpoint (its train_log.jsonl is there) may start again."""
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    own_run = "train_log.jsonl" in held and all(
        name in RUN_FILES or name.startswith(".checkpoint.") for name in held
    )
    if held and not own_run:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise TrainError(
            f"--out {out} already holds {shown} and no training checkpoint: training "
            "would overwrite it; choose a new or empty folder"
        )
