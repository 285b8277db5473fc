"""Prompt templates: the tokenizer's own chat template, or Vicuna v1.1 for Vicuna models."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redrafter_mlx.core.errors import ConfigError

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
VICUNA_ROLES = {"user": "USER", "assistant": "ASSISTANT"}
EOS = "</s>"


def vicuna_prompt(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Vicuna v1.1 prompt: ``SYSTEM USER: q ASSISTANT: a</s>USER: q2 ASSISTANT:``.

    A leading ``system`` message replaces the default system prompt. With
    ``add_generation_prompt`` the prompt ends with ``ASSISTANT:`` unless the last message is the
    assistant's.
    """
    system = VICUNA_SYSTEM
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    text = system + " "
    for m in messages:
        role = VICUNA_ROLES.get(m["role"])
        if role is None:
            raise ValueError(f"vicuna template: unsupported role {m['role']!r}")
        sep = EOS if m["role"] == "assistant" else " "
        text += f"{role}: {m['content']}{sep}"
    if add_generation_prompt and (not messages or messages[-1]["role"] != "assistant"):
        text += "ASSISTANT:"
    return text


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The underlying HF tokenizer of an mlx-lm ``TokenizerWrapper`` (or the tokenizer itself)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def has_chat_template(tokenizer: Any) -> bool:
    """True when the tokenizer carries its own chat template."""
    return bool(getattr(_hf_tokenizer(tokenizer), "chat_template", None))


@dataclass(frozen=True)
class ToolFormat:
    """How a model takes tools: its chat template lists them; its answers call them between
    ``start`` and ``end``, parsed by ``parse(text, tools)`` (mlx-lm's tool parser of the
    family, which gives ``{"name", "arguments"}`` or a list of them). Without a parser
    (None), calls stay in the answer's text."""

    start: str | None = None
    end: str | None = None
    parse: Callable[[str, Any], Any] | None = None


