"""Anthropic's Messages API for `redrafter-mlx serve`: ``POST /v1/messages`` (whole answers,
or Anthropic's server-sent events with ``"stream": true``) and ``POST
/v1/messages/count_tokens``. Pure functions, no HTTP and no model: requests become the
same :class:`~redrafter_mlx.server.protocol.Call` the OpenAI side makes, answers are built from
the same :class:`~redrafter_mlx.server.protocol.Answer`.

What maps how:
- ``system`` and the messages' text blocks -> the chat template's messages; ``tool_use``
  blocks -> an assistant message's ``tool_calls``; ``tool_result`` blocks -> ``role: "tool"``
  messages; ``tools`` (``name``, ``description``, ``input_schema``) -> OpenAI's function
  format, which chat templates read; ``tool_choice`` auto / any / tool / none.
- ``system`` messages inside ``messages`` (Claude Code's notes after a user turn) are added to
  the system prompt, in order: chat templates take one system message, first.
- ``thinking`` (enabled / adaptive / disabled) is the chat template's reasoning switch; the
  model's reasoning comes back as ``thinking`` blocks (``thinking_delta`` events), with an
  empty signature. Its ``budget_tokens`` is not enforced.
- Any ``model`` name is answered by the model served (an agent may ask for its own names);
  the answer's ``model`` says which. Fields a local server cannot act on and may leave
  (``metadata``, ``context_management``, ``output_config.effort``, ``cache_control``,
  ``service_tier``...) are ignored; what would change the answer's form and cannot be done
  (``output_config.format``, ``mcp_servers``, server tools, images, documents) is refused.
- ``usage``: ``input_tokens`` are the prompt's tokens the KV cache did not hold,
  ``cache_read_input_tokens`` those it held (Anthropic's split), plus our ``redrafter`` block.
"""

from __future__ import annotations

import uuid

from redrafter_mlx.core.serving.service import Request, Started
from redrafter_mlx.server import protocol as h
from redrafter_mlx.server.protocol import ApiError, Call, Limits

MAX_TEMPERATURE = 1.0  # as Anthropic's API
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "context": "max_tokens",
    "tool_calls": "tool_use",
}
# Anthropic's error types by HTTP status (503: this server's full queue, Anthropic's 529)
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    411: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(error: ApiError) -> dict:
    """Anthropic's error object: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else None)
    kind = kind or "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": error.message}}


# ---------------------------------------------------------------- parsing requests


def parse_messages(body: dict, limits: Limits) -> Call:
    """A ``POST /v1/messages`` body -> Call."""
    prompt, offered, forced = _prompt(body, limits)
    request = Request(
        prompt,
        max_tokens=h.max_tokens(body, limits, "max_tokens", required=True),
        sampling=h.sampling(body, limits, max_temperature=MAX_TEMPERATURE),
        stop_strings=_stop_sequences(body.get("stop_sequences")),
    )
    stream = h.boolean(body, "stream", False)
    call_id = f"msg_{uuid.uuid4().hex[:24]}"
    return Call("messages", request, stream, id=call_id, tools=offered, forced_call=forced)


def _stop_sequences(value) -> tuple[str, ...]:
    """``stop_sequences``: an array of strings (OpenAI's ``stop`` may be one string; this
    field may not)."""
    if value is not None and not isinstance(value, list):
        raise h.invalid("stop_sequences", f"must be an array of strings, got {h.shown(value)}")
    return h.stop_strings(value, "stop_sequences")


def parse_count(body: dict, limits: Limits):
    """A ``POST /v1/messages/count_tokens`` body -> the service prompt to count."""
    return _prompt(body, limits)[0]


def _prompt(body: dict, limits: Limits) -> tuple:
    """The fields a message and a count share -> ``(prompt, tools offered, forced)``."""
    if "messages" not in body:
        raise h.missing("messages")
    _refuse_unservable(body)
    notes, messages = _messages(body["messages"])
    messages = _system([_system_text(body.get("system"), "system"), *notes]) + messages
    tools = h.tool_list(body.get("tools"), _tool)
    choice = _tool_choice(body.get("tool_choice"), tools)
    return h.chat_prompt(messages, tools, choice, limits, _thinking(body.get("thinking")))


def _refuse_unservable(body: dict) -> None:
    """Fields whose request this server cannot honour and must not pretend to."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise h.invalid("output_config", "must be an object")
    if (config or {}).get("format") is not None:
        raise h.unsupported("output_config.format", "structured outputs need constrained decoding")
    if body.get("mcp_servers"):
        raise h.unsupported("mcp_servers", "this server calls no MCP servers: give their tools")


