"""A drafter folder's model card (``README.md``): what it drafts for, what it was trained on,
how well it does and how to load it. ``train`` records the facts in the folder's
``target.json`` (under ``"card"``) and writes the card; ``upload`` rewrites it naming the Hub
repository."""

from __future__ import annotations

import json
from pathlib import Path

from redrafter_mlx.core.atomic import write_text
from redrafter_mlx.io.checks import looks_like_hub_id
from redrafter_mlx.io.drafters import TARGET_FILE, read_target_file

CARD_NAME = "README.md"
# A drafter is trained on the target's own outputs: the target's license governs its use.
DEFAULT_LICENSE = "the target model's license (the drafter is distilled from its outputs)"


def card_facts(folder: Path) -> dict:
    """What the card says, from ``target.json``: the model, and ``train``'s ``"card"`` facts."""
    recorded = read_target_file(folder) or {}
    return {"model": recorded.get("model"), **(recorded.get("card") or {})}


def record_card_facts(folder: Path, facts: dict) -> None:
    """Keep ``facts`` in ``target.json`` (atomic), for the card ``upload`` writes later."""
    recorded = read_target_file(folder) or {}
    text = json.dumps({**recorded, "card": facts}, indent=2) + "\n"
    write_text(Path(folder) / TARGET_FILE, text)


def render_card(facts: dict, *, drafter: str) -> str:
    """The card's Markdown for the drafter loaded as ``drafter`` (a folder or a Hub id)."""
    model = facts.get("model") or "(unknown: no target.json)"
    agreement = facts.get("heldout_agreement")
    per_position = " / ".join(f"{a:.3f}" for a in agreement) if agreement else "not measured"
    tps = facts.get("tokens_per_step")
    measured = (
        f"{tps:.2f} tokens/step, measured with `{facts.get('measured_with')}`"
        if tps is not None
        else "not measured"
    )
    lines = [
        *_front_matter(model, facts.get("license")),
        f"# ReDrafter drafter for {model}",
        "",
        "A [ReDrafter](https://arxiv.org/abs/2403.09919) drafter for redrafter-mlx "
        "(`pip install redrafter-mlx`): it proposes beams of draft tokens that the target "
        "model verifies in one pass, so the output is the target's own.",
        "",
        f"- **Target**: {model}",
        f"- **Data**: {facts.get('data') or 'not recorded'}",
        f"- **Held-out agreement** (top-1, per future position): {per_position}",
        f"- **Speed-up**: {measured}",
        f"- **License**: {facts.get('license') or DEFAULT_LICENSE}",
        "",
        "## How to load it",
        "",
        "```",
        f"redrafter-mlx generate --model {model} --drafter {drafter} --prompt 'Hello'",
        "```",
        "",
        "Without `--drafter`, redrafter-mlx finds a drafter trained on the same machine for the "
        "model, or one shipped in the model's `redrafter/` folder. This folder's `target.json` "
        "records the model's identity (sizes, config and tokenizer fingerprints): a model that "
        "does not match is refused.",
    ]
    return "\n".join(lines) + "\n"


def _front_matter(model: str, license_: str | None) -> list[str]:
    """The Hub's YAML header: tags, the base model when it is a Hub id, a license id if given
    as one (a word without spaces)."""
    lines = ["---", "library_name: redrafter-mlx", "tags:", "- redrafter", "- speculative-decoding"]
    lines.append("- mlx")
    if looks_like_hub_id(model):
        lines.append(f"base_model: {model}")
    if license_ and " " not in license_:
        lines.append(f"license: {license_}")
    return [*lines, "---", ""]


def card_text(folder: Path, *, drafter: str | None = None, model: str | None = None) -> str:
    """The card of ``folder`` from its recorded facts; ``drafter``: how the card says to load
    it (default: the folder's path); ``model``: the target's name for readers elsewhere (a Hub
    id), instead of the one ``train`` recorded (often a local folder)."""
    facts = card_facts(folder) | ({"model": model} if model else {})
    return render_card(facts, drafter=drafter or str(folder))


def write_card(folder: Path, *, drafter: str | None = None, model: str | None = None) -> Path:
    """Write ``folder/README.md`` (:func:`card_text`, atomic)."""
    path = Path(folder) / CARD_NAME
    write_text(path, card_text(folder, drafter=drafter, model=model))
    return path
