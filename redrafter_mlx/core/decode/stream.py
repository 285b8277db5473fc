"""``stream_steps``: decode steps -> detokenized text, stop rules, timing and statistics, one
response per step; ``token_responses``: the same, one mlx-lm-style response per token.

Stops on an EOS token (never emitting tokens drafted past it), a stop string, ``max_tokens`` or
a full context. Library code: returns numbers, prints nothing.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import wired_limit

from redrafter_mlx.core.decode.adaptive import Adaptive, adaptive_steps
from redrafter_mlx.core.decode.decoder import Decoder
from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.step import Decoding, PhaseTimer, Step, TopLogprobs
from redrafter_mlx.core.decode.stops import find_stop_string, first_stop, held_back, stop_at
from redrafter_mlx.core.errors import ContextFull

CLEAR_CACHE_EVERY = 256  # decode steps between mx.clear_cache() calls (mlx-lm: 256 tokens)
SOURCES = ("drafter", "lookup", "both")  # where accepted drafts came from (Step.accepted_from)


def tokens_per_step(histogram: dict[int, int], steps: int) -> float:
    """Mean tokens emitted per decode step from ``{tokens emitted: steps}`` (the prefill's
    first token is no step and not counted)."""
    return sum(k * n for k, n in histogram.items()) / max(steps, 1)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0  # decode steps after the prefill (each one target pass)
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    tree_sizes: list[int] = field(default_factory=list)
    accept_histogram: Counter = field(default_factory=Counter)  # tokens emitted per step
    # Accepted drafted tokens by the beams that held them: "drafter", "lookup" or "both".
    accepted_from: Counter = field(default_factory=Counter)
    syncs: int = 0
    peak_memory_gb: float = 0.0
    # The end-of-sequence token that ended the answer (None: it ended otherwise). It is not
    # in the answer's tokens or text, and is counted in ``completion_tokens``.
    end_token: int | None = None

    def add_step(self, step: Step, seconds: float) -> None:
        """Count one decode step; ``seconds``: the generation's time up to its end."""
        self.steps += 1
        self.syncs += step.syncs
        self.tree_sizes.append(step.tree_size)
        self.accept_histogram[len(step.tokens)] += 1
        if step.accepted_from:
            self.accepted_from[step.accepted_from] += len(step.tokens) - 1
        self.generation_seconds = seconds

    @property
    def completion_tokens(self) -> int:
        """The tokens the model generated, the end token that ended the answer included: the
        one counting rule of usage (mlx-lm's ``generation_tokens`` and OpenAI's
        ``completion_tokens`` count it too)."""
        return self.generation_tokens + (self.end_token is not None)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / max(self.prompt_seconds, 1e-9)

    @property
    def generation_tps(self) -> float:
        """Tokens after the first one, per second after the first one (as mlx-lm reports it)."""
        return max(self.generation_tokens - 1, 0) / max(self.generation_seconds, 1e-9)

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step(self.accept_histogram, self.steps)

    def accepted_shares(self) -> dict[str, int]:
        """Accepted drafted tokens per source, every source named (0 when none)."""
        return {source: self.accepted_from[source] for source in SOURCES}

    @property
    def mean_tree_size(self) -> float:
        return sum(self.tree_sizes) / max(len(self.tree_sizes), 1)

    @property
    def syncs_per_step(self) -> float:
        return self.syncs / max(self.steps, 1)


@dataclass
class StepResponse:
    text: str  # new text since the previous response
    tokens: list[int]  # tokens emitted by this step (after stop rules)
    stats: GenerationStats
    finish_reason: str | None = None  # "stop", "length", "context" or None while running
    # (len(tokens) + ended, V): the target's log-probs each token was chosen from, the end
    # token's last where it ended the answer (``ended``; None unless the decoding asked for
    # them, ``Decoding.logprobs``): one row per token counted in ``completion_tokens``
    logprobs: mx.array | None = None
    # each token's log-prob and the most likely alternatives (``Decoding.top_logprobs``),
    # rows as ``logprobs``'
    top_logprobs: TopLogprobs | None = None
    stop_string: str | None = None  # the stop string that ended the answer, if one did

    @property
    def end_token(self) -> int | None:
        """The end-of-sequence token this step ended the answer with (not in ``tokens``,
        counted in ``completion_tokens``; its log-probs are the last row); None otherwise."""
        ended = self.finish_reason == "stop" and self.stop_string is None
        return self.stats.end_token if ended and self.stats is not None else None