def _thinking(value) -> bool | None:
    """``thinking`` -> the template's reasoning switch (None: its default)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise h.invalid("thinking", "must be {'type': 'enabled' | 'adaptive' | 'disabled'}")
    return kind != "disabled"


def _system_text(value, where: str) -> str:
    if value is None:
        return ""
    return h.text(value, where) if isinstance(value, str) else _text_blocks(value, where)


def _system(texts: list[str]) -> list[dict]:
    """The system prompt and the system messages' notes after it, as one system message."""
    text = "\n\n".join(t for t in texts if t)
    return [{"role": "system", "content": text}] if text else []


def _messages(value) -> tuple[list[str], list[dict]]:
    """``(the system messages' texts, the other messages as templates read them)``."""
    if not isinstance(value, list):
        raise h.invalid("messages", "must be an array of messages")
    if not value:
        raise h.invalid("messages", "is empty: send at least one")
    notes, out = [], []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "system":
            notes.append(_system_text(message.get("content"), f"{where}.content"))
            continue
        if role not in ("user", "assistant"):
            raise h.invalid(f"{where}.role", "must be 'user', 'assistant' or 'system'")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": h.text(content, where)})
        elif message["role"] == "user":
            out += _user_blocks(content, f"{where}.content")
        else:
            out.append(_assistant_blocks(content, f"{where}.content"))
    if not out:
        raise h.invalid("messages", "has no user or assistant message: send at least one")
    return notes, out


def _blocks(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(b, dict) for b in value):
        raise h.invalid(where, "must be a string or an array of content blocks")
    return value


def _user_blocks(value, where: str) -> list[dict]:
    """A user turn: its tool results (one ``tool`` message each), then its text."""
    results, texts = [], []
    for i, block in enumerate(_blocks(value, where)):
        kind = block.get("type")
        if kind == "tool_result":
            content = block.get("content", "")
            if not isinstance(content, str):
                content = _text_blocks(content, f"{where}[{i}].content")
            tool_id = h.text(block.get("tool_use_id"), f"{where}[{i}].tool_use_id")
            results.append({"role": "tool", "tool_call_id": tool_id, "content": content})
        elif kind == "text":
            texts.append(h.text(block.get("text"), f"{where}[{i}].text"))
        else:
            raise h.unsupported(where, f"{h.shown(kind)} blocks (text and tool_result are)")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _assistant_blocks(value, where: str) -> dict:
    """An assistant turn: its text and its tool calls (thinking blocks are left out)."""
    texts, calls = [], []
    for i, block in enumerate(_blocks(value, where)):
        kind = block.get("type")
        if kind == "text":
            texts.append(h.text(block.get("text"), f"{where}[{i}].text"))
        elif kind == "tool_use":
            name = h.text(block.get("name"), f"{where}[{i}].name")
            args = h.call_arguments(block.get("input", {}), f"{where}[{i}].input")
            function = {"name": name, "arguments": args}
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": function})
        elif kind not in ("thinking", "redacted_thinking"):
            raise h.unsupported(where, f"{h.shown(kind)} blocks (text and tool_use are)")
    message = {"role": "assistant", "content": "".join(texts)}
    return message | ({"tool_calls": calls} if calls else {})


def _text_blocks(value, where: str) -> str:
    blocks = _blocks(value, where)
    if not all(b.get("type") == "text" for b in blocks):
        raise h.unsupported(where, "blocks other than text")
    return "".join(h.text(b.get("text"), where) for b in blocks)


def _tool(tool, where: str) -> dict:
    """One of ``tools``: ``name``, ``description``, ``input_schema`` (no server tools)."""
    if not isinstance(tool, dict):
        raise h.invalid(where, "must be an object with a name and an input_schema")
    if tool.get("type") not in (None, "custom"):
        raise h.unsupported("tools", f"{where}: server tools ({h.shown(tool['type'])})")
    fields = {k: tool[k] for k in ("name", "description", "input_schema") if k in tool}
    return h.function_tool(fields, where, parameters="input_schema")


def _tool_choice(value, tools: list[dict]):
    """``tool_choice`` -> "auto", "none", "required" or the name of the tool to call."""
    if value is None:
        return "auto" if tools else "none"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(value.get("name"), str):
        return value["name"]
    raise h.invalid("tool_choice", "must be {'type': 'auto' | 'any' | 'tool' | 'none'}")


# ---------------------------------------------------------------- building responses


def usage(outcome: h.Outcome) -> dict:
    return {
        "input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
        "output_tokens": outcome.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": outcome.cached_tokens,
        "redrafter": outcome.redrafter(),
    }


