"""Prompt files: JSONL with "turns", "prompt" or "text" per line, and optionally a "category";
the shipped MT-Bench prompts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MT_BENCH = Path(__file__).resolve().parent.parent / "data" / "mt_bench.jsonl"


@dataclass(frozen=True)
class Conversation:
    turns: list[str]  # the user's turns
    category: str | None = None  # the line's "category" (MT-Bench, Spec-Bench), if any


def load_prompts(path: Path | str | None, num: int | None, turns: int) -> list[list[str]]:
    """User turns per conversation from a JSONL with "turns", "prompt" or "text" (default:
    MT-Bench). ValueError names the line of a malformed one."""
    return [c.turns for c in load_conversations(path, num, turns)]


def load_conversations(path: Path | str | None, num: int | None, turns: int) -> list[Conversation]:
    """:func:`load_prompts` with each line's category (a string, else None)."""
    path = Path(path) if path else MT_BENCH
    if not path.is_file():
        raise ValueError(f"{path}: {'a folder, not a' if path.is_dir() else 'no such'} file")
    convs = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
        item = item if isinstance(item, dict) else {}
        user_turns = item.get("turns") or [item.get("prompt", item.get("text"))]
        if not all(isinstance(t, str) for t in user_turns):
            raise ValueError(f'{path}:{line_no}: needs a "turns" list or a "prompt" string')
        if not all(t.strip() for t in user_turns):
            raise ValueError(f"{path}:{line_no}: an empty prompt")
        category = item.get("category")
        convs.append(
            Conversation(user_turns[:turns], category if isinstance(category, str) else None)
        )
    return convs[:num] if num else convs