def tool_format(tokenizer: Any) -> ToolFormat | None:
    """The model's :class:`ToolFormat` (mlx-lm's wrapper inferred its parser from the
    template; Llama 3.x's bare JSON calls, which mlx-lm has no parser for, read here), or None
    when its chat template takes no tools."""
    template = getattr(_hf_tokenizer(tokenizer), "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return None
    if getattr(tokenizer, "has_tool_calling", False):
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        return ToolFormat(start, end, tokenizer.tool_parser)
    if "<|start_header_id|>" in template and LLAMA3_CALL in template:
        return ToolFormat(LLAMA3_CALL, "", parse_llama3_calls)
    return ToolFormat()


# How Llama 3.1-3.3 templates write a call, and so how their models begin one: a bare JSON
# object, ``{"name": "f", "parameters": {...}}``, alone in the answer (no closing tag).
LLAMA3_CALL = '{"name": '


def parse_llama3_calls(body: str, tools: Any = None) -> list[dict]:
    """Llama 3.x calls (the text after :data:`LLAMA3_CALL`): one JSON object, or several
    separated by ``;``, each ``{"name", "parameters"}`` -> ``{"name", "arguments"}``.
    ValueError unless each names one of ``tools`` (an answer that only quotes JSON stays
    text)."""
    names = {t["function"]["name"] for t in tools or []}
    decoder, text, at, calls = json.JSONDecoder(), LLAMA3_CALL + body, 0, []
    while at < len(text):
        call, at = decoder.raw_decode(text, at)
        if not isinstance(call, dict) or call.get("name") not in names:
            raise ValueError(f"not a call of the tools offered: {text[:80]!r}")
        arguments = call.get("parameters", call.get("arguments", {}))
        calls.append({"name": call["name"], "arguments": arguments})
        at = len(text) - len(text[at:].lstrip().lstrip(";").lstrip())
    return calls


def reasoning_tags(tokenizer: Any) -> tuple[str, str] | None:
    """The tags a model's answers put their reasoning between (``<think>``, ``</think>``):
    mlx-lm's, when the vocabulary has them; else Qwen3's when the chat template speaks of
    them; None when the model does not think aloud."""
    if getattr(tokenizer, "has_thinking", False):
        return tokenizer.think_start, tokenizer.think_end
    template = getattr(_hf_tokenizer(tokenizer), "chat_template", None)
    if isinstance(template, str) and "</think>" in template:
        return "<think>", "</think>"
    return None


def is_vicuna(tokenizer: Any, name: str | None = None, model_type: str | None = None) -> bool:
    """Vicuna: no chat template, and ``vicuna`` in the name or a Llama 32000-token SentencePiece."""
    if has_chat_template(tokenizer):
        return False
    if name and "vicuna" in str(name).lower():
        return True
    hf = _hf_tokenizer(tokenizer)
    sentencepiece = "llama" in type(hf).__name__.lower() or hasattr(hf, "sp_model")
    vocab = getattr(hf, "vocab_size", None)
    return model_type in (None, "llama") and sentencepiece and vocab == 32000


def encode_vicuna(
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True
) -> list[int]:
    """Tokenize a Vicuna prompt as Vicuna was trained: BOS, then each ``</s>``-separated piece
    encoded on its own (SentencePiece dummy prefix included) joined by EOS ids."""
    hf = _hf_tokenizer(tokenizer)
    pieces = vicuna_prompt(messages, add_generation_prompt).split(EOS)
    ids = [hf.bos_token_id] if hf.bos_token_id is not None else []
    for i, piece in enumerate(pieces):
        if i:
            ids.append(hf.eos_token_id)
        if piece:
            ids += hf.encode(piece, add_special_tokens=False)
    return ids


def _model_type(model_path: str | Path | None) -> str | None:
    try:
        return json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    except (TypeError, OSError, ValueError, AttributeError):
        return None


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    model_type: str | None = None,
    name: str | None = None,
    model_path: str | Path | None = None,
    tools: list[dict] | None = None,
    thinking: bool | None = None,
) -> list[int]:
    """Token ids of ``messages`` (with a generation prompt unless told otherwise), using the
    right template; ``tools`` (OpenAI's function format) go to the tokenizer's own template,
    and ``thinking`` (None: the template's default) to its ``enable_thinking`` switch.

    The tokenizer's own chat template wins; Vicuna models (``vicuna`` in ``name`` /
    ``model_path``, or a Llama with a 32000-token SentencePiece vocab) use Vicuna v1.1; other
    models without a template get the message contents joined by newlines.
    """
    hf = _hf_tokenizer(tokenizer)
    if model_path is not None:
        name = name or str(model_path)
        model_type = model_type or _model_type(model_path)
    if has_chat_template(tokenizer):
        extra = {} if tools is None else {"tools": tools}
        if thinking is not None:  # Qwen3's name, which other thinking templates took up
            extra["enable_thinking"] = thinking
        ids = hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **extra
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    if tools is not None:
        raise ConfigError("this model's chat template takes no tools")
    if is_vicuna(tokenizer, name, model_type):
        return encode_vicuna(tokenizer, messages, add_generation_prompt)
    return list(hf.encode("\n".join(m["content"] for m in messages)))


def check_text(text: str, what: str) -> str:
    """``text`` unchanged, or ConfigError naming the first byte that is not UTF-8 and its byte
    offset. Python hands undecodable command-line and stdin bytes over as lone surrogates
    (``surrogateescape``), which the tokenizers reject with a TypeError."""
    for i, char in enumerate(text):
        if "\udc80" <= char <= "\udcff":
            offset = len(text[:i].encode("utf-8", "surrogateescape"))
            raise ConfigError(
                f"{what}: byte 0x{ord(char) - 0xDC00:02x} at byte offset {offset} is not UTF-8 text"
            )
    return text


def read_stdin() -> str:
    """All of stdin as text; undecodable bytes reach :func:`check_text` as lone surrogates
    instead of raising mid-read."""
    sys.stdin.reconfigure(errors="surrogateescape")
    return sys.stdin.read()
