"""What the OpenAI and the Anthropic API of `redrafter-mlx serve` share: pure functions and
small types, no HTTP and no model.

- :class:`ApiError`: a refused request (status, ``type``, ``param``, ``code``); each API
  writes it in its own error shape.
- :class:`Limits` and the field checks: a request body's fields -> the service's
  :class:`~redrafter_mlx.core.serving.service.Request`.
- Tools: the tools offered and the tool choice -> a
:class:`~redrafter_mlx.core.serving.service.Chat`
  prompt (a forced call starts the answer with the call's opening tag).
- :class:`Answer`: the service's steps -> the answer's text, its tool calls (split out with
  mlx-lm's tool parser of the model's family) and its tokens' log-probs, as they stream.
- :class:`Outcome`: what a finished answer's usage is made of, and the ``redrafter`` block.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from redrafter_mlx.core.decode.step import TopLogprobs
from redrafter_mlx.core.decode.stream import GenerationStats, StepResponse
from redrafter_mlx.core.errors import ConfigError
from redrafter_mlx.core.serving.service import Chat, Request, Sampling, Started
from redrafter_mlx.io.templates import ToolFormat, check_text

MAX_STOP_STRINGS = 4  # as OpenAI's API
# Longest stop string: each step looks at the text's last len(stop) - 1 characters for a
# beginning of each stop (OpenAI sets no limit; an answer rarely needs more than a line).
MAX_STOP_CHARS = 1000
MAX_TOP_LOGPROBS = 10  # alternatives per token: a partition over the vocabulary each
# Python refuses to parse longer integers (CVE-2020-10735); a JSON number this long is kept
# as a HugeInteger, which every field's check refuses by name.
MAX_INT_DIGITS = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
# Deepest nesting of a request body: far past any real JSON schema, far below Python's
# recursion limit, which a chat template (or json.dumps) walking the body would reach.
MAX_JSON_DEPTH = 128
# JSON may escape half a surrogate pair (``"\ud800"``), which is no text: tokenizers refuse it
SURROGATE = re.compile("[\ud800-\udfff]")
# reasoning efforts as OpenAI's APIs take them ("none": thinking off)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass
class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error fields (Anthropic's
    error shape is made from the same: see ``anthropic_api.error_body``)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        """OpenAI's error object."""
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

    ``model_ids``: the model's names (the first, its short name, is the one listed; the
    others, its path or Hub id, are found by ``GET /v1/models/{name}`` too);
    ``max_context``/``vocab_size``: the model's (None when unknown); ``tools``: how the model
    takes tools (None: its chat template takes none)."""

    model_ids: tuple[str, ...]
    max_context: int | None = None
    vocab_size: int | None = None
    max_tokens: int = 512
    sampling: Sampling = Sampling()
    tools: ToolFormat | None = None
    reasoning: tuple[str, str] | None = None  # the tags the model thinks between

    @property
    def model_id(self) -> str:
        return self.model_ids[0]

    @property
    def most_tokens(self) -> int:
        """The largest ``max_tokens`` that is not absurd: the whole context."""
        return self.max_context or 1 << 20


@dataclass(frozen=True)
class Call:
    """A checked request: ``kind`` "chat", "text" (OpenAI's completions) or "messages"
    (Anthropic's), the service request, how to answer (streamed, a usage chunk at the end of
    an OpenAI stream), the tools offered (their calls are parsed out of the answer) and
    whether the answer starts inside a forced tool call."""

    kind: str
    request: Request
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    tools: list[dict] | None = None
    forced_call: bool = False
    options: dict = field(default_factory=dict)  # what one API's response needs besides

    @property
    def logprobs(self) -> bool:
        return self.request.top_logprobs is not None


# ---------------------------------------------------------------- field checks


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
    except RecursionError:  # the parser recurses once per level
        body = None
    if body is None or json_depth(body) > MAX_JSON_DEPTH:
        message = f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
        raise ApiError(400, message, code="invalid_json")
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    check_surrogates(body)
    return body


def check_surrogates(body: dict) -> None:
    """ApiError 400 naming a field (``messages[0].content``; an object, for one of its keys)
    whose text holds a lone surrogate: the tokenizer would refuse it later, in words of its
    own."""
    todo: list[tuple[str, object]] = [("", body)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, str):
            if found := SURROGATE.search(value):
                message = (
                    f"a lone surrogate (U+{ord(found[0]):04X}) at character {found.start()} is "
                    "not text: send UTF-8 text, surrogate pairs whole"
                )
                raise invalid(where or "body", message)
        elif isinstance(value, dict):
            for key, child in value.items():
                todo += [(where, key), (f"{where}.{key}" if where else key, child)]
        elif isinstance(value, list):
            todo += [(f"{where}[{i}]", child) for i, child in enumerate(value)]


def json_depth(value) -> int:
    """Levels of arrays and objects in a decoded JSON value (walked without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, dict):
            value = value.values()
        elif not isinstance(value, list):
            continue
        deepest = max(deepest, depth)
        todo += [(child, depth + 1) for child in value]
    return deepest


def text(value, where: str) -> str:
    """A string field that must be UTF-8 text."""
    if not isinstance(value, str):
        raise invalid(where, "must be a string")
    try:
        return check_text(value, where)
    except ConfigError as e:
        raise invalid(where, str(e).removeprefix(f"{where}: ")) from None


def check_model(model, limits: Limits) -> None:
    """A request's ``model``: any name, or none, is answered by the one model served (as
    mlx-lm's server and vllm-mlx do), on both APIs: agents ask for their own default names
    ("claude-sonnet-4-5", "gpt-5-codex"). The answer's ``model`` is the served name."""
    if model is not None and not isinstance(model, str):
        raise invalid("model", "must be a string")


def model_not_found(model: str, limits: Limits, param: str | None = None) -> ApiError:
    message = f"the model {model!r} does not exist here: this server serves {limits.model_id!r}"
    return ApiError(404, message, param, "model_not_found")


def max_tokens(body: dict, limits: Limits, name: str, *, required: bool = False) -> int:
    """The answer's token budget from the field ``name`` (the server's default if absent)."""
    value = body.get(name)
    if value is None:
        if required:
            raise missing(name)
        return min(limits.max_tokens, limits.most_tokens)
    if not is_int(value) or value < 1:
        raise invalid(name, f"must be an integer of at least 1, got {shown(value)}")
    if value > limits.most_tokens:
        raise invalid(
            name, f"{shown(value)} exceeds the model's {limits.most_tokens}-token context"
        )
    return value


def sampling(body: dict, limits: Limits, *, max_temperature: float) -> Sampling:
    base = limits.sampling
    temp = number(body, "temperature", base.temp, 0.0, max_temperature)
    top_p = number(body, "top_p", base.top_p, 0.0, 1.0)
    top_k = body.get("top_k", base.top_k)
    top = (limits.vocab_size - 1) if limits.vocab_size else math.inf
    if not is_int(top_k) or not 0 <= top_k <= top:
        raise invalid("top_k", f"must be an integer from 0 (off) to {top}, got {shown(top_k)}")
    seed = body.get("seed", base.seed)
    if seed is not None and (not is_int(seed) or not 0 <= seed < 1 << 64):
        raise invalid("seed", f"must be an integer from 0 to 2**64 - 1, got {shown(seed)}")
    return Sampling(temp, top_p, top_k, seed)


def effort(value, name: str) -> bool | None:
    """A reasoning effort -> the template's thinking switch ("none": off; None: default)."""
    if value is None:
        return None
    if value not in EFFORTS:
        raise invalid(name, f"must be one of {', '.join(EFFORTS)}, got {shown(value)}")
    return value != "none"


def stop_strings(value, name: str) -> tuple[str, ...]:
    """Stop strings: a string or an array of at most MAX_STOP_STRINGS (None: none)."""
    if value is None or value == []:  # an empty array: no stop strings, as OpenAI reads it
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid(name, "must be a non-empty string or an array of them")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(name, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    longest = max(len(s) for s in stops)
    if longest > MAX_STOP_CHARS:
        raise invalid(name, f"at most {MAX_STOP_CHARS} characters each, got {longest}")
    return tuple(text(s, name) for s in stops)


def top_logprobs(value, name: str) -> int:
    """How many alternatives to report per token: 0 to MAX_TOP_LOGPROBS."""
    if not is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid(name, f"must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {shown(value)}")
    return value


def number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(name, f"must be a number, got {shown(value)}")
    # compared as given: an integer past the float range (10**400) must not be converted
    if not (low <= value <= high and math.isfinite(value)):
        raise invalid(name, f"must be from {low:g} to {high:g}, got {shown(value)}")
    return float(value)


def boolean(body: dict, name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(prefix + name, f"must be true or false, got {shown(value)}")
    return value


def shown(value, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters: a refused value may be megabytes long."""
    text_ = repr(value)
    return text_ if len(text_) <= limit else f"{text_[: limit - 3]}..."


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param, "invalid_value")


def missing(param: str) -> ApiError:
    return ApiError(
        400, f"missing required parameter: {param}", param, "missing_required_parameter"
    )


def unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: not supported here; {message}", param, "unsupported_value")


# ---------------------------------------------------------------- tools


def function_tool(function: dict, where: str, *, parameters: str = "parameters") -> dict:
    """One tool in OpenAI's function format, the one chat templates read: ``function``'s
    fields in their order (templates print them as they come), ``parameters`` read from the
    field of that name."""
    name, description = function.get("name"), function.get("description")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name", "must be a non-empty string")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.description", "must be a string")
    if not isinstance(function.get(parameters, {}), dict):
        raise invalid(f"{where}.{parameters}", "must be a JSON schema object")
    renamed = {"parameters" if k == parameters else k: v for k, v in function.items()}
    return {"type": "function", "function": renamed}


def tool_list(value, convert) -> list[dict]:
    """``tools``: an array (None: none), each tool ``convert(tool, where)``-ed to OpenAI's
    function format."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("tools", "must be an array of tools")
    return [convert(tool, f"tools[{i}]") for i, tool in enumerate(value)]


def chat_prompt(
    messages: list[dict], tools: list[dict], choice, limits: Limits, thinking: bool | None = None
) -> tuple:
    """The service prompt of ``messages`` with ``tools`` (OpenAI's function format) offered
    as ``choice`` says: "auto", "none", "required", or a tool's name (that tool, called),
    and the template's reasoning switch ``thinking`` (None: its default).
    Returns ``(prompt, tools offered, forced)``; a forced call starts the answer with the
    call's opening tag. ApiError when the model takes no tools, or cannot be made to call."""
    if not tools and choice not in ("auto", "none"):
        raise invalid("tool_choice", f"{shown(choice)} needs tools: the request offers none")
    if not tools or choice == "none":
        return Chat(messages, thinking=thinking), None, False
    fmt = limits.tools
    if fmt is None:
        raise unsupported("tools", f"the chat template of {limits.model_id} takes no tools")
    if choice == "auto":
        return Chat(messages, tools, thinking=thinking), tools, False
    if fmt.start is None:
        message = f"{limits.model_id} has no tool parser in mlx-lm: only 'auto' or 'none'"
        raise unsupported("tool_choice", message)
    if choice != "required":
        tools = [t for t in tools if t["function"]["name"] == choice]
        if not tools:
            raise invalid("tool_choice", f"no tool named {shown(choice)} among the tools")
    return Chat(messages, tools, fmt.start, thinking), tools, True


def call_arguments(value, where: str) -> dict:
    """A tool call's arguments (a JSON object, or its text) as the object templates read."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise invalid(where, f"is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise invalid(where, "must be a JSON object")
    return value


# ---------------------------------------------------------------- answers


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict | list | str  # as the parser gave them (a JSON object, usually)

    def arguments_json(self) -> str:
        args = self.arguments
        return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


@dataclass
class Piece:
    """What one step added to an answer: text, complete tool calls, and the step's tokens
    with their log-probs (None unless asked for; the end token's last where it ended the
    answer: ``end_token``)."""

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: TopLogprobs | None = None
    reasoning: str = ""  # the model's thinking (between its reasoning tags)
    end_token: int | None = None  # the end-of-sequence token that ended the answer here

    @property
    def counted(self) -> list[int]:
        """The tokens usage counts (the end token included): one log-prob entry each."""
        return self.tokens + ([] if self.end_token is None else [self.end_token])


class Answer:
    """An answer as its steps arrive: text and tool calls apart (mlx-lm's parser of the
    model's family reads each call between its tags; text that may begin a tag is held back
    until it cannot), its tokens' log-probs, how it finished.

    ``offered``: the tools offered (None: no call is looked for); ``forced``: the answer
    starts inside a call (its opening tag was put after the prompt); ``decode`` (token ids
    -> text): the first space the streaming detokenizer drops (mlx-lm's trim an answer's
    leading space) is put back where the tokens decode with it: a text completion's text is
    the concatenation of its tokens, and a chat answer resent by its client must tokenize
    as generated, or the prompt cache re-reads it (a byte-level BPE's " Paris" is one token,
    "Paris" another)."""

    def __init__(
        self,
        fmt: ToolFormat | None,
        offered: list[dict] | None,
        forced=False,
        decode: Callable[[list[int]], str] | None = None,
        *,
        reasoning: tuple[str, str] | None = None,
        thinking: bool = False,
    ):
        parses = fmt is not None and fmt.parse is not None and offered is not None
        self.fmt = fmt if parses else None
        self.offered = offered
        self.text = ""
        self.calls: list[ToolCall] = []
        self.tokens: list[int] = []
        self.logprobs: list[TopLogprobs] = []  # one row per counted token (:attr:`counted`)
        self.end_token: int | None = None  # the end-of-sequence token that ended it, if one
        self.reason: str | None = None
        self.stop_string: str | None = None
        self._held = ""  # text not shown yet: it may begin a call's opening tag
        self._call: str | None = "" if forced and parses else None  # a call's text so far
        self._decode = decode  # until the first text: then its space is put back, if lost
        self.reasoning = ""
        self._tags = reasoning  # (start, end) of the model's thinking; None: none looked for
        self._thinking = thinking and reasoning is not None  # inside the thinking now
        self._thought = ""  # text not shown yet: it may begin a reasoning tag
        self._trim = self._thinking  # whitespace after a tag is not shown

    @property
    def counted(self) -> list[int]:
        """The tokens usage counts: the answer's and its end token (one log-prob entry each,
        as mlx-lm's server gives the end token its entry)."""
        return self.tokens + ([] if self.end_token is None else [self.end_token])

    @property
    def finish_reason(self) -> str | None:
        """The service's reason ("stop", "length", "context"), or "tool_calls": stopped
        after calling."""
        return "tool_calls" if self.calls and self.reason == "stop" else self.reason

    def add(self, step: StepResponse) -> Piece:
        piece = Piece(
            tokens=list(step.tokens), logprobs=step.top_logprobs, end_token=step.end_token
        )
        self.end_token = step.end_token  # set by the last step only
        self.tokens += step.tokens
        if step.top_logprobs is not None:
            self.logprobs.append(step.top_logprobs)
        new = step.text
        if new and self._decode is not None:
            if self._decode(self.tokens).startswith(" "):  # it began with one: dropped
                new = " " + new
            self._decode = None
        final = step.finish_reason is not None
        if self._tags is not None:
            new = self._think(new, piece, final)
        self._split(new, piece, final=final)
        self.reason, self.stop_string = step.finish_reason, step.stop_string
        self.text += piece.text
        self.reasoning += piece.reasoning
        self.calls += piece.calls
        return piece

    def _think(self, new: str, piece: Piece, final: bool) -> str:
        """``new`` less the reasoning in it (into ``piece.reasoning``): the answer's text.
        Text that may begin a tag is held back until it cannot; whitespace after a tag is
        dropped (templates put newlines there)."""
        start, end = self._tags
        rest, text = self._thought + new, ""
        self._thought = ""
        while rest:
            if self._trim:
                rest = rest.lstrip()
                if not rest:
                    break
                self._trim = False
            tag = end if self._thinking else start
            at = rest.find(tag)
            if at < 0:
                keep = 0 if final else _begins(rest, tag)
                shown, self._thought = rest[: len(rest) - keep], rest[len(rest) - keep :]
                rest = ""
            else:
                shown, rest = rest[:at], rest[at + len(tag) :]
                self._trim = True
            if self._thinking:
                piece.reasoning += shown
            else:
                text += shown
            if at >= 0:
                self._thinking = not self._thinking
        return text

    def _split(self, new: str, piece: Piece, final: bool) -> None:
        if self.fmt is None:
            piece.text = new
            return
        start, end = self.fmt.start, self.fmt.end
        rest = self._held + new
        self._held = ""
        while rest:
            if self._call is None:
                at = rest.find(start)
                if at < 0:
                    keep = 0 if final else _begins(rest, start)
                    piece.text += rest[: len(rest) - keep]
                    self._held = rest[len(rest) - keep :]
                    return
                piece.text += rest[:at]
                self._call, rest = "", rest[at + len(start) :]
            else:  # the closing tag may have begun in an earlier step: look in all of it
                self._call += rest
                at = self._call.find(end) if end else -1  # none (Mistral's): to the end
                if at < 0:
                    break
                rest = self._call[at + len(end) :]
                self._close(self._call[:at], piece)
        if final and self._call is not None:  # cut short (max_tokens, stop): try it anyway
            self._close(self._call, piece)

    def _close(self, body: str, piece: Piece) -> None:
        """A call's text between its tags -> tool calls; text again if it does not parse."""
        self._call = None
        try:
            parsed = self.fmt.parse(body, self.offered)
        except (ValueError, KeyError, TypeError, AttributeError):
            parsed = None
        calls = parsed if isinstance(parsed, list) else [parsed]
        if parsed is None or not all(isinstance(c, dict) and "name" in c for c in calls):
            piece.text += f"{self.fmt.start}{body}{self.fmt.end}"
            return
        for c in calls:
            args = c.get("arguments", {})
            piece.calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", str(c["name"]), args))


def _begins(text_: str, tag: str) -> int:
    """Length of the longest end of ``text_`` that is a proper beginning of ``tag``."""
    for n in range(min(len(tag) - 1, len(text_)), 0, -1):
        if text_.endswith(tag[:n]):
            return n
    return 0


def token_entries(tokenizer, tokens: list[int], parts: list[TopLogprobs]) -> list[tuple]:
    """``(token text, log-prob, [(alternative's text, log-prob), ...])`` per token of
    ``tokens``, whose log-probs are ``parts`` (one per step) one after the other."""

    def piece(token: int) -> str:
        return tokenizer.decode([int(token)])

    if not tokens:
        return []
    fields = ("logprob", "ids", "logprobs")
    logprobs = TopLogprobs(*(np.concatenate([getattr(p, f) for p in parts]) for f in fields))

    return [
        (
            piece(token),
            float(logprobs.logprob[i]),
            [
                (piece(t), float(v))
                for t, v in zip(logprobs.ids[i], logprobs.logprobs[i], strict=True)
            ],
        )
        for i, token in enumerate(tokens)
    ]


# ---------------------------------------------------------------- usage


@dataclass(frozen=True)
class Outcome:
    """What a finished answer's usage is made of: the request as the worker took it up, the
    generation's statistics and where its beam shape came from."""

    started: Started
    stats: GenerationStats
    shape_source: str | None
    drafter_type: str | None = None  # the drafter's type (``Source.kind``), None without one

    @property
    def prompt_tokens(self) -> int:
        return self.started.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.started.cached_tokens

    @property
    def completion_tokens(self) -> int:
        return self.stats.completion_tokens  # the end token counted

    def redrafter(self) -> dict:
        """How the decoding went: the beam shape, decode steps (target passes after the
        prompt's), tokens per step, drafted tokens the target verified (tree nodes but the
        root) and how many of them it accepted, and the times: the prompt's (to the first
        token) and the decoding's after it, as `generate --json` reports them."""
        started, stats = self.started, self.stats
        shape = started.shape
        histogram = stats.accept_histogram
        return {
            "mode": started.mode.value,
            "beam_width": None if shape is None else shape.width,
            "beam_length": None if shape is None else shape.length,
            "min_prob": None if shape is None else shape.min_prob,
            "search_width": None if shape is None else shape.searched,
            "lookup": None if shape is None else shape.lookup,
            "shape_source": None if shape is None else self.shape_source,
            "drafter_type": self.drafter_type if started.mode.drafted else None,
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


class Stream:
    """One API's streamed answer: the events (``(name or None, JSON object or text)``) to
    send first, for each :class:`Piece`, and at the end."""

    def begin(self) -> list[tuple]:
        return []

    def piece(self, piece: Piece) -> list[tuple]:
        raise NotImplementedError

    def end(self, answer: Answer, outcome: Outcome) -> list[tuple]:
        raise NotImplementedError


class Api:
    """One API's wire format: its error object, whole answers and streams."""

    name = "OpenAI"

    def error_body(self, error: ApiError) -> dict:
        return error.body()

    def stream_error(self, error: ApiError) -> tuple:
        """The event that ends a stream an error broke."""
        return None, self.error_body(error)

    def response(self, call: Call, answer: Answer, outcome: Outcome) -> dict:
        raise NotImplementedError

    def stream(self, call: Call, started: Started) -> Stream:
        raise NotImplementedError
