"""What ``train`` does once the best drafter is in ``out``: a short evaluation (tokens/step in
the real greedy decode loop on a few MT-Bench first turns, the measurement ``eval-drafter``
makes with the command the card quotes), the model card, and the record that lets every
command find the drafter for this model (``io/drafters.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from redrafter_mlx.backend.plan import plan_for
from redrafter_mlx.core.decode.llm import compute_dtype
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.redrafter import load_drafter
from redrafter_mlx.io.card import record_card_facts, write_card
from redrafter_mlx.io.drafters import ModelIdentity, register, write_target_file
from redrafter_mlx.io.prompts import load_conversations
from redrafter_mlx.training import evaluate as ev

EVAL_SHAPE = BeamShape(width=2, length=4)  # a shape every drafter can search (K >= 2)
EVAL_TOKENS = 64  # new tokens per prompt: enough steps to count, seconds on a CPU


@dataclass(frozen=True)
class TrainedTarget:
    """The target a drafter was trained for, as ``train`` loaded it."""

    model: object
    tokenizer: object
    config: dict
    name: str  # --model as given (folder, Hub id, .gguf), or the embedded model's folder
    given: bool = True  # whether --model named it (else commands load it without --model)

    @property
    def model_flag(self) -> str:
        """`` --model NAME`` for the commands the card and the summary suggest, or nothing."""
        return f" --model {self.name}" if self.given else ""


def eval_command(target: TrainedTarget, out: Path, num_prompts: int) -> str:
    """The ``eval-drafter`` command that makes the same measurement as :func:`tokens_per_step`."""
    return (
        f"redrafter-mlx eval-drafter{target.model_flag} --drafter {out} "
        f"--num-prompts {num_prompts} "
        f"--max-tokens {EVAL_TOKENS} --beam-width {EVAL_SHAPE.width} "
        f"--beam-length {EVAL_SHAPE.length}"
    )


def tokens_per_step(target: TrainedTarget, out: Path, num_prompts: int) -> float | None:
    """Mean tokens/step of ``out``'s drafter on the first ``num_prompts`` MT-Bench first turns,
    greedy, at :data:`EVAL_SHAPE` (loaded as commands load it: float32 on the CPU plan)."""
    dtype = None if plan_for().drafter_float32 else compute_dtype(target.model)
    drafter = load_drafter(out, target.model, dtype)
    prompts = [c.turns[0] for c in load_conversations(None, num_prompts, 1)]
    job = ev.Evaluation(target.model, target.tokenizer, drafter, prompts, [EVAL_SHAPE], EVAL_TOKENS)
    return ev.evaluate(job)[0]["tokens_per_step"]


def finish(
    target: TrainedTarget, out: Path, best: dict, *, data: str, license_: str | None, prompts: int
) -> dict:
    """Evaluate ``out`` briefly (``prompts`` = 0: not at all), write its card, then register
    it for discovery: last, so that a run stopped before (a Ctrl-C or SIGTERM during the
    evaluation) leaves no registered drafter without its card; the card's facts."""
    identity = ModelIdentity.of(target.model, target.config, target.tokenizer)
    write_target_file(out, identity, target.name)
    facts = {
        "data": data,
        "heldout_agreement": best.get("agreement"),
        "tokens_per_step": tokens_per_step(target, out, prompts) if prompts else None,
        "measured_with": eval_command(target, out, prompts) if prompts else None,
        "license": license_,
    }
    record_card_facts(out, facts)
    write_card(out)
    register(out, identity, target.name, mean_agreement=best.get("mean_agreement"))
    return facts
