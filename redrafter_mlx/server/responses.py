"""OpenAI's Responses API for `redrafter-mlx serve`: ``POST /v1/responses``, whole or
streamed as the official ``openai`` SDK and Codex CLI parse it. Pure functions, no HTTP and no
model: a request becomes the same :class:`~redrafter_mlx.server.protocol.Call` the other APIs
make, the answer is built from the same :class:`~redrafter_mlx.server.protocol.Answer`.

What maps how:
- ``instructions`` and ``developer`` / ``system`` messages -> one system message, in order
  (chat templates take one, first); ``user`` / ``assistant`` messages -> theirs;
  ``function_call`` items -> the assistant's ``tool_calls``; ``function_call_output`` -> a
  ``tool`` message; ``reasoning`` items are left out (as chat templates leave past thinking).
- ``function`` tools as they are; ``custom`` (free-form) tools as a function of one string
  argument ``input``, whose calls come back as ``custom_tool_call`` items. Hosted tools this
  server cannot run (``web_search``, ``namespace``, ``file_search``...) and input items of
  theirs are left out of the prompt, and named in the call for the server's log.
- ``reasoning.effort`` -> the template's thinking switch ("none": off); the model's thinking
  comes back as a ``reasoning`` item with its text as the summary.
- Nothing is stored: ``store: true``, ``previous_response_id``, ``background`` and
  ``conversation`` are refused; ``include``, ``prompt_cache_key``, ``metadata``,
  ``parallel_tool_calls``, ``truncation``, ``service_tier``, ``user`` are accepted and
  not acted on.
"""

from __future__ import annotations

import json
import uuid

from redrafter_mlx.core.serving.service import Request, Started
from redrafter_mlx.server import protocol as h
from redrafter_mlx.server.protocol import ApiError, Call, Limits

MAX_TEMPERATURE = 2.0  # as OpenAI's API
HOSTED_TOOLS_NOTE = "hosted tools this server cannot run, left out of the prompt"
# what a custom (free-form) tool's text becomes: one string argument
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}
# fields that need state this server does not keep: refused, with what to do instead
STATEFUL = {
    "previous_response_id": "send the whole conversation in input",
    "conversation": "send the whole conversation in input",
    "background": "responses are answered while the request waits",
    "prompt": "send the prompt's text in input",
}


# ---------------------------------------------------------------- parsing requests


