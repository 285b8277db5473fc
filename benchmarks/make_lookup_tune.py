"""Write benchmarks/data/lookup_tune.jsonl: the prompts the prompt-lookup settings are tuned on.

Spec-Bench's prompts (../shared/data/specbench_dev.jsonl) and MT-Bench are what the lookup
beams are *reported* on, so they are never tuned on. This split has the same kinds of task
where lookup matters, built from this repository's own prose (README.md, benchmarks/HISTORY.md,
which holds what benchmarks/README.md held then, and the drafter's PROVENANCE.md): "Summarize:
<passage>" (as Spec-Bench's summarisation prompts), "<passage>\\n<question>" (as its RAG
prompts), and a few short open questions (as MT-Bench) so the pick is not only for document
tasks. Deterministic: the same files give the same prompts.
The committed file (what runs 64-65 tuned on) is what those files gave at commit 3a2418f,
which added it; the README has changed since, so rerunning now writes other passages.

    python benchmarks/make_lookup_tune.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (
    "README.md",
    "benchmarks/HISTORY.md",
    "weights/smollm2-135m-instruct-drafter/PROVENANCE.md",
)
OUT = ROOT / "benchmarks" / "data" / "lookup_tune.jsonl"
WORDS = 300  # passage length (Spec-Bench's summarisation and RAG passages: 150-1000 words)
QUESTIONS = (
    "What problem does the text above describe, and how is it solved?",
    "Which numbers does the text above report, and what do they measure?",
    "What should a user do first, according to the text above?",
    "List the main steps the text above describes.",
)
OPEN = (
    "Explain what a hash table is and when to use one.",
    "Write a short email asking a colleague to review a pull request.",
    "Give three tips for writing clear documentation.",
    "What is the difference between a process and a thread?",
)


def prose(text: str) -> str:
    """The running text of a Markdown file: no code blocks, tables, headings or link targets."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    lines = [
        line
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith(("|", "#", "    "))
    ]
    text = re.sub(r"\]\([^)]*\)", "]", " ".join(lines))
    return re.sub(r"\s+", " ", text.replace("`", "")).strip()


def passages(count: int) -> list[str]:
    """``count`` passages of about WORDS words, spread over the sources."""
    words = " ".join(prose((ROOT / s).read_text(encoding="utf-8")) for s in SOURCES).split()
    step = max((len(words) - WORDS) // max(count - 1, 1), WORDS)
    return [" ".join(words[i : i + WORDS]) for i in range(0, step * count, step)][:count]


def main() -> None:
    texts = passages(12)
    rows = [{"category": "summarization", "turns": [f"Summarize: {t}"]} for t in texts[:6]]
    rows += [
        {"category": "rag", "turns": [f"{t}\n{QUESTIONS[i % len(QUESTIONS)]}"]}
        for i, t in enumerate(texts[6:])
    ]
    rows += [{"category": "open", "turns": [q]} for q in OPEN]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(OUT)
    print(f"wrote {len(rows)} prompts to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