@dataclass
class GenerationResponse:
    """One token of :func:`stream_generate`, with the fields of mlx-lm's response of the same
    name, so code written against ``mlx_lm.stream_generate`` can switch.

    ``from_draft``: an accepted drafted token (the last token of each step is the target's own
    choice). ``text`` is the new text since the previous response; a step's text arrives with
    its last token (its other tokens have ``""``). ``logprobs`` ``(V,)``: the target's
    log-probs the token was chosen from, as mlx-lm's (None unless asked for: they cost a
    log-softmax per token). An answer ended by its end-of-sequence token ends, as mlx-lm's
    does, with a response carrying that token (no text of its own, counted in
    ``generation_tokens``); ``token`` is None only on a last response that adds no token (a
    full context ended the answer). ``stats``: the running :class:`GenerationStats`.
    """

    text: str
    token: int | None
    logprobs: mx.array | None
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    stats: GenerationStats | None = None


def token_responses(steps: Iterator[StepResponse]) -> Iterator[GenerationResponse]:
    """:func:`stream_steps`' responses one token at a time (same tokens and text)."""
    count = 0
    for step in steps:
        stats = step.stats
        tokens = list(step.tokens)
        if step.end_token is not None:
            tokens.append(step.end_token)  # mlx-lm's last response carries the end token
        elif step.finish_reason and not tokens:
            tokens = [None]
        last = len(tokens) - 1
        for i, token in enumerate(tokens):
            count += token is not None
            yield GenerationResponse(
                text=step.text if i >= last else "",
                token=token,
                logprobs=None
                if step.logprobs is None or i >= len(step.logprobs)
                else step.logprobs[i],
                from_draft=i < len(step.tokens) - 1 and stats.steps > 0,
                prompt_tokens=stats.prompt_tokens,
                prompt_tps=stats.prompt_tps,
                generation_tokens=count,
                generation_tps=stats.generation_tps,
                peak_memory=stats.peak_memory_gb,
                finish_reason=step.finish_reason if i >= last else None,
                stats=stats,
            )


def decode_steps(
    decoder: Decoder,
    sequence: Sequence,
    prompt: list[int],
    decoding: Decoding,
    *,
    timer: PhaseTimer | None = None,
    cancelled=None,
    adaptive: Adaptive | None = None,
) -> Iterator[Step]:
    """The decode loop: the prefill's first token, then one :class:`Step` per decode step,
    until the context is full (ContextFull) or the caller stops iterating; with
    ``adaptive``, each step's mode chosen by it (:func:`.adaptive.adaptive_steps`)."""
    state, first = decoder.prefill(sequence, prompt, decoding, timer=timer, cancelled=cancelled)
    if first is not None:
        yield first
    if adaptive is not None:
        yield from adaptive_steps(decoder, state, adaptive)
    while True:
        state, step = decoder.step(state)
        yield step


def stream_steps(
    decoder: Decoder,
    tokenizer,
    prompt: list[int],
    decoding: Decoding,
    *,
    sequence: Sequence,
    max_tokens: int = 256,
    stop_strings: tuple[str, ...] = (),
    timer: PhaseTimer | None = None,
    cancelled=None,
    adaptive: Adaptive | None = None,
) -> Iterator[StepResponse]:
    """Generate up to ``max_tokens`` tokens after ``prompt`` (token ids), one response per step.

    ``sequence`` may already hold a prefix (a chat); ``prompt`` is then only the new tokens.
    Stop strings are looked for token by token and text that may begin one is held back, so
    the text and tokens returned do not depend on how tokens were grouped into steps: a
    ReDrafter answer stops exactly where the autoregressive one does. ``cancelled`` is asked
    between prompt chunks (Cancelled is raised when it says so).

    As mlx-lm's generation does, it raises Metal's wired memory limit to the recommended
    working set meanwhile (a no-op elsewhere), and returns MLX's cached buffers to the system
    every ``CLEAR_CACHE_EVERY`` steps (each cache growth leaves the old buffers there).
    """
    steps = decode_steps(
        decoder, sequence, prompt, decoding, timer=timer, cancelled=cancelled, adaptive=adaptive
    )
    with wired_limit(decoder.model):
        yield from _stream_steps(steps, tokenizer, len(prompt), max_tokens, stop_strings)