def stop_reason(answer: h.Answer) -> str | None:
    if answer.stop_string is not None and not answer.calls:
        return "stop_sequence"
    return STOP_REASONS.get(answer.finish_reason, answer.finish_reason)


class Anthropic(h.Api):
    """Messages: a whole ``message``, or its stream of events."""

    name = "Anthropic"

    def __init__(self, model: str):
        self.model = model

    def error_body(self, error: ApiError) -> dict:
        return error_body(error)

    def stream_error(self, error: ApiError) -> tuple:
        return "error", error_body(error)

    def response(self, call: Call, answer: h.Answer, outcome: h.Outcome) -> dict:
        blocks = [_thinking_block(answer.reasoning)] if answer.reasoning else []
        blocks += [{"type": "text", "text": answer.text}] if answer.text else []
        blocks += [_tool_use(c) for c in answer.calls]
        return self.message(call, blocks, usage(outcome)) | {
            "stop_reason": stop_reason(answer),
            "stop_sequence": answer.stop_string,
        }

    def message(self, call: Call, blocks: list, usage_: dict) -> dict:
        return {
            "id": call.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": blocks,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_,
        }

    def stream(self, call: Call, started: Started) -> AnthropicStream:
        return AnthropicStream(self, call, started)


class AnthropicStream(h.Stream):
    """Anthropic's event sequence: ``message_start``; per content block
    ``content_block_start``, its deltas (``thinking_delta`` then a ``signature_delta``,
    ``text_delta``, or one ``input_json_delta`` for a tool call) and
    ``content_block_stop``, with a ``ping`` after the first block's start; ``message_delta``
    (stop reason, usage) and ``message_stop``."""

    def __init__(self, api: Anthropic, call: Call, started: Started):
        self.api, self.call, self.started = api, call, started
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the last block's type while it is open ("text"...)
        self.pinged = False

    def begin(self) -> list[tuple]:
        first = {
            "input_tokens": self.started.prompt_tokens - self.started.cached_tokens,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.started.cached_tokens,
        }
        return [_event("message_start", message=self.api.message(self.call, [], first))]

    def piece(self, piece: h.Piece) -> list[tuple]:
        events = []
        if piece.reasoning:
            events += self._open("thinking", _thinking_block(""))
            delta = {"type": "thinking_delta", "thinking": piece.reasoning}
            events.append(_event("content_block_delta", index=self.blocks - 1, delta=delta))
        if piece.text:
            events += self._open("text", {"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": piece.text}
            events.append(_event("content_block_delta", index=self.blocks - 1, delta=delta))
        for call in piece.calls:
            events += self._close()
            events += self._start(_tool_use(call) | {"input": {}})
            delta = {"type": "input_json_delta", "partial_json": call.arguments_json()}
            events.append(_event("content_block_delta", index=self.blocks - 1, delta=delta))
            events.append(_event("content_block_stop", index=self.blocks - 1))
        return events

    def end(self, answer: h.Answer, outcome: h.Outcome) -> list[tuple]:
        events = self._close() + ([] if self.pinged else [_event("ping")])
        delta = {"stop_reason": stop_reason(answer), "stop_sequence": answer.stop_string}
        events.append(_event("message_delta", delta=delta, usage=usage(outcome)))
        return events + [_event("message_stop")]

    def _start(self, block: dict) -> list[tuple]:
        events = [_event("content_block_start", index=self.blocks, content_block=block)]
        self.blocks += 1
        if not self.pinged:
            events.append(_event("ping"))
            self.pinged = True
        return events

    def _open(self, kind: str, block: dict) -> list[tuple]:
        """Events that make the open block one of ``kind``: the last one closed, this one
        started (none when it is open already)."""
        if self.open == kind:
            return []
        events = self._close() + self._start(block)
        self.open = kind
        return events

    def _close(self) -> list[tuple]:
        kind, self.open = self.open, None
        if kind is None:
            return []
        events = []
        if kind == "thinking":  # Anthropic signs its thinking: a local model's is unsigned
            delta = {"type": "signature_delta", "signature": ""}
            events.append(_event("content_block_delta", index=self.blocks - 1, delta=delta))
        return events + [_event("content_block_stop", index=self.blocks - 1)]


def _thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


def _event(kind: str, **fields) -> tuple:
    return kind, {"type": kind, **fields}


def _tool_use(call: h.ToolCall) -> dict:
    args = call.arguments if isinstance(call.arguments, dict) else {"arguments": call.arguments}
    return {
        "type": "tool_use",
        "id": f"toolu_{call.id.removeprefix('call_')}",
        "name": call.name,
        "input": args,
    }
