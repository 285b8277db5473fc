"""Prompt files: JSONL with "turns", "prompt" or "text" per line; the shipped MT-Bench prompts."""

from __future__ import annotations

import json
from pathlib import Path

MT_BENCH = Path(__file__).resolve().parent.parent / "data" / "mt_bench.jsonl"


def load_prompts(path: Path | str | None, num: int | None, turns: int) -> list[list[str]]:
    """User turns per conversation from a JSONL with "turns", "prompt" or "text" (default:
    MT-Bench). ValueError names the line of a malformed one."""
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
        convs.append(user_turns[:turns])
    return convs[:num] if num else convs
