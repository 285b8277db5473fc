"""The OpenAI API's request and response objects for `redrafter-mlx serve`: pure functions, no
HTTP and no model.

A request body (JSON already decoded) becomes a :class:`Call`: the service's
:class:`~redrafter_mlx.core.service.Request` plus what the response needs. What cannot be
served is an :class:`ApiError` carrying the status, ``type``, ``param`` and ``code`` that
OpenAI's API uses, so that clients show the message instead of failing on the format.
"""

from __future__ import annotations

import json
import math
import sys
import time
import uuid
from dataclasses import dataclass, field

from redrafter_mlx.core.errors import ConfigError
from redrafter_mlx.core.generate import GenerationStats
from redrafter_mlx.core.service import Request, Sampling, Started
from redrafter_mlx.io.templates import check_text

ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 4  # as OpenAI's API
# Longest stop string: each step looks at the text's last len(stop) - 1 characters for a
# beginning of each stop (OpenAI sets no limit; an answer rarely needs more than a line).
MAX_STOP_CHARS = 1000
# Python refuses to parse longer integers (CVE-2020-10735); a JSON number this long is kept
# as a HugeInteger, which every field's check refuses by name.
MAX_INT_DIGITS = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
MAX_TEMPERATURE = 2.0  # as OpenAI's API
# Fields that are served only at their "off" value: anything else is refused, not ignored.
OFF_ONLY = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "top_logprobs": (0,),
}
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}


@dataclass
class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class Limits:
    """What requests are checked against, and the defaults they fall back on.

    ``model_ids``: the names a request's ``model`` may give (the first is the one listed);
    ``max_context``/``vocab_size``: the model's (None when unknown)."""

    model_ids: tuple[str, ...]
    max_context: int | None = None
    vocab_size: int | None = None
    max_tokens: int = 512
    sampling: Sampling = Sampling()

    @property
    def model_id(self) -> str:
        return self.model_ids[0]

    @property
    def most_tokens(self) -> int:
        """The largest ``max_tokens`` that is not absurd: the whole context."""
        return self.max_context or 1 << 20


@dataclass(frozen=True)
class Call:
    """A checked request: ``kind`` "chat" or "text" (completions), the service request, and
    how to answer (streamed or not, a usage chunk at the end of a stream or not)."""

    kind: str
    request: Request
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


# ---------------------------------------------------------------- parsing requests


@dataclass(frozen=True)
class HugeInteger:
    """A JSON integer too long for Python to parse: refused by the field that holds it."""

    digits: int

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def _json_int(text: str) -> int | HugeInteger:
    digits = len(text.lstrip("-"))
    if MAX_INT_DIGITS and digits > MAX_INT_DIGITS:
        return HugeInteger(digits)
    return int(text)


