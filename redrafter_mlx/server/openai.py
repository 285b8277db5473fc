"""The OpenAI API's request and response objects for `redrafter-mlx serve`: pure functions, no
HTTP and no model.

A request body (JSON already decoded) becomes a :class:`Call`: the service's
:class:`~redrafter_mlx.core.serving.service.Request` plus what the response needs. What cannot be
served is an :class:`ApiError` carrying the status, ``type``, ``param`` and ``code`` that
OpenAI's API uses, so that clients show the message instead of failing on the format.
"""

from __future__ import annotations

import uuid

from redrafter_mlx.core.serving.service import Request, Started
from redrafter_mlx.server import protocol as h
from redrafter_mlx.server.protocol import ApiError, Call, Limits, parse_json  # noqa: F401 (API)

ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's newer name for the system role: chat templates know "system" only
TEMPLATE_ROLES = {"developer": "system"}
MAX_TEMPERATURE = 2.0  # as OpenAI's API
# Fields that are served only at their "off" value: anything else is refused, not ignored.
OFF_ONLY = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "functions": ([],),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
}
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}


# ---------------------------------------------------------------- parsing requests


def parse_chat(body: dict, limits: Limits) -> Call:
    """A ``POST /v1/chat/completions`` body -> Call."""
    if "messages" not in body:
        raise h.missing("messages")
    messages = _messages(body["messages"])
    tools = h.tool_list(body.get("tools"), _tool)
    choice = _tool_choice(body, tools)
    prompt, offered, forced = h.chat_prompt(messages, tools, choice, limits, _thinking(body))
    top = None
    if h.boolean(body, "logprobs", False):
        top = h.top_logprobs(body.get("top_logprobs", 0) or 0, "top_logprobs")
    elif body.get("top_logprobs") is not None:
        raise h.invalid("top_logprobs", "needs logprobs: true")
    return _call("chat", prompt, body, limits, top, tools=offered, forced_call=forced)


def parse_completion(body: dict, limits: Limits) -> Call:
    """A ``POST /v1/completions`` body -> Call."""
    if "prompt" not in body:
        raise h.missing("prompt")
    prompt = _prompt(body["prompt"], limits.vocab_size)
    value = body.get("logprobs")
    top = None if value is None else h.top_logprobs(value, "logprobs")
    for name in ("tools", "top_logprobs"):
        if body.get(name) is not None:
            raise h.unsupported(name, "a chat completions field")
    return _call("text", prompt, body, limits, top)


def _call(kind: str, prompt, body: dict, limits: Limits, top: int | None, **tools) -> Call:
    """The fields chat and text completions share."""
    h.check_model(body.get("model"), limits)
    _check_off_only(body)
    _response_format(body.get("response_format"))
    if body.get("n") not in (None, 1):
        raise h.unsupported("n", "one choice per request (n = 1): send n requests instead")
    stream = h.boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise h.invalid("stream_options", "must be an object")
    include_usage = stream and h.boolean(options or {}, "include_usage", False, "stream_options.")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    request = Request(
        prompt,
        max_tokens=h.max_tokens(body, limits, name or "max_tokens"),
        sampling=h.sampling(body, limits, max_temperature=MAX_TEMPERATURE),
        stop_strings=h.stop_strings(body.get("stop"), "stop"),
        top_logprobs=top,
    )
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    call_id = f"{prefix}-{uuid.uuid4().hex}"
    return Call(kind, request, stream, include_usage, id=call_id, **tools)