def parse_responses(body: dict, limits: Limits) -> Call:
    """A ``POST /v1/responses`` body -> Call; its ``options`` carry what the response
    echoes and the custom tools' names."""
    h.check_model(body.get("model"), limits)
    _refuse_stateful(body)
    if "input" not in body:
        raise h.missing("input")
    left_out: list[str] = []
    tools, custom = _tools(body.get("tools"), left_out)
    messages = _input(body["input"], h.text(body.get("instructions") or "", "instructions"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise h.invalid("reasoning", "must be an object")
    thinking = h.effort((reasoning or {}).get("effort"), "reasoning.effort")
    prompt, offered, forced = h.chat_prompt(messages.chat, tools, choice, limits, thinking)
    _text_format(body.get("text"))
    request = Request(
        prompt,
        max_tokens=h.max_tokens(body, limits, "max_output_tokens"),
        sampling=h.sampling(body, limits, max_temperature=MAX_TEMPERATURE),
    )
    options = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": h.boolean(body, "parallel_tool_calls", True),
        "reasoning": reasoning or {"effort": None, "summary": None},
        "custom": custom,
        "left_out": tuple(dict.fromkeys(left_out + messages.left_out)),
    }
    call_id = f"resp_{uuid.uuid4().hex}"
    stream = h.boolean(body, "stream", False)
    return Call(
        "responses", request, stream, id=call_id, tools=offered, forced_call=forced, options=options
    )


def _refuse_stateful(body: dict) -> None:
    if h.boolean(body, "store", False):
        raise h.unsupported("store", "responses are not stored here: send store: false")
    for name, instead in STATEFUL.items():
        if body.get(name) not in (None, False):
            raise h.unsupported(name, f"nothing is stored here; {instead}")
    if body.get("top_logprobs") not in (None, 0):
        raise h.unsupported("top_logprobs", "log-probs are served by /v1/chat/completions")


def _text_format(value) -> None:
    """``text.format``: plain text only (JSON needs constrained decoding)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise h.invalid("text", "must be an object")
    kind = (value.get("format") or {}).get("type", "text")
    if kind != "text":
        raise h.unsupported("text.format", f"{h.shown(kind)} needs constrained decoding")


class _Messages:
    """Input items as chat templates read them: the system prompt (instructions, then the
    developer and system messages' text) first, the turns after."""

    def __init__(self, instructions: str):
        self.system = [instructions] if instructions else []
        self.turns: list[dict] = []
        self.left_out: list[str] = []
        self.call_ids: set[str] = set()  # of the calls so far: each output answers one

    @property
    def chat(self) -> list[dict]:
        system = "\n\n".join(t for t in self.system if t)
        if not self.turns:
            raise h.invalid("input", "has no user or assistant message: send at least one")
        return ([{"role": "system", "content": system}] if system else []) + self.turns

    def call(self, call: dict) -> None:
        """An assistant's call: added to its last turn when that is the assistant's."""
        last = self.turns[-1] if self.turns else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.turns.append(last)
        last.setdefault("tool_calls", []).append(call)
        self.call_ids.add(call["id"])


def _input(value, instructions: str) -> _Messages:
    messages = _Messages(instructions)
    if isinstance(value, str):
        messages.turns.append({"role": "user", "content": h.text(value, "input")})
        return messages
    if not isinstance(value, list):
        raise h.invalid("input", "must be a string or an array of input items")
    for i, item in enumerate(value):
        _item(item, f"input[{i}]", messages)
    return messages


def _item(item, where: str, messages: _Messages) -> None:
    if not isinstance(item, dict):
        raise h.invalid(where, "must be an input item object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        text = _content(item.get("content"), f"{where}.content")
        if role in ("developer", "system"):
            messages.system.append(text)
        elif role in ("user", "assistant"):
            messages.turns.append({"role": role, "content": text})
        else:
            raise h.invalid(f"{where}.role", "must be 'user', 'assistant', 'developer' or 'system'")
    elif kind in ("function_call", "custom_tool_call"):
        name = h.text(item.get("name"), f"{where}.name")
        if kind == "function_call":
            args = h.call_arguments(item.get("arguments", "{}"), f"{where}.arguments")
        else:
            args = {"input": h.text(item.get("input", ""), f"{where}.input")}
        call_id = h.text(item.get("call_id") or item.get("id") or "call", f"{where}.call_id")
        function = {"name": name, "arguments": args}
        messages.call({"id": call_id, "type": "function", "function": function})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output", "")
        text = output if isinstance(output, str) else _content(output, f"{where}.output")
        call_id = h.text(item.get("call_id"), f"{where}.call_id")
        if call_id not in messages.call_ids:
            message = f"no call before it has call_id {h.shown(call_id)}"
            raise h.invalid(f"{where}.call_id", message)
        messages.turns.append({"role": "tool", "tool_call_id": call_id, "content": text})
    elif kind == "reasoning":
        return  # past thinking: chat templates leave it out of the prompt too
    elif isinstance(kind, str) and (kind.endswith("_call") or kind == "item_reference"):
        messages.left_out.append(kind)  # a hosted tool's call (web_search_call...)
    else:
        raise h.invalid(f"{where}.type", f"{h.shown(kind)} is not an input item type")


def _content(value, where: str) -> str:
    """A message's text: a string, or its text parts joined (input_text, output_text)."""
    if isinstance(value, str):
        return h.text(value, where)
    if not isinstance(value, list) or not all(isinstance(p, dict) for p in value):
        raise h.invalid(where, "must be a string or an array of content parts")
    texts = []
    for i, part in enumerate(value):
        if part.get("type") not in ("input_text", "output_text", "text", "summary_text"):
            raise h.unsupported(where, f"{h.shown(part.get('type'))} parts (text parts are)")
        texts.append(h.text(part.get("text"), f"{where}[{i}].text"))
    return "".join(texts)


def _tools(value, left_out: list[str]) -> tuple[list[dict], frozenset]:
    """``tools`` -> (OpenAI's function format, the custom tools' names); hosted ones are
    named in ``left_out``."""
    if value is None:
        return [], frozenset()
    if not isinstance(value, list):
        raise h.invalid("tools", "must be an array of tools")
    tools, custom = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise h.invalid(where, "must be a tool object")
        kind = tool.get("type")
        if kind == "function":
            fields = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            tools.append(h.function_tool(fields, where))
        elif kind == "custom":
            fields = {k: tool[k] for k in ("name", "description") if k in tool}
            tools.append(h.function_tool(fields | {"parameters": CUSTOM_PARAMETERS}, where))
            custom.add(tools[-1]["function"]["name"])
        elif isinstance(kind, str):
            left_out.append(kind)
        else:
            raise h.invalid(f"{where}.type", "must be a string")
    return tools, frozenset(custom)


def _tool_choice(value, tools: list[dict]):
    """``tool_choice`` -> "auto", "none", "required" or the name of the tool to call."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") in ("function", "custom"):
        if isinstance(value.get("name"), str):
            return value["name"]
    raise h.invalid(
        "tool_choice", "must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}"
    )


# ---------------------------------------------------------------- building responses


def usage(outcome: h.Outcome) -> dict:
    """The Responses API's ``usage``, every field its SDK types declare required (nothing
    is written to a cache a client pays for: ``cache_write_tokens`` 0), plus our
    ``redrafter`` block."""
    details = {"cached_tokens": outcome.cached_tokens, "cache_write_tokens": 0}
    return {
        "input_tokens": outcome.prompt_tokens,
        "input_tokens_details": details,
        "output_tokens": outcome.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "redrafter": outcome.redrafter(),
    }


def _reasoning_item(item_id: str, text: str) -> dict:
    summary = [{"type": "summary_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": summary, "status": "completed"}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if status == "completed" else [],
    }


def _call_item(call: h.ToolCall, custom: frozenset, status: str = "completed") -> dict:
    item_id = f"fc_{call.id.removeprefix('call_')}"
    if call.name in custom:
        args = call.arguments if isinstance(call.arguments, dict) else {}
        text = args.get("input", call.arguments_json() if not args else "")
        return {
            "type": "custom_tool_call",
            "id": item_id,
            "call_id": call.id,
            "name": call.name,
            "input": text if isinstance(text, str) else json.dumps(text),
            "status": status,
        }
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments_json() if status == "completed" else "",
        "status": status,
    }


class Responses(h.Api):
    """Responses: a whole ``response`` object, or its stream of typed events."""

    name = "OpenAI"

    def __init__(self, model: str):
        self.model = model

    def stream_error(self, error: ApiError) -> tuple:
        body = {"type": "error", "code": error.code, "message": error.message}
        return "error", body | {"param": error.param, "sequence_number": 0}

    def response(self, call: Call, answer: h.Answer, outcome: h.Outcome) -> dict:
        custom = call.options["custom"]
        items = []
        if answer.reasoning:
            items.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", answer.reasoning))
        if answer.text:
            items.append(_message_item(f"msg_{uuid.uuid4().hex}", answer.text))
        items += [_call_item(c, custom) for c in answer.calls]
        return self.envelope(call, items, answer, usage(outcome))

    def envelope(self, call: Call, items: list, answer: h.Answer | None, usage_) -> dict:
        """The ``response`` object: in progress (``answer`` None) or finished."""
        options = call.options
        status, incomplete = "in_progress", None
        if answer is not None:
            status = "completed" if answer.finish_reason in ("stop", "tool_calls") else "incomplete"
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
        sampling = call.request.sampling
        return {
            "id": call.id,
            "object": "response",
            "created_at": call.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": options["instructions"],
            "max_output_tokens": options["max_output_tokens"],
            "model": self.model,
            "output": items,
            "parallel_tool_calls": options["parallel_tool_calls"],
            "previous_response_id": None,
            "reasoning": options["reasoning"],
            "store": False,
            "temperature": sampling.temp,
            "text": {"format": {"type": "text"}},
            "tool_choice": options["tool_choice"],
            "tools": options["tools"],
            "top_p": sampling.top_p,
            "truncation": "disabled",
            "usage": usage_,
            "metadata": {},
        }

    def stream(self, call: Call, started: Started) -> ResponsesStream:
        return ResponsesStream(self, call)


class ResponsesStream(h.Stream):
    """The Responses event sequence: ``response.created``, ``response.in_progress``; per
    output item ``response.output_item.added``, its part and deltas (reasoning summary text,
    output text, or a call's arguments) and ``response.output_item.done``;
    ``response.completed`` (or ``response.incomplete``) with the whole response."""

    def __init__(self, api: Responses, call: Call):
        self.api, self.call = api, call
        self.items: list[dict] = []  # output items done
        self.open: dict | None = None  # the item being streamed: its type, id and text
        self.sequence = 0

    def begin(self) -> list[tuple]:
        response = self.api.envelope(self.call, [], None, None)
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def piece(self, piece: h.Piece) -> list[tuple]:
        events = []
        if piece.reasoning:
            events += self._open("reasoning")
            events.append(
                self._delta(
                    "response.reasoning_summary_text.delta", piece.reasoning, summary_index=0
                )
            )
        if piece.text:
            events += self._open("message")
            events.append(
                self._delta("response.output_text.delta", piece.text, content_index=0, logprobs=[])
            )
        for call in piece.calls:
            events += self._close()
            item, index = _call_item(call, self.call.options["custom"]), len(self.items)
            started = _call_item(call, self.call.options["custom"], "in_progress")
            events.append(
                self._event("response.output_item.added", output_index=index, item=started)
            )
            where = {"item_id": item["id"], "output_index": index}
            if item["type"] == "function_call":
                events.append(
                    self._event(
                        "response.function_call_arguments.delta", **where, delta=item["arguments"]
                    )
                )
                events.append(
                    self._event(
                        "response.function_call_arguments.done",
                        **where,
                        arguments=item["arguments"],
                        name=item["name"],
                    )
                )
            else:
                events.append(
                    self._event(
                        "response.custom_tool_call_input.delta", **where, delta=item["input"]
                    )
                )
                events.append(
                    self._event(
                        "response.custom_tool_call_input.done", **where, input=item["input"]
                    )
                )
            events.append(self._event("response.output_item.done", output_index=index, item=item))
            self.items.append(item)
        return events

    def end(self, answer: h.Answer, outcome: h.Outcome) -> list[tuple]:
        events = self._close()
        response = self.api.envelope(self.call, self.items, answer, usage(outcome))
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return events + [self._event(kind, response=response)]

    def _open(self, kind: str) -> list[tuple]:
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self._close()
        prefix = "rs" if kind == "reasoning" else "msg"
        self.open = {"type": kind, "id": f"{prefix}_{uuid.uuid4().hex}", "text": ""}
        where = {"item_id": self.open["id"], "output_index": len(self.items)}
        if kind == "reasoning":
            item = _reasoning_item(self.open["id"], "") | {"status": "in_progress"}
            part = {"type": "summary_text", "text": ""}
            events.append(
                self._event("response.output_item.added", output_index=len(self.items), item=item)
            )
            events.append(
                self._event(
                    "response.reasoning_summary_part.added", **where, summary_index=0, part=part
                )
            )
        else:
            item = _message_item(self.open["id"], "", "in_progress")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self._event("response.output_item.added", output_index=len(self.items), item=item)
            )
            events.append(
                self._event("response.content_part.added", **where, content_index=0, part=part)
            )
        return events

    def _delta(self, kind: str, text: str, **fields) -> tuple:
        self.open["text"] += text
        where = {"item_id": self.open["id"], "output_index": len(self.items)}
        return self._event(kind, **where, delta=text, **fields)

    def _close(self) -> list[tuple]:
        if self.open is None:
            return []
        item_id, text, index = self.open["id"], self.open["text"], len(self.items)
        where = {"item_id": item_id, "output_index": index}
        if self.open["type"] == "reasoning":
            item = _reasoning_item(item_id, text)
            part = {"type": "summary_text", "text": text}
            events = [
                self._event(
                    "response.reasoning_summary_text.done", **where, summary_index=0, text=text
                ),
                self._event(
                    "response.reasoning_summary_part.done", **where, summary_index=0, part=part
                ),
            ]
        else:
            item = _message_item(item_id, text)
            events = [
                self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                ),
                self._event(
                    "response.content_part.done", **where, content_index=0, part=item["content"][0]
                ),
            ]
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        self.open = None
        return events

    def _event(self, kind: str, **fields) -> tuple:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **fields}