def parse_json(raw: bytes) -> dict:
    """A request body -> its JSON object; ApiError 400 unless it is one."""
    try:
        body = json.loads(raw, parse_int=_json_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(
            400, f"the request body is not valid JSON: {e}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def parse_chat(body: dict, limits: Limits) -> Call:
    """A ``POST /v1/chat/completions`` body -> Call."""
    if "messages" not in body:
        raise _missing("messages")
    messages = _messages(body["messages"])
    if body.get("logprobs") not in (None, False):
        raise _unsupported("logprobs", "log-probabilities are not returned")
    return _call("chat", messages, body, limits)


def parse_completion(body: dict, limits: Limits) -> Call:
    """A ``POST /v1/completions`` body -> Call."""
    if "prompt" not in body:
        raise _missing("prompt")
    prompt = _prompt(body["prompt"], limits.vocab_size)
    if body.get("logprobs") not in (None, 0):
        raise _unsupported("logprobs", "log-probabilities are not returned")
    return _call("text", prompt, body, limits)


def _call(kind: str, prompt, body: dict, limits: Limits) -> Call:
    """The fields chat and text completions share."""
    _check_model(body.get("model"), limits)
    _check_off_only(body)
    if body.get("n") not in (None, 1):
        raise _unsupported("n", "one choice per request (n = 1): send n requests instead")
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _invalid("stream_options", "must be an object")
    include_usage = stream and _boolean(options or {}, "include_usage", False, "stream_options.")
    request = Request(
        prompt,
        max_tokens=_max_tokens(body, limits),
        sampling=_sampling(body, limits),
        stop_strings=_stop(body.get("stop")),
    )
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return Call(kind, request, stream, include_usage, id=f"{prefix}-{uuid.uuid4().hex}")


def _messages(value) -> list[dict]:
    if not isinstance(value, list):
        raise _invalid("messages", "must be an array of messages")
    if not value:
        raise ApiError(400, "messages is empty: send at least one", "messages", "empty_array")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(message, where: str) -> dict:
    if not isinstance(message, dict):
        raise _invalid(where, "must be an object with a role and content")
    role = message.get("role")
    if role not in ROLES:
        raise _invalid(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
    return {"role": role, "content": _content(message.get("content"), f"{where}.content")}


def _content(content, where: str) -> str:
    """A message's text: a string, or an array of text parts (joined)."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise _invalid(where, "only text parts ({'type': 'text', 'text': ...}) are served")
        content = "".join(_text(p.get("text"), where) for p in content)
    return _text(content, where)


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise _invalid(where, "must be a string")
    try:
        return check_text(value, where)
    except ConfigError as e:
        raise _invalid(where, str(e).removeprefix(f"{where}: ")) from None


def _prompt(value, vocab_size: int | None) -> str | list[int]:
    """A completion prompt: a string, an array of one string, or an array of token ids."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "prompt is empty", "prompt", "invalid_value")
        return _text(value, "prompt")
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        top = vocab_size if vocab_size is not None else math.inf
        if not all(0 <= t < top for t in value):
            raise _invalid("prompt", f"token ids must be in [0, {vocab_size})")
        return list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str) for p in value):
        raise _unsupported("prompt", "one prompt per request: send one request per prompt")
    raise _invalid("prompt", "must be a non-empty string or an array of token ids")


def _check_model(model, limits: Limits) -> None:
    if model is None:  # lenient: the one model served
        return
    if not isinstance(model, str):
        raise _invalid("model", "must be a string")
    if model not in limits.model_ids:
        raise model_not_found(model, limits, "model")


def model_not_found(model: str, limits: Limits, param: str | None = None) -> ApiError:
    message = f"the model {model!r} does not exist here: this server serves {limits.model_id!r}"
    return ApiError(404, message, param, "model_not_found")


def _check_off_only(body: dict) -> None:
    for name, off in OFF_ONLY.items():
        value = body.get(name)
        if value is not None and not any(value == o and type(value) is type(o) for o in off):
            raise _unsupported(name, f"only {off[0]!r} is served")


def _max_tokens(body: dict, limits: Limits) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    name = name or "max_tokens"
    value = body.get(name)
    if value is None:
        return min(limits.max_tokens, limits.most_tokens)
    if not _is_int(value) or value < 1:
        raise _invalid(name, f"must be an integer of at least 1, got {_shown(value)}")
    if value > limits.most_tokens:
        raise _invalid(
            name, f"{_shown(value)} exceeds the model's {limits.most_tokens}-token context"
        )
    return value


def _sampling(body: dict, limits: Limits) -> Sampling:
    base = limits.sampling
    temp = _number(body, "temperature", base.temp, 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", base.top_p, 0.0, 1.0)
    top_k = body.get("top_k", base.top_k)
    top = (limits.vocab_size - 1) if limits.vocab_size else math.inf
    if not _is_int(top_k) or not 0 <= top_k <= top:
        raise _invalid("top_k", f"must be an integer from 0 (off) to {top}, got {_shown(top_k)}")
    seed = body.get("seed", base.seed)
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 1 << 64):
        raise _invalid("seed", f"must be an integer from 0 to 2**64 - 1, got {_shown(seed)}")
    return Sampling(temp, top_p, top_k, seed)


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _invalid("stop", "must be a non-empty string or an array of them")
    if len(stops) > MAX_STOP_STRINGS:
        raise _invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    longest = max(len(s) for s in stops)
    if longest > MAX_STOP_CHARS:
        raise _invalid("stop", f"at most {MAX_STOP_CHARS} characters each, got {longest}")
    return tuple(_text(s, "stop") for s in stops)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(name, f"must be a number, got {_shown(value)}")
    # compared as given: an integer past the float range (10**400) must not be converted
    if not (low <= value <= high and math.isfinite(value)):
        raise _invalid(name, f"must be from {low:g} to {high:g}, got {_shown(value)}")
    return float(value)


def _shown(value, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters: a refused value may be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _boolean(body: dict, name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(prefix + name, f"must be true or false, got {_shown(value)}")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param, "invalid_value")


def _missing(param: str) -> ApiError:
    return ApiError(
        400, f"missing required parameter: {param}", param, "missing_required_parameter"
    )


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: not supported here; {message}", param, "unsupported_value")


# ---------------------------------------------------------------- building responses


def finish_reason(reason: str | None) -> str | None:
    """Our finish reasons in OpenAI's words: a full context is "length" too."""
    return FINISH_REASONS.get(reason, reason)


def usage(started: Started, stats: GenerationStats, shape_source: str | None) -> dict:
    """OpenAI's ``usage`` object plus ``prompt_tokens_details.cached_tokens`` (the prompt's
    tokens the KV cache already held) and our ``redrafter`` block."""
    return {
        "prompt_tokens": started.prompt_tokens,
        "completion_tokens": stats.generation_tokens,
        "total_tokens": started.prompt_tokens + stats.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": started.cached_tokens},
        "redrafter": redrafter_usage(started, stats, shape_source),
    }


def redrafter_usage(started: Started, stats: GenerationStats, shape_source: str | None) -> dict:
    """How the decoding went: the beam shape, decode steps (target passes after the prompt's),
    tokens per step, drafted tokens the target verified (tree nodes but the root) and how many
    of them it accepted, and the times: the prompt's (to the first token) and the decoding's
    after it, as `generate --json` reports them."""
    shape = started.shape
    histogram = stats.accept_histogram
    return {
        "mode": started.mode.value,
        "beam_width": None if shape is None else shape.width,
        "beam_length": None if shape is None else shape.length,
        "min_prob": None if shape is None else shape.min_prob,
        "search_width": None if shape is None else shape.searched,
        "lookup": None if shape is None else shape.lookup,
        "shape_source": None if shape is None else shape_source,
        "steps": stats.steps,
        "tokens_per_step": round(stats.tokens_per_step, 4),
        "drafted_tokens": sum(size - 1 for size in stats.tree_sizes),
        "accepted_tokens": sum((emitted - 1) * n for emitted, n in histogram.items()),
        "accept_histogram": {str(k): n for k, n in sorted(histogram.items())},
        "accepted_from": stats.accepted_shares(),
        "prompt_seconds": round(stats.prompt_seconds, 4),
        "generation_seconds": round(stats.generation_seconds, 4),
        "prompt_tps": round(stats.prompt_tps, 3),
        "generation_tps": round(stats.generation_tps, 3),
    }


def response(call: Call, model: str, text: str, reason: str | None, usage_: dict) -> dict:
    """The whole answer of a non-streamed request."""
    if call.kind == "chat":
        choice = {"message": {"role": "assistant", "content": text}}
        kind = "chat.completion"
    else:
        choice, kind = {"text": text}, "text_completion"
    choice = {"index": 0, **choice, "logprobs": None, "finish_reason": finish_reason(reason)}
    return _envelope(call, model, kind, [choice]) | {"usage": usage_}


def chunk(call: Call, model: str, text: str | None, reason: str | None, *, first=False) -> dict:
    """One streamed chunk: new ``text`` (chat: the assistant's role on the first), or the last
    one with the finish reason (text None)."""
    if call.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else {}
        if text is not None:
            delta["content"] = text
        choice, kind = {"delta": delta}, "chat.completion.chunk"
    else:
        choice, kind = {"text": text or ""}, "text_completion"
    choice = {"index": 0, **choice, "logprobs": None, "finish_reason": finish_reason(reason)}
    body = _envelope(call, model, kind, [choice])
    return (body | {"usage": None}) if call.include_usage else body


def usage_chunk(call: Call, model: str, usage_: dict) -> dict:
    """The chunk after the last one when ``stream_options.include_usage``: no choices."""
    kind = "chat.completion.chunk" if call.kind == "chat" else "text_completion"
    return _envelope(call, model, kind, []) | {"usage": usage_}


def _envelope(call: Call, model: str, kind: str, choices: list) -> dict:
    return {
        "id": call.id,
        "object": kind,
        "created": call.created,
        "model": model,
        "choices": choices,
    }


def models(limits: Limits, created: int) -> dict:
    """``GET /v1/models``: the one model served."""
    entry = {"id": limits.model_id, "object": "model", "created": created, "owned_by": "local"}
    return {"object": "list", "data": [entry]}