def _stream_steps(steps, tokenizer, prompt_tokens, max_tokens, stop_strings, began=None):
    """:func:`stream_steps` over ``steps``; ``began``: when the prompt began (a
    ``time.perf_counter()``; None: now)."""
    stats = GenerationStats(prompt_tokens=prompt_tokens)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    eos = set(tokenizer.eos_token_ids)
    mx.reset_peak_memory()
    tic = time.perf_counter() if began is None else began
    first = True
    shown = 0  # characters of the text already returned
    while True:
        try:
            step = next(steps)
        except ContextFull:
            yield _finish(detokenizer, stats, "context", shown)
            return
        now = time.perf_counter()
        if first:
            stats.prompt_seconds, tic, first = now - tic, now, False
        else:
            stats.add_step(step, now - tic)
            if stats.steps % CLEAR_CACHE_EVERY == 0:
                mx.clear_cache()
        emitted, reason = apply_stops(step.tokens, eos, max_tokens - stats.generation_tokens)
        ended_by_eos = reason == "stop"
        emitted, cut = _add_until_stop_string(detokenizer, emitted, stop_strings)
        stats.generation_tokens += len(emitted)
        if cut is None and reason is not None:
            detokenizer.finalize()  # may flush held characters: look at them too
            cut = find_stop_string(detokenizer.text, stop_strings, shown)
        if cut is not None:
            reason, end = "stop", cut
        elif reason is not None:
            end = len(detokenizer.text)
            if ended_by_eos:  # the end token: not in the answer, counted in its usage
                stats.end_token = step.tokens[len(emitted)]
        else:
            end = len(detokenizer.text) - held_back(detokenizer.text, stop_strings)
        text, shown = detokenizer.text[shown:end], max(shown, end)
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        rows = len(emitted) + (cut is None and ended_by_eos)  # the end token's row too
        logprobs = None if step.logprobs is None else step.logprobs[:rows]
        top = None if step.top_logprobs is None else step.top_logprobs[:rows]
        matched = None if cut is None else stop_at(detokenizer.text, stop_strings, cut)
        yield StepResponse(text, emitted, stats, reason, logprobs, top, matched)
        if reason is not None:
            steps.close()
            return


def responses(
    steps: Iterator[Step],
    tokenizer,
    prompt_tokens: int,
    *,
    max_tokens: int = 256,
    stop_strings: tuple[str, ...] = (),
    began: float | None = None,
) -> Iterator[StepResponse]:
    """:func:`stream_steps`' responses over steps from elsewhere (a batch's): the prefill's
    first step (where it emits one) first, then one per decode step."""
    return _stream_steps(steps, tokenizer, prompt_tokens, max_tokens, stop_strings, began)


def apply_stops(tokens: list[int], eos: set[int], room: int) -> tuple[list[int], str | None]:
    """Cut a step's tokens at the first EOS (excluded) and at the token budget ``room``: the
    loop's stop rule, with the reason ("stop", "length") when it stopped."""
    stop = first_stop(tokens[:room], eos)
    if stop is not None:
        return tokens[:stop], "stop"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None


def _add_until_stop_string(
    detokenizer, tokens: list[int], stop_strings: tuple[str, ...]
) -> tuple[list[int], int | None]:
    """Feed ``tokens`` one by one; stop after the one that completes a stop string. Returns
    the tokens fed and where the stop string starts in the text (None if none appeared)."""
    if not stop_strings:
        for token in tokens:
            detokenizer.add_token(token)
        return tokens, None
    for i, token in enumerate(tokens):
        before = len(detokenizer.text)
        detokenizer.add_token(token)
        cut = find_stop_string(detokenizer.text, stop_strings, before)
        if cut is not None:
            return tokens[: i + 1], cut
    return tokens, None


def _finish(detokenizer, stats: GenerationStats, reason: str, shown: int) -> StepResponse:
    """The last response of an answer cut short (the context is full): the rest of the text."""
    detokenizer.finalize()
    return StepResponse(detokenizer.text[shown:], [], stats, reason)