def _messages(value) -> list[dict]:
    if not isinstance(value, list):
        raise h.invalid("messages", "must be an array of messages")
    if not value:
        raise ApiError(400, "messages is empty: send at least one", "messages", "empty_array")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(message, where: str) -> dict:
    """A message as chat templates read it: role and text, an assistant's tool calls (their
    arguments as objects), a tool result's call id."""
    if not isinstance(message, dict):
        raise h.invalid(where, "must be an object with a role and content")
    role = message.get("role")
    if role not in ROLES:
        raise h.invalid(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
    calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    if content is None and calls:
        content = ""
    out = {"role": TEMPLATE_ROLES.get(role, role), "content": _content(content, f"{where}.content")}
    if calls is not None:
        out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    if role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = h.text(message["tool_call_id"], f"{where}.tool_call_id")
    if message.get("name") is not None:  # a participant's name: checked, not templated
        h.text(message["name"], f"{where}.name")
    return out


def _tool_calls(value, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise h.invalid(where, "must be an array of tool calls")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise h.invalid(f"{where}[{i}]", "must be {'type': 'function', 'function': {...}}")
        name = h.text(function.get("name"), f"{where}[{i}].function.name")
        args = h.call_arguments(function.get("arguments", {}), f"{where}[{i}].function.arguments")
        call_id = str(call.get("id") or f"call_{i}")
        calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        )
    return calls


def _tool(tool, where: str) -> dict:
    """One of ``tools``: a function, as OpenAI's API takes it."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type", "function") != "function":
        message = f"{where}: must be {{'type': 'function', 'function': {{'name': ...}}}}"
        raise ApiError(400, message, "tools", "invalid_value")
    return h.function_tool(function, f"{where}.function")


def _thinking(body: dict) -> bool | None:
    """The template's reasoning switch: ``chat_template_kwargs.enable_thinking`` (vLLM's and
    mlx-lm's field), else ``reasoning_effort`` ("none": off, any other effort: on); None: the
    template's default."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise h.invalid("chat_template_kwargs", "must be an object")
    if (kwargs or {}).get("enable_thinking") is not None:
        return h.boolean(kwargs, "enable_thinking", False, "chat_template_kwargs.")
    return h.effort(body.get("reasoning_effort"), "reasoning_effort")


def _tool_choice(body: dict, tools: list[dict]):
    """``tool_choice`` -> "auto", "none", "required" or the name of the tool to call."""
    value = body.get("tool_choice")
    if value is None:
        return "auto" if tools else "none"
    if value in ("auto", "none", "required"):
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return function["name"]
    raise h.invalid(
        "tool_choice",
        "must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
    )


def _content(content, where: str) -> str:
    """A message's text: a string, or an array of text parts (joined)."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise h.invalid(where, "only text parts ({'type': 'text', 'text': ...}) are served")
        content = "".join(h.text(p.get("text"), where) for p in content)
    return h.text(content, where)


def _prompt(value, vocab_size: int | None) -> str | list[int]:
    """A completion prompt: a string, an array of one string, or an array of token ids."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "prompt is empty", "prompt", "invalid_value")
        return h.text(value, "prompt")
    if isinstance(value, list) and value and all(h.is_int(t) for t in value):
        top = vocab_size if vocab_size is not None else float("inf")
        if not all(0 <= t < top for t in value):
            raise h.invalid("prompt", f"token ids must be in [0, {vocab_size})")
        return list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str) for p in value):
        raise h.unsupported("prompt", "one prompt per request: send one request per prompt")
    raise h.invalid("prompt", "must be a non-empty string or an array of token ids")


def model_not_found(model: str, limits: Limits, param: str | None = None) -> ApiError:
    return h.model_not_found(model, limits, param)


def _response_format(value) -> None:
    """``response_format``: plain text only. JSON modes need decoding constrained to a
    grammar, which this server does not do: refused, not ignored, so that a client relying
    on valid JSON learns it here rather than from a parse error later."""
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind in ("json_object", "json_schema"):
        raise h.unsupported(
            "response_format", f"{kind!r} needs constrained decoding; only 'text' is served"
        )
    raise h.invalid("response_format", "must be {'type': 'text' | 'json_object' | 'json_schema'}")


def _check_off_only(body: dict) -> None:
    for name, off in OFF_ONLY.items():
        value = body.get(name)
        if value is not None and not any(value == o and type(value) is type(o) for o in off):
            raise h.unsupported(name, f"only {off[0]!r} is served")


# ---------------------------------------------------------------- building responses


def finish_reason(reason: str | None) -> str | None:
    """Our finish reasons in OpenAI's words: a full context is "length" too."""
    return FINISH_REASONS.get(reason, reason)


def usage(outcome: h.Outcome) -> dict:
    """OpenAI's ``usage`` object plus ``prompt_tokens_details.cached_tokens`` (the prompt's
    tokens the KV cache already held) and our ``redrafter`` block."""
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
        "redrafter": outcome.redrafter(),
    }


class OpenAI(h.Api):
    """Chat and text completions: whole answers and server-sent ``data:`` chunks."""

    def __init__(self, model: str, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def response(self, call: Call, answer: h.Answer, outcome: h.Outcome) -> dict:
        """The whole answer of a non-streamed request."""
        logprobs = self._logprobs(call, answer.counted, answer.logprobs) if call.logprobs else None
        if call.kind == "chat":
            text = answer.text or (None if answer.calls else "")
            message = {"role": "assistant", "content": text}
            if answer.reasoning:
                message["reasoning_content"] = answer.reasoning
            if answer.calls:
                message["tool_calls"] = [_tool_call(c) for c in answer.calls]
            choice, kind = {"message": message}, "chat.completion"
        else:
            choice, kind = {"text": answer.text}, "text_completion"
        reason = finish_reason(answer.finish_reason)
        choice = {"index": 0, **choice, "logprobs": logprobs, "finish_reason": reason}
        return self.envelope(call, kind, [choice]) | {"usage": usage(outcome)}

    def stream(self, call: Call, started: Started) -> OpenAIStream:
        return OpenAIStream(self, call)

    def envelope(self, call: Call, kind: str, choices: list) -> dict:
        return {
            "id": call.id,
            "object": kind,
            "created": call.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, call: Call, tokens: list[int], parts: list) -> dict:
        """A choice's ``logprobs``: chat's ``content`` entries, or completions' four lists."""
        entries = h.token_entries(self.tokenizer, tokens, parts)
        if call.kind == "chat":
            return {"content": [_chat_entry(*e) for e in entries], "refusal": None}
        offsets, at = [], 0
        for token, _, _ in entries:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": [token for token, _, _ in entries],
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries],
            "text_offset": offsets,
        }


class OpenAIStream(h.Stream):
    """Chunks: the assistant's role first (chat), one per step with new text or log-probs,
    a tool call in two (its name, then its arguments, as OpenAI streams them), the finish
    reason, the usage (when asked), ``[DONE]``."""

    def __init__(self, api: OpenAI, call: Call):
        self.api, self.call = api, call
        self.kind = "chat.completion.chunk" if call.kind == "chat" else "text_completion"
        self.calls = 0  # tool calls streamed (their indices)

    def begin(self) -> list[tuple]:
        if self.call.kind != "chat":
            return []
        return [self._chunk({"delta": {"role": "assistant", "content": ""}})]

    def piece(self, piece: h.Piece) -> list[tuple]:
        logprobs = None
        if self.call.logprobs and piece.counted:
            logprobs = self.api._logprobs(self.call, piece.counted, [piece.logprobs])
        events = []
        if piece.reasoning:
            events.append(self._chunk({"delta": {"reasoning_content": piece.reasoning}}))
        if piece.text or logprobs is not None:
            text = {"delta": {"content": piece.text}} if self.call.kind == "chat" else None
            events.append(self._chunk(text or {"text": piece.text}, logprobs))
        for call in piece.calls:
            index, self.calls = self.calls, self.calls + 1
            head = _tool_call(call) | {"index": index}
            head["function"] = {"name": call.name, "arguments": ""}
            tail = {"index": index, "function": {"arguments": call.arguments_json()}}
            events += [self._chunk({"delta": {"tool_calls": [t]}}) for t in (head, tail)]
        return events

    def end(self, answer: h.Answer, outcome: h.Outcome) -> list[tuple]:
        empty = {"delta": {}} if self.call.kind == "chat" else {"text": ""}
        events = [self._chunk(empty, reason=finish_reason(answer.finish_reason))]
        if self.call.include_usage:
            events.append(
                (None, self.api.envelope(self.call, self.kind, []) | {"usage": usage(outcome)})
            )
        return events + [(None, "[DONE]")]

    def _chunk(self, choice: dict, logprobs=None, reason=None) -> tuple:
        choice = {"index": 0, **choice, "logprobs": logprobs, "finish_reason": reason}
        body = self.api.envelope(self.call, self.kind, [choice])
        return None, (body | {"usage": None}) if self.call.include_usage else body


def _tool_call(call: h.ToolCall) -> dict:
    function = {"name": call.name, "arguments": call.arguments_json()}
    return {"id": call.id, "type": "function", "function": function}


def _chat_entry(token: str, logprob: float, top: list) -> dict:
    """One token of a chat choice's ``logprobs.content``."""

    def entry(text: str, value: float) -> dict:
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return entry(token, logprob) | {"top_logprobs": [entry(t, v) for t, v in top]}


def models(limits: Limits, created: int) -> dict:
    """``GET /v1/models``: the one model served."""
    entry = {"id": limits.model_id, "object": "model", "created": created, "owned_by": "local"}
    return {"object": "list", "data": [entry]}
